"""Plot the kernel benchmark JSON (``dsv41-bench-kernels --out``) as a bar chart.

For every row: the XLA path, the GPU kernel with its default tuning and the best swept tuning,
in microseconds, with the ratio to XLA above the best bar. Several JSON files are drawn side by
side, one panel each. A file whose every timing has a device time is drawn with device times,
another with wall times; each panel's axis says which.

    python scripts/plot_benchmarks.py RESULTS.json --out docs/benchmarks.png

``--prefill`` adds a panel of CED vs exact prefill tokens/s from ``dsv41-bench-prefill`` JSON
files (one or both modes per file, any lengths). ``--topk`` adds a panel of the indexer's
top-k selection against the row length: device times of the XLA radix selection, the one-stage
kernel and the kernel with its default segments (``topk_triton.default_segment``), per batch,
from selection sweeps (JSON lists of ``{B, T, impl, device_us}``, e.g.
``docs/results/h200_topk_sweep_1.json``; later files win). ``--decode`` adds a panel of the
decode step's time per change against its floor (``docs/results/h200_decode_mid.json``).
``--grouped-matmul`` adds two panels from ``python -m benchmarks.grouped_matmul`` JSON files
(later files win per row): the kernel's TFLOP/s on the rows with at least 1K tokens, and the
expert weights it streams per second on the decode rows, each beside its target.
``--decode-ab`` adds a panel per run of ``tools/decode_ab.py`` (its ``--out`` JSON, or a file of
several under ``"runs"``, e.g. ``docs/results/h100_decode_ab_mid_switches.json``): each
variant's ms per step synced, queued and on the device, its kernel launches above.

Needs matplotlib (``pip install -e .[notebooks]``).
"""

from __future__ import annotations

import argparse
import json
import sys

from pallas_kernels.indexer.topk_triton import default_segment

# The label of the GPU kernel's default tuning in a results file ("triton" in files written
# before the kernel families were named by platform).
DEFAULT_LABELS = ("gpu", "triton")


def time_key(path: str) -> str:
    """``"device_us"`` if every timed entry of the file has a device time, else ``"us"``."""
    with open(path) as f:
        data = json.load(f)
    timed = [v for r in data.get("attention", []) for v in r["impls"].values() if "us" in v]
    return "device_us" if timed and all("device_us" in v for v in timed) else "us"


def rows_of(path: str, key: str = "us") -> list[dict]:
    """The attention rows of a benchmark JSON that have an XLA and a kernel timing (``key``:
    ``"us"``, the wall time, or ``"device_us"``): ``{name, xla, default, best, best_label}``
    (``default`` None where the file has no default-tuning entry)."""
    with open(path) as f:
        data = json.load(f)
    out = []
    for r in data.get("attention", []):
        ok = {k: v[key] for k, v in r["impls"].items() if key in v}
        kern = {k: t for k, t in ok.items() if k != "xla"}
        if "xla" in ok and kern:
            best = min(kern, key=kern.get)
            default = next((kern[k] for k in DEFAULT_LABELS if k in kern), None)
            out.append({"name": r["name"], "xla": ok["xla"], "default": default,
                        "best": kern[best], "best_label": best})
    return out


def prefill_runs(paths: list[str]) -> dict:
    """{(length, mode): tokens/s} from bench_prefill JSON files (later files win)."""
    out = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f).get("runs", []):
                if "tokens_per_s" in r:
                    out[(r["length"], r["mode"])] = r["tokens_per_s"]
    return out


def prefill_panel(ax, paths: list[str]) -> None:
    """Bars of CED and exact prefill tokens/s per length, the CED / exact ratio above."""
    runs = prefill_runs(paths)
    lengths = sorted({n for n, _ in runs})
    w = 0.38
    for k, mode in enumerate(("exact", "ced")):
        xs = [i + (k - 0.5) * w for i in range(len(lengths))]
        ys = [runs.get((n, mode), 0) for n in lengths]
        ax.bar(xs, ys, w, label=f"{mode} prefill")
    for i, n in enumerate(lengths):
        if (n, "ced") in runs and (n, "exact") in runs:
            ratio = runs[(n, "ced")] / runs[(n, "exact")]
            ax.annotate(f"{ratio:.2f}x", (i + 0.5 * w, runs[(n, "ced")]), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K tokens" for n in lengths])
    ax.set_ylabel("prompt tokens per second (H200)")
    ax.set_title("CED vs exact prefill, 40-layer bench config", fontsize=9)
    ax.legend(fontsize=8)


def topk_points(paths: list[str]) -> dict:
    """{(B, T, variant): device us} with variant ``"radix"``, ``"one stage"`` or ``"default"``
    (the sweep's entry for the segment ``default_segment(B, T)`` picks; the one-stage entry
    where it picks one stage)."""
    entries = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f):
                if r.get("device_us"):
                    entries[(r["B"], r["T"], r["impl"])] = r["device_us"]
    out = {}
    for (B, T, impl), us in entries.items():
        if impl == "radix":
            out[(B, T, "radix")] = us
        elif impl in ("one stage", "kernel one stage"):
            out[(B, T, "one stage")] = us
    for B, T in {(B, T) for B, T, _ in entries}:
        seg = default_segment(B, T)
        for impl in (f"kernel segment {seg}", f"segment {seg} warps None"):
            if (B, T, impl) in entries:
                out[(B, T, "default")] = entries[(B, T, impl)]
        if seg >= T and (B, T, "one stage") in out:
            out[(B, T, "default")] = out[(B, T, "one stage")]
    return out


