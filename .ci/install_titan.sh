#!/usr/bin/env bash
# Install torchtitan 0.3.0 for the tests on its own code (tests/support/titan_support.py), never replacing torch.
# torchtitan's declared deps include datasets (which pins fsspec below what s3fs needs) and wandb:
# the tests use neither, so torchtitan goes in with --no-deps plus the deps its imports need.
# When the install is impossible (no network) those tests skip with a reason; under
# CKPTCONV_REQUIRE_FRAMEWORKS=1 (.ci/run sets it when CI is set) this script exits 1 instead, failing the run.
# CKPTCONV_TITAN_VERSION overrides the version (a bogus one breaks the install on purpose: the CI check).
set -uo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1
TITAN_VERSION=${CKPTCONV_TITAN_VERSION:-0.3.0}
source "$(dirname "$0")/lib.sh"
fail() { ci_fail install_titan.sh torchtitan "$1"; }
python -c "import torch" || fail "torch does not import"
has_version torchtitan "$TITAN_VERSION" torchtitan && exit 0
python -m pip install -q --no-deps "torchtitan==$TITAN_VERSION" torchdata==0.11.0 torch_checkpointing==0.1.1 \
    spmd_types==0.2.3 'tyro>=0.9' 'docstring-parser>=0.16' 'typeguard>=4' 'einops>=0.8' \
  && python -m pip install -q 'tensorboard>=2.15' \
  || fail "torchtitan $TITAN_VERSION could not be installed"
has_version torchtitan "$TITAN_VERSION" torchtitan || fail "torchtitan does not import"
