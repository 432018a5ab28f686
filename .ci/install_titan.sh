#!/usr/bin/env bash
# Install torchtitan 0.3.0 for the tests on its own code (tests/support/titan_support.py), never replacing torch.
# torchtitan's declared deps include datasets (which pins fsspec below what s3fs needs) and wandb:
# the tests use neither, so torchtitan goes in with --no-deps plus the deps its imports need.
# Never fails the CI run: when the install is impossible (no network), those tests skip with a reason.
set -uo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -c "import torch" || exit 0
if python -c "import importlib.metadata as m, sys; sys.exit(m.version('torchtitan') != '0.3.0')" 2>/dev/null; then
  exit 0
fi
python -m pip install -q --no-deps torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 \
    spmd_types==0.2.3 'tyro>=0.9' 'docstring-parser>=0.16' 'typeguard>=4' 'einops>=0.8' \
  && python -m pip install -q 'tensorboard>=2.15' \
  || echo "install_titan.sh: torchtitan could not be installed; the torchtitan tests will skip" >&2
exit 0
