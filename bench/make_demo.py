"""Regenerate the bundled demo checkpoint in converter/demo_data/ (used by ``ckptconv demo``).

A tiny torchtitan-style Llama (tests/support/models.py: dim 32, 2 layers, 4 heads / 2 KV heads, vocab 64,
bfloat16) trained 3 AdamW steps under FSDP2 on a real 2-rank gloo world and saved with
``dcp.save({"model", "optim", "extra"})`` from both ranks: keys ``model.tok_embeddings.weight``,
``optim.state.<fqn>.exp_avg``, ``extra.step``, ...

    python bench/make_demo.py            # rewrites converter/demo_data/, then commit it

The training record (losses, boxes per rank) goes to bench/out/demo/_fixture.json (not shipped).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from ckpt_factory import FIXTURE_JSON, FixtureSpec, build_checkpoint  # noqa: E402
from models import ModelArgs  # noqa: E402

DEMO_DIR = ROOT / "converter" / "demo_data"
WORK_DIR = ROOT / "bench" / "out" / "demo"
DEMO_SPEC = FixtureSpec("demo", (("dp", 2),), ModelArgs(vocab_size=64, dtype="bfloat16"))


def _clear(path: Path) -> None:
    """Remove a previous demo (only DCP files; refuses anything else, to protect stray work)."""
    if not path.exists():
        return
    others = [p.name for p in path.iterdir() if p.name != ".metadata" and not p.name.endswith(".distcp")]
    if others:
        raise SystemExit(f"{path} holds non-DCP files {others}; move them away first")
    shutil.rmtree(path)


def main() -> None:
    _clear(DEMO_DIR)
    ckpt = build_checkpoint(DEMO_SPEC, DEMO_DIR, WORK_DIR)
    info = json.loads((WORK_DIR / FIXTURE_JSON).read_text())
    files = sorted(ckpt.iterdir())
    total = sum(p.stat().st_size for p in files)
    print(f"wrote {ckpt} ({len(files)} files, {total / 1024:.0f} KiB) in {info['build_seconds']} s")
    print(f"losses rank 0: train {info['train_losses']['0']}, continue {info['continue_losses']['0']}")


if __name__ == "__main__":
    main()
