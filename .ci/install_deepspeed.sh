#!/usr/bin/env bash
# Install DeepSpeed 0.19.8 for the tests on its own code (tests/support/ds_support.py), never replacing torch.
# DeepSpeed's declared deps would pull another torch, so it goes in with --no-deps and DS_BUILD_OPS=0
# (no compiled ops; it runs on CPU with gloo), plus the deps its imports need (psutil, tqdm: a fresh
# venv without them printed "deepspeed does not import").
# When the install is impossible (no network) those tests skip with a reason; under
# CKPTCONV_REQUIRE_FRAMEWORKS=1 (.ci/run sets it when CI is set) this script exits 1 instead, failing the run.
# CKPTCONV_DEEPSPEED_VERSION overrides the version (a bogus one breaks the install on purpose: the CI check).
set -uo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1
DS_VERSION=${CKPTCONV_DEEPSPEED_VERSION:-0.19.8}
source "$(dirname "$0")/lib.sh"
fail() { ci_fail install_deepspeed.sh DeepSpeed "$1"; }
python -c "import torch" || fail "torch does not import"
# accelerate for the transformers.Trainer + DeepSpeed runs (tests/support/ds_trainer_run.py), --no-deps (it
# pulls torch) plus what its import needs; they skip without it (and fail under CI)
has_version accelerate 1.15.0 accelerate || { python -m pip install -q huggingface_hub numpy psutil pyyaml safetensors \
  && python -m pip install -q --no-deps accelerate==1.15.0; } \
  || echo "install_deepspeed.sh: accelerate could not be installed; the Trainer tests will skip" >&2
has_version deepspeed "$DS_VERSION" deepspeed && exit 0
python -m pip install -q einops hjson msgpack ninja numpy packaging psutil py-cpuinfo 'pydantic>=2' tqdm \
  && DS_BUILD_OPS=0 python -m pip install -q --no-deps --no-build-isolation "deepspeed==$DS_VERSION" \
  || fail "deepspeed $DS_VERSION could not be installed"
has_version deepspeed "$DS_VERSION" deepspeed || fail "deepspeed does not import"
