#!/usr/bin/env bash
# Install megatron-core 0.19.2 for the tests on its own code (tests/support/megatron_support.py), never replacing torch.
# Only a cp312 wheel exists, but its Python code runs under 3.11: the wheel is downloaded for 3.12 with
# --no-deps and unzipped into site-packages (package + dist-info, so importlib.metadata sees the version;
# the one compiled module, datasets/helpers_cpp, is never imported by dist_checkpointing).
# `import megatron.core` imports triton unconditionally: triton goes in with --no-deps.
# Never fails the CI run: when the install is impossible (no network), those tests skip with a reason.
set -uo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1
MCORE_VERSION=0.19.2
python -c "import torch" || exit 0
have_mcore() {
  python -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '$MCORE_VERSION')" 2>/dev/null
}
fail() { echo "install_megatron.sh: $1; the megatron tests will skip" >&2; exit 0; }
if ! python -c "import triton" 2>/dev/null; then
  python -m pip install -q --no-deps triton || fail "triton could not be installed"
fi
have_mcore && exit 0
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
have_mcore || fail "megatron-core does not import after unpacking"
python -c "import megatron.core" 2>/dev/null || fail "megatron.core does not import"
exit 0
