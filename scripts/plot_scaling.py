"""Speedup over eager and scaling efficiency vs GPU count, from compare.py outputs.

    python scripts/plot_scaling.py outputs/compare/mnist_1gpu outputs/compare/mnist_2gpu \
        --output scaling.png

Each argument is a comparison directory (its compare.json); the GPU count is the
comparison's ``nproc``. Efficiency at N GPUs = throughput(N) / (N × throughput(1)), per
mode. Prints a Markdown table and writes the PNG.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(dirs):
    """{mode: {nproc: units/s}} from the compare.json of each directory."""
    table = defaultdict(dict)
    for d in dirs:
        data = json.loads((Path(d) / "compare.json").read_text())
        for row in data["rows"]:
            if row.get("throughput"):
                table[row["mode"]][int(data["nproc"])] = float(row["throughput"])
    return table


def scaling_rows(table):
    rows = []
    for mode, by_n in table.items():
        one = by_n.get(1)
        for n in sorted(by_n):
            eager = table.get("eager", {}).get(n)
            rows.append({"mode": mode, "gpus": n, "throughput": by_n[n],
                         "speedup_vs_eager": by_n[n] / eager if eager else None,
                         "efficiency": by_n[n] / (n * one) if one else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--output", type=Path, default=Path("scaling.png"))
    args = parser.parse_args()
    rows = scaling_rows(load(args.dirs))
    fmt = lambda v: "—" if v is None else f"{v:,.2f}"  # noqa: E731
    print("| mode | GPUs | throughput/s | speedup vs eager | scaling efficiency |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['gpus']} | {r['throughput']:,.0f} | {fmt(r['speedup_vs_eager'])} | "
              f"{fmt(r['efficiency'])} |")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        left.plot([r["gpus"] for r in mine], [r["speedup_vs_eager"] or float("nan") for r in mine], "o-", label=mode)
        right.plot([r["gpus"] for r in mine], [r["efficiency"] or float("nan") for r in mine], "o-", label=mode)
    left.set(xlabel="GPUs", ylabel="speedup vs eager", title="speedup over eager")
    right.set(xlabel="GPUs", ylabel="throughput(N) / (N x throughput(1))", title="scaling efficiency", ylim=(0, 1.1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
