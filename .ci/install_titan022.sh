#!/usr/bin/env bash
# torchtitan 0.2.2 in its own venv (never beside 0.3.0): tests/plan/test_auto_plan.py builds its MoE
# models from it (tests skip without it). Cheap: torch from the local wheel when there, no deps pulled.
set -euo pipefail
VENV=${TITAN022_VENV:-/work/venvs/titan022}
[ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torchtitan, torch" 2>/dev/null && exit 0
python -m venv "$VENV"
WHEEL=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1 || true)
"$VENV/bin/pip" install -q "${WHEEL:-torch==2.13.0}"
"$VENV/bin/pip" install -q --no-deps torchtitan==0.2.2
"$VENV/bin/pip" install -q torchdata tomli fsspec tyro einops tokenizers numpy
