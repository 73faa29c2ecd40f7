"""Plot the kernel benchmark JSON (``scripts/bench_kernels.py --out``) as a bar chart.

For every row: the XLA path, the Triton kernel with its default tuning and the best swept
tuning, in microseconds, with the ratio to XLA above the best bar. Several JSON
files (e.g. two kernel versions) are drawn side by side, one panel each.

    python scripts/plot_benchmarks.py docs/results/h200_sweep_kernel_v2.json --out docs/benchmarks.png

Needs matplotlib (``pip install -e .[notebooks]``).
"""

from __future__ import annotations

import argparse
import json
import sys


def rows_of(path: str) -> list[dict]:
    """The attention rows of a benchmark JSON that have an XLA and a kernel timing."""
    with open(path) as f:
        data = json.load(f)
    out = []
    for r in data.get("attention", []):
        ok = {k: v["us"] for k, v in r["impls"].items() if "us" in v}
        kern = {k: t for k, t in ok.items() if k != "xla"}
        if "xla" in ok and kern:
            best = min(kern, key=kern.get)
            out.append({"name": r["name"], "xla": ok["xla"], "default": kern.get("triton"),
                        "best": kern[best], "best_label": best})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", default="benchmarks.png")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.json), figsize=(6 * len(args.json), 4.5), squeeze=False)
    for ax, path in zip(axes[0], args.json):
        rows = rows_of(path)
        x = range(len(rows))
        w = 0.27
        ax.bar([i - w for i in x], [r["xla"] for r in rows], w, label="XLA")
        ax.bar(list(x), [r["default"] or 0 for r in rows], w, label="Triton, default tuning")
        bars = ax.bar([i + w for i in x], [r["best"] for r in rows], w, label="Triton, best tuning")
        for b, r in zip(bars, rows):
            ax.annotate(f"{r['xla'] / r['best']:.2f}x", (b.get_x() + b.get_width() / 2,
                                                        b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), [r["name"] for r in rows], rotation=15, fontsize=8)
        ax.set_ylim(0, max(max(r["xla"], r["default"] or 0, r["best"]) for r in rows) * 1.15)
        ax.set_ylabel("microseconds per call (H200)")
        ax.set_title(path.rsplit("/", 1)[-1], fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("CSA2 sparse attention: 64 heads x 512, window 128, top-k 512")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
