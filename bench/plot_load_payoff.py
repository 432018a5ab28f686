"""Plot a ``bench/load_payoff.py`` result: the resumed job's ``dcp.load`` time (slowest rank) against
its rank count, for the original checkpoint resharded online, ckptconv's ``dedup`` output and
``--local-files rank``; one panel per target layout (FSDP2 ``dp<W>``, TP2 x FSDP2 ``tp2,dp<W/2>``).

    python bench/plot_load_payoff.py bench/results/load_payoff-20261203T130235.json   # -> the .png beside it
    python bench/plot_load_payoff.py RESULT.json --out docs/load_payoff.png

Each line joins the medians over rounds of the slowest rank's wall time (the table's ``wall_s``);
the small markers are the rounds. Needs matplotlib (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABELS = {"original": "original, resharded online by DCP", "dedup": "ckptconv from-universal (dedup)",
          "rank": "ckptconv --local-files rank"}
STYLES = {"original": ("o-", "tab:red"), "dedup": ("s--", "tab:blue"), "rank": ("^-", "tab:green")}


def layout_of(mesh: str) -> str:
    return "TP2 x FSDP2 (tp2,dp<W/2>)" if mesh.startswith("tp") else "FSDP2 (dp<W>)"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in doc["rows"] if not r.get("warmup")]  # the warm-up rounds are not plotted
    layouts = sorted({layout_of(s["mesh"]) for s in doc["summary"]}, key=lambda t: t.startswith("TP"))
    fig, axes = plt.subplots(1, len(layouts), figsize=(5.2 * len(layouts), 4.2), sharey=True, squeeze=False)
    worlds = sorted({s["world"] for s in doc["summary"]})
    for ax, layout in zip(axes[0], layouts):
        for variant in LABELS:
            mine = sorted((s for s in doc["summary"] if layout_of(s["mesh"]) == layout and s["variant"] == variant),
                          key=lambda s: s["world"])
            if not mine:
                continue
            style, color = STYLES[variant]
            ax.plot([s["world"] for s in mine], [s["wall_s"] for s in mine], style, color=color, label=LABELS[variant])
            rounds: dict[tuple, float] = {}  # (world, round) -> slowest rank's wall
            for r in timed:
                if layout_of(r["mesh"]) == layout and r["variant"] == variant:
                    k = (r["world"], r["round"])
                    rounds[k] = max(rounds.get(k, 0.0), r["wall_s"])
            ax.plot([w for w, _ in rounds], list(rounds.values()), ".", color=color, alpha=0.45, ms=5)
        ax.set_title(layout, fontsize=10)
        ax.set_xlabel("ranks (gloo, CPU)")
        ax.set_xticks(worlds)
        ax.grid(alpha=0.3)
    top = max([s["wall_s"] for s in doc["summary"]] + [r["wall_s"] for r in timed])
    axes[0][0].set_ylim(0, 1.08 * top)  # shared y: one limit that holds every line and dot of both panels
    axes[0][0].set_ylabel("dcp.load wall s, slowest rank\n(line: median of rounds; dots: rounds)")
    axes[0][-1].legend(fontsize=8, loc="best")
    src = doc["source"]
    load = doc.get("loadavg")
    fig.suptitle(f"The resumed job's load of a {src['bytes'] / 1e9:.2f} GB FSDP{src['world']} checkpoint, "
                 f"{doc['repeats']} rounds" + (f" (load average at the end {load[0]:.0f} on "
                                                f"{doc.get('cpu_count', '?')} cores)" if load else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="a bench/results/load_payoff-*.json")
    ap.add_argument("--out", type=Path, help="the PNG (default: the result's path with .png)")
    a = ap.parse_args(argv)
    out = a.out or a.result.with_suffix(".png")
    plot(json.loads(a.result.read_text()), out)
    print(out)


if __name__ == "__main__":
    main()
