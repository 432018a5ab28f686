# Shared by the .ci/install_*.sh scripts (sourced): how an install that cannot be done ends.
# ci_fail SCRIPT WHAT MESSAGE: say so; exit 0 (the WHAT tests then skip with a reason), or exit 1 under
# CKPTCONV_REQUIRE_FRAMEWORKS=1 (.ci/run sets it when CI is set), which fails the CI run.
ci_fail() {
  echo "$1: $3; the $2 tests will skip" >&2
  if [ "${CKPTCONV_REQUIRE_FRAMEWORKS:-0}" != 0 ]; then
    echo "$1: CKPTCONV_REQUIRE_FRAMEWORKS=$CKPTCONV_REQUIRE_FRAMEWORKS: a framework that cannot be installed fails the run" >&2
    exit 1
  fi
  exit 0
}
# has_version DIST VERSION [MODULE]: DIST is installed at exactly VERSION (and MODULE imports)
has_version() {
  python -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null \
    && { [ -z "${3:-}" ] || python -c "import $3" >/dev/null 2>&1; }
}
