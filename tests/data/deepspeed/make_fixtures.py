"""Rebuild the DeepSpeed fixtures here with real DeepSpeed 0.19.8 (CPU, gloo):

    python tests/data/deepspeed/make_fixtures.py

For ZeRO-2 and ZeRO-3 (world 2, the tiny model of ``ds_support.TINY``, 3 AdamW steps): the
engine's checkpoint goes through DeepSpeed's own ``ds_to_universal.py``; kept are the universal
checkpoint (``zero<stage>/universal``) and the engine's live full state (``zero<stage>/live.pt``,
read with DeepSpeed's ``safe_get_full_*``: the oracle).
"""

import shutil
import sys
import tempfile
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_TESTS.parent), str(_TESTS / "support")]  # the repository, tests/support/

from ds_support import DATA, to_universal, train_and_save  # noqa: E402


def main() -> None:
    for stage in (2, 3):
        with tempfile.TemporaryDirectory() as tmp:
            tag = train_and_save(Path(tmp), stage, world=2)
            out = DATA / f"zero{stage}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            to_universal(tag, Path(tmp) / "universal", stage)
            shutil.copytree(Path(tmp) / "universal", out / "universal")
            shutil.copy(Path(tmp) / "live.pt", out / "live.pt")
            print(f"{out}: done")


if __name__ == "__main__":
    main()