def topk_panel(ax, paths: list[str]) -> None:
    """Lines of the selection's device time against the row length, per batch and variant."""
    pts = topk_points(paths)
    styles = {"radix": ("XLA radix", ":"), "one stage": ("kernel, one stage", "--"),
              "default": ("kernel, default segments", "-")}
    for i, B in enumerate(sorted({b for b, _, _ in pts})):
        for variant, (label, ls) in styles.items():
            line = sorted((T, us) for (b, T, v), us in pts.items() if b == B and v == variant)
            if len(line) > 1:
                ax.plot(*zip(*line), ls, marker="o", color=f"C{i}", label=f"B={B} {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("scores per row (T)")
    ax.set_ylabel("device microseconds per call (H200, log scale)")
    ax.set_title("indexer top-k 512: selection", fontsize=9)
    ax.legend(fontsize=6, ncol=2, loc="lower right")


def decode_steps(path: str) -> tuple[list[tuple[str, float]], float]:
    """``([(label, ms per step queued)], floor ms)`` of a decode profile file
    (``docs/results/h200_decode_mid.json``): the layer-by-layer model (``before``), then each
    recorded step; the floor is the current row's."""
    with open(path) as f:
        data = json.load(f)
    bars = []
    before = data.get("before", {}).get("decode_ms")
    if before:
        lo, _, hi = str(before).partition("-")
        bars.append(("layer by layer,\ndense experts", (float(lo) + float(hi or lo)) / 2))
    for step in data.get("steps", []):
        bars.append((step["change"], float(step["ms_queued"])))
    return bars, float(data["decode_4096"]["floor_ms"])


def decode_panel(ax, path: str) -> None:
    """Decode ms per step (queued) after each change, against the floor."""
    import textwrap
    bars, floor = decode_steps(path)
    x = range(len(bars))
    rects = ax.bar(list(x), [ms for _, ms in bars], 0.6, color="tab:blue")
    for b, (_, ms) in zip(rects, bars):
        ax.annotate(f"{ms:.1f} ms\n{ms / floor:.1f}x floor", (b.get_x() + b.get_width() / 2, ms),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(floor, color="k", ls="--", lw=1, label=f"floor {floor:.2f} ms (bytes / copy rate)")
    ax.set_xticks(list(x), [textwrap.fill(label, 22) for label, _ in bars], fontsize=7)
    ax.set_ylabel("ms per decode step (queued)")
    ax.set_title("decode step, mid config, batch 1, 4K context (H200)", fontsize=10)
    ax.legend(fontsize=8)


def decode_ab_runs(paths: list[str]) -> list[dict]:
    """The ``tools/decode_ab.py`` runs of the files, in order: a file is one run (its
    ``"variants"``) or several (``"runs"``). Variants that failed (``"error"``) are left out."""
    runs = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for run in data.get("runs", [data]):
            variants = [v for v in run["variants"] if "error" not in v]
            runs.append({**run, "variants": variants})
    return runs


def decode_ab_panel(ax, run: dict) -> None:
    """One decode A/B run: per variant, ms per step synced, queued and device (bars), the
    kernel launches per step above."""
    variants = run["variants"]
    x = list(range(len(variants)))
    w = 0.27
    series = (("ms_per_step", "synced"), ("ms_per_step_queued", "queued"),
              ("device_ms_per_step", "device"))
    for i, (key, label) in enumerate(series):
        bars = ax.bar([j + (i - 1) * w for j in x], [v.get(key) or 0 for v in variants], w,
                      label=label)
        if key == "device_ms_per_step":
            for b, v in zip(bars, variants):
                if v.get("launches_per_step"):
                    ax.annotate(f"{v['launches_per_step']:,.0f}\nlaunches",
                                (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [v["variant"] for v in variants], rotation=15, fontsize=8)
    ax.set_ylabel("ms per decode step")
    title = (f"{run.get('config', '')} decode, batch {run.get('batch')}, "
             f"{run.get('context')} context ({run.get('device', '')})")
    ax.set_title(title + (f"\n{run['call']}" if run.get("call") else ""), fontsize=9)
    ax.legend(fontsize=8)


def grouped_matmul_rows(paths: list[str]) -> dict[str, dict]:
    """``{row name: row}`` of grouped matmul benchmark files, later files winning; a row's
    kernel time is ``kernel_us`` (files of the first run keep it among ``kernel_top``)."""
    rows = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for r in data.get("rows", []):
            if "error" in r:
                continue
            r = dict(r)
            if "kernel_top" in r:      # the first run's format: the op's time in kernel_us
                r["kernel_us"] = next(k["us_per_op"] for k in r["kernel_top"]
                                      if "mosaic" in k["name"] or "grouped" in k["name"])
            E, N, K, hit = r.get("experts", r.get("E")), r["N"], r["K"], r["experts_hit"]
            r["tflops"] = 2.0 * r["pairs"] * N * K / r["kernel_us"] / 1e6
            r["tbps"] = (hit * N * K // 2 + hit * N * (K // 32) * 2) / r["kernel_us"] / 1e6
            r["experts"] = E
            rows[r["name"]] = r
    return rows


def grouped_matmul_panels(ax_flops, ax_bytes, paths: list[str]) -> None:
    """The grouped matmul kernel: TFLOP/s of the prefill-sized rows, TB/s of the decode rows."""
    rows = grouped_matmul_rows(paths)
    big = sorted((r for r in rows.values() if r["tokens"] >= 1024),
                 key=lambda r: (r["experts"], r["tokens"], r["name"]))
    small = sorted((r for r in rows.values() if r["tokens"] < 1024),
                   key=lambda r: (r["experts"], r["tokens"]))
    for ax, sel, key, target, unit in ((ax_flops, big, "tflops", 300.0, "TFLOP/s"),
                                       (ax_bytes, small, "tbps", 3.0, "TB/s")):
        bars = ax.bar(range(len(sel)), [r[key] for r in sel], 0.6, color="tab:green")
        for b, r in zip(bars, sel):
            ax.annotate(f"{r[key]:.0f}" if key == "tflops" else f"{r[key]:.2f}",
                        (b.get_x() + b.get_width() / 2, r[key]), ha="center", va="bottom",
                        fontsize=8)
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:g} {unit}")
        ax.set_xticks(range(len(sel)), [r["name"] for r in sel], rotation=15, fontsize=8)
        ax.set_ylabel(f"kernel {unit} (H200, device time)")
        ax.legend(fontsize=8)
    ax_flops.set_title("FP4 grouped matmul, prefill-sized calls", fontsize=10)
    ax_bytes.set_title("FP4 grouped matmul, decode: expert weights streamed", fontsize=10)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="plot_benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="*", help="dsv41-bench-kernels JSON files (attention panels)")
    ap.add_argument("--out", default="benchmarks.png", help="PNG to write (default "
                                                             "benchmarks.png)")
    ap.add_argument("--prefill", nargs="*", default=[], help="dsv41-bench-prefill JSON files")
    ap.add_argument("--titles", default=None, help="';'-separated panel titles of the JSON files")
    ap.add_argument("--topk", nargs="*", default=[], help="top-k selection sweep JSON files")
    ap.add_argument("--decode", default=None, help="decode profile JSON "
                                                   "(docs/results/h200_decode_mid.json)")
    ap.add_argument("--grouped-matmul", nargs="*", default=[],
                    help="grouped matmul benchmark JSON files (python -m "
                         "benchmarks.grouped_matmul --out)")
    ap.add_argument("--decode-ab", nargs="*", default=[],
                    help="tools/decode_ab.py JSON files (a panel per run)")
    return ap


def main(argv=None) -> int:
    """Draw the panels of the given result files into ``--out``."""
    ap = build_parser()
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gm = 2 * bool(args.grouped_matmul)
    ab = decode_ab_runs(args.decode_ab)
    panels = (len(args.json) + bool(args.prefill) + bool(args.topk) + bool(args.decode) + gm
              + len(ab))
    if not panels:
        ap.error("nothing to plot: give bench_kernels JSON files, --prefill, --topk, --decode, "
                 "--grouped-matmul or --decode-ab")
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    if ab:
        first = len(args.json) + bool(args.prefill) + bool(args.decode) + gm
        for ax, run in zip(axes[0][first:], ab):
            decode_ab_panel(ax, run)
    if gm:
        first = len(args.json) + bool(args.prefill) + bool(args.decode)
        grouped_matmul_panels(axes[0][first], axes[0][first + 1], args.grouped_matmul)
    if args.decode:
        decode_panel(axes[0][len(args.json) + bool(args.prefill)], args.decode)
    if args.prefill:
        prefill_panel(axes[0][len(args.json)], args.prefill)
    if args.topk:
        topk_panel(axes[0][-1], args.topk)
    titles = args.titles.split(";") if args.titles else [p.rsplit("/", 1)[-1] for p in args.json]
    for ax, path, title in zip(axes[0], args.json, titles):
        key = time_key(path)
        rows = rows_of(path, key)
        x = range(len(rows))
        w = 0.27
        ax.bar([i - w for i in x], [r["xla"] for r in rows], w, label="XLA")
        ax.bar(list(x), [r["default"] or 0 for r in rows], w, label="GPU kernel, default tuning")
        bars = ax.bar([i + w for i in x], [r["best"] for r in rows], w,
                      label="GPU kernel, best tuning")
        for b, r in zip(bars, rows):
            ax.annotate(f"{r['xla'] / r['best']:.2f}x", (b.get_x() + b.get_width() / 2,
                                                        b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), [r["name"] for r in rows], rotation=15, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(("device" if key == "device_us" else "wall") +
                      " microseconds per call (H200, log scale)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    if args.json:
        fig.suptitle("CSA2 sparse attention: 64 heads x 512, window 128, top-k 512")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
