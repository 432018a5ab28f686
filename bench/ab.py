"""One conversion step, two versions, alternating: the paired ratio of B's wall time to A's.

On a machine whose speed drifts between runs (this VM: the same copy 0.9-2.2 s), only runs made
side by side compare. Each pair runs A and B one after the other (the order flips every pair),
each cold as ``bench/datapath.py`` runs its steps (input read once, then dropped from the page
cache; ``sync`` counted); the result is the median over pairs of B / A, with each side's phases
(``CKPTCONV_TIMINGS``).

    python bench/ab.py --base ../old-checkout --step reshard --pairs 6          # a commit against another
    python bench/ab.py --step to-universal --env-a CKPTCONV_PREFETCH_MIB=0      # a knob off (A) and on (B)
    python bench/ab.py --base ../old --step from-universal --mesh tp2,dp32      # the card's 64-rank target
    python bench/ab.py --base ../old --step reshard --source /data/ckpt         # any DCP checkpoint

A is ``--base`` (another checkout's code; default this one) with ``--env-a``; B is this checkout
with ``--env-b``. Results: ``bench/results/<date>T<time>-ab-<step>-<size>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from datapath import given_checkpoint, input_label, phases  # noqa: E402
from make_checkpoint import OUT, parse_size  # noqa: E402
from run import PY, RESULTS, _remove, ensure_checkpoint, measure  # noqa: E402

STEPS = ("to-universal", "from-universal", "reshard")


def command(code: Path, step: str, src: Path, uni: Path, out: Path, mesh: str = "dp3") -> tuple[list[str], Path]:
    """The step's command running ``code``'s ckptconv, and what it reads."""
    run = [PY, "-c", f"import sys; sys.path.insert(0, {str(code)!r}); from converter.cli.app import main; main()"]
    if step == "to-universal":
        return [*run, "to-universal", str(src), str(out), "--no-progress"], src
    if step == "from-universal":
        return [*run, "from-universal", str(uni), str(out), "--mesh", mesh, "--no-progress"], uni
    return [*run, "from-universal", str(src), str(out), "--mesh", mesh, "--no-progress"], src


def one(code: Path, env: dict[str, str], step: str, src: Path, uni: Path, out: Path, mesh: str = "dp3") -> dict:
    """One cold run: wall seconds, return code and phases."""
    _remove(out)
    cmd, reads = command(code, step, src, uni, out, mesh)
    saved = {k: os.environ.get(k) for k in [*env, "CKPTCONV_TIMINGS"]}
    os.environ.update(env | {"CKPTCONV_TIMINGS": "1"})
    try:
        run = measure(cmd, reads, sync=True, cold=True)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        _remove(out)
    return {"wall_s": round(run.wall_s, 3), "rc": run.rc, "phases_s": phases(run.tail)}


def _env(pairs: list[str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in pairs)


def summarize(runs: list[dict]) -> dict:
    """The median over pairs of B / A (pairs where both succeeded) and each side's medians."""
    ok = [r for r in runs if r["a"]["rc"] == 0 and r["b"]["rc"] == 0]
    out: dict = {"pairs": len(ok), "ratio_b_over_a": statistics.median(r["b"]["wall_s"] / r["a"]["wall_s"] for r in ok)
                 if ok else None}
    for side in "ab":
        walls = [r[side]["wall_s"] for r in ok]
        out[f"{side}_wall_s"] = statistics.median(walls) if walls else None
        ph = [r[side]["phases_s"] for r in ok if r[side]["phases_s"]]
        out[f"{side}_phases_s"] = {k: round(statistics.median(p.get(k, 0.0) for p in ph), 3) for k in ph[0]} if ph else {}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", choices=STEPS, required=True)
    p.add_argument("--size", default="1GB", help="checkpoint size (bench/out cache; default 1GB)")
    p.add_argument("--source", default=None, help="a DCP checkpoint folder to convert instead of the bench's own")
    p.add_argument("--mesh", default="dp3", help="from-universal and reshard's target mesh (default dp3)")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--base", default=str(BENCH.parent), help="checkout whose code A runs (default: this one)")
    p.add_argument("--env-a", action="append", default=[], metavar="K=V", help="environment of A's runs")
    p.add_argument("--env-b", action="append", default=[], metavar="K=V", help="environment of B's runs")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    size = parse_size(args.size)
    what = Path(args.source).resolve() if args.source else size
    src = Path((given_checkpoint(what, "--source") if args.source else ensure_checkpoint(size))["path"])
    label = input_label(what)
    work = OUT / f"ab-{label}"
    _remove(work)
    work.mkdir(parents=True)
    uni, out = work / "uni", work / "out"
    sides = {"a": (Path(args.base).resolve(), _env(args.env_a)), "b": (BENCH.parent, _env(args.env_b))}
    runs = []
    try:
        if args.step == "from-universal":
            _remove(uni)
            cmd, _ = command(BENCH.parent, "to-universal", src, uni, uni)
            measure(cmd, src, sync=True, cold=False)
        for i in range(args.pairs):
            order = "ab" if i % 2 == 0 else "ba"
            pair = {side: one(*sides[side], args.step, src, uni, out, args.mesh) for side in order}
            runs.append(pair)
            print(f"  pair {i + 1}/{args.pairs} ({order}): A {pair['a']['wall_s']:.2f} s  B {pair['b']['wall_s']:.2f} s  "
                  f"B/A {pair['b']['wall_s'] / pair['a']['wall_s']:.3f}", file=sys.stderr, flush=True)
    finally:
        _remove(work)
    doc = {"command": " ".join(["python", "bench/ab.py", *(argv if argv is not None else sys.argv[1:])]),
           "step": args.step, "mesh": args.mesh, "source": str(src), "size": label, "a": {"code": str(sides["a"][0]), "env": sides["a"][1]},
           "b": {"code": str(sides["b"][0]), "env": sides["b"][1]}, "runs": runs, "summary": summarize(runs)}
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M")
    path = Path(args.out) if args.out else RESULTS / f"{stamp}-ab-{args.step}-{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    s = doc["summary"]
    print(f"{args.step} {label} (--mesh {args.mesh}): B/A {s['ratio_b_over_a']:.3f} over {s['pairs']} pairs "
          f"(A {s['a_wall_s']:.2f} s, B {s['b_wall_s']:.2f} s)\nJSON: {path}")


if __name__ == "__main__":
    main()
