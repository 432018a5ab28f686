#!/usr/bin/env bash
# Install DeepSpeed 0.19.8 for the tests on its own code (tests/support/ds_support.py), never replacing torch.
# DeepSpeed's declared deps would pull another torch, so it goes in with --no-deps and DS_BUILD_OPS=0
# (no compiled ops; it runs on CPU with gloo), plus the few deps its imports need.
# Never fails the CI run: when the install is impossible (no network), those tests skip with a reason.
set -uo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -c "import torch" || exit 0
if python -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '0.19.8')" 2>/dev/null; then
  exit 0
fi
python -m pip install -q einops hjson msgpack ninja py-cpuinfo 'pydantic>=2' \
  && DS_BUILD_OPS=0 python -m pip install -q --no-deps --no-build-isolation deepspeed==0.19.8 \
  || echo "install_deepspeed.sh: deepspeed could not be installed; the DeepSpeed tests will skip" >&2
exit 0
