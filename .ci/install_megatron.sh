#!/usr/bin/env bash
# Install megatron-core 0.19.2 for the tests on its own code (tests/support/megatron_support.py), never replacing torch.
# Only a cp312 wheel exists, but its Python code runs under 3.11: the wheel is downloaded for 3.12 with
# --no-deps and unzipped into site-packages (package + dist-info, so importlib.metadata sees the version;
# the one compiled module, datasets/helpers_cpp, is never imported by dist_checkpointing).
# `import megatron.core` imports triton unconditionally: triton goes in with --no-deps.
# When the install is impossible (no network) those tests skip with a reason; under
# CKPTCONV_REQUIRE_FRAMEWORKS=1 (.ci/run sets it when CI is set) this script exits 1 instead, failing the run.
# CKPTCONV_MEGATRON_VERSION overrides the version (a bogus one breaks the install on purpose: the CI check).
set -uo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1
MCORE_VERSION=${CKPTCONV_MEGATRON_VERSION:-0.19.2}
source "$(dirname "$0")/lib.sh"
have_mcore() { has_version megatron-core "$MCORE_VERSION" "${1:-}"; }
fail() { ci_fail install_megatron.sh megatron "$1"; }
python -c "import torch" || fail "torch does not import"
if ! python -c "import triton" 2>/dev/null; then
  python -m pip install -q --no-deps triton || fail "triton could not be installed"
fi
have_mcore megatron.core && exit 0
tmp=$(mktemp -d) || fail "no temporary directory"
trap 'rm -rf "$tmp"' EXIT
python -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
    -d "$tmp" "megatron-core==$MCORE_VERSION" || fail "megatron-core could not be downloaded"
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || fail "no site-packages"
python - "$tmp" "$site" <<'PY' || fail "megatron-core could not be unpacked"
import pathlib, sys, zipfile
src, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = src.glob("megatron_core-*.whl")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(("megatron/", "megatron_core-"))]
    for n in names:  # only the wheel's own two top-level trees, nothing outside site-packages
        if ".." in pathlib.PurePosixPath(n).parts or n.startswith("/"):
            raise SystemExit(f"unsafe path in wheel: {n}")
    z.extractall(site, members=names)
PY
have_mcore || fail "megatron-core $MCORE_VERSION has no package metadata after unpacking"
have_mcore megatron.core || fail "megatron.core does not import"
exit 0
