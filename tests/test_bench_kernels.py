"""The measuring pieces of the kernel benchmark (:mod:`benchmarks.timing`,
:mod:`benchmarks.kernels`) and of :mod:`benchmarks.plot`, on CPU: wall and device times from one
compiled jit, the rates and ratios built from them, the plot's choice of time, and the
benchmark's refusals of bad options. (The kernels themselves are timed on the GPU only.)"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import kernels as bk
from benchmarks import plot as pb
from benchmarks import timing


def test_measure_wall_and_trace_on_cpu():
    """On CPU the trace holds no device streams: a wall time, ``device_s`` None, and the host
    events as the kernel list."""
    m = timing.measure(lambda a: a * 2, [(jnp.ones((256,)),), (jnp.zeros((256,)),)], 2,
                   profile=True)
    assert m["wall_s"] > 0 and m["device_s"] is None
    assert m["kernels"] and all(k["us_per_op"] >= 0 for k in m["kernels"])
    m = timing.measure(lambda a: a + 1, [(jnp.ones((8,)),)], 3)
    assert set(m) == {"wall_s", "best_s"} and 0 < m["best_s"] <= m["wall_s"]


def test_roofline_smoke_on_cpu():
    """The roofline's rates on CPU with small sizes: positive, the copy rate the best method's."""
    roof = timing.roofline(1, copy_bytes=1 << 16, matmul_n=64)
    assert roof["copy_GBps"] == max(roof["copy_GBps_by_method"].values()) > 0
    assert roof["bf16_matmul_TFLOPs"] > 0


def test_rates_and_best_use_the_device_time():
    """Rates follow from the times; the best kernel and the device ratio use device times."""
    tmin = 1e-6
    xla = timing.rates({"wall_s": 40e-6, "device_s": 30e-6}, 2e9, 4e6, tmin)
    fast_wall = timing.rates({"wall_s": 20e-6, "device_s": 25e-6}, 2e9, 4e6, tmin)
    fast_dev = timing.rates({"wall_s": 30e-6, "device_s": 10e-6}, 2e9, 4e6, tmin)
    assert xla["us"] == pytest.approx(40.0) and xla["device_us"] == pytest.approx(30.0)
    assert xla["TFLOPs"] == pytest.approx(2e9 / 40e-6 / 1e12)
    assert xla["device_GBps"] == pytest.approx(4e6 / 30e-6 / 1e9)
    assert xla["device_roofline_frac"] == pytest.approx(tmin / 30e-6)
    res = {"impls": {"xla": xla, "gpu": fast_wall, "gpu n_splits=2": fast_dev}}
    timing.best(res)
    assert res["best"] == "gpu n_splits=2"
    assert res["device_speedup_vs_xla"] == pytest.approx(3.0)
    assert res["speedup_vs_xla"] == pytest.approx(40 / 30)
    # without device times (a CPU run): by wall time, no device ratio
    wall_only = {"impls": {k: {"us": v["us"]} for k, v in res["impls"].items()}}
    timing.best(wall_only)
    assert wall_only["best"] == "gpu" and "device_speedup_vs_xla" not in wall_only


def test_plot_reads_device_times_when_every_entry_has_them(tmp_path):
    row = {"name": "decode B=8", "impls": {"xla": {"us": 60.0, "device_us": 36.0},
                                           "gpu": {"us": 46.0, "device_us": 20.0}}}
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    new.write_text(json.dumps({"attention": [row]}))
    old.write_text(json.dumps({"attention": [{"name": "decode B=8", "impls": {
        "xla": {"us": 60.0}, "triton": {"us": 46.0, "device_us": 20.0}}}]}))
    assert pb.time_key(str(new)) == "device_us" and pb.time_key(str(old)) == "us"
    [r] = pb.rows_of(str(new), "device_us")
    assert (r["xla"], r["default"], r["best_label"]) == (36.0, 20.0, "gpu")
    # results labelled with the GPU kernel's earlier name "triton" plot the same
    [r] = pb.rows_of(str(old), "us")
    assert (r["xla"], r["default"], r["best_label"]) == (60.0, 46.0, "triton")


def test_plot_topk_points_follow_the_default_segment(tmp_path):
    """The selection panel's "default" line takes, per row, the sweep entry of the segment
    ``default_segment`` picks (the one-stage entry where it picks one stage)."""
    sweep = [{"B": 1, "T": 32768, "impl": "radix", "device_us": 51.0},
             {"B": 1, "T": 32768, "impl": "kernel one stage", "device_us": 26.0},
             {"B": 1, "T": 32768, "impl": "kernel segment 8192", "device_us": 14.0},
             {"B": 1, "T": 32768, "impl": "kernel segment 16384", "device_us": 21.0},
             {"B": 256, "T": 32768, "impl": "one stage", "device_us": 60.0},
             {"B": 256, "T": 32768, "impl": "segment 8192 warps None", "device_us": 78.0},
             {"B": 8, "T": 65536, "impl": "kernel segment 8192", "error": "x"}]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    pts = pb.topk_points([str(path)])
    assert pts == {(1, 32768, "radix"): 51.0, (1, 32768, "one stage"): 26.0,
                   (1, 32768, "default"): 14.0, (256, 32768, "one stage"): 60.0,
                   (256, 32768, "default"): 60.0}


def test_candidate_pool_row_on_cpu():
    """The candidate-pool row: the release pool (2048 blocks of 8) over 32K scores, timed with
    ``lax.top_k`` (the kernel's label only with ``gpu``), its pool checked against itself."""
    res = bk.candidate_pool_timings(["xla"], 1, 32768, jax.random.key(0), 2, 1)
    assert res["name"] == "candidate pool B=1 T=32768" and res["same_pool"] is True
    assert (res["blocks"], res["block"]) == (2048, 8)
    assert list(res["impls"]) == ["candidate pool, lax.top_k (xla)"]
    row = res["impls"]["candidate pool, lax.top_k (xla)"]
    assert row["us"] > 0 and row["device_us"] is None and len(row["kernels"]) <= 8


def test_summary_table_marks_missing_numbers():
    """A CPU run has no device times: the table shows "-" there, never "nan"."""
    rows = [{"name": "decode B=8 T=4096", "best": "gpu",
             "impls": {"gpu": {"us": 12.5}}, "speedup_vs_xla": 2.0}]
    [_, _, line] = bk.summary_table(rows)
    assert line == "| decode B=8 T=4096 | gpu | 12.5 | 2.00 | - | - | - | - | - |"


def test_platform_family():
    assert [bk.platform_family(b) for b in ("cuda", "gpu", "tpu", "cpu")] == \
        ["gpu", "gpu", "tpu", None]


@pytest.mark.parametrize("argv, match", [
    (["--inner", "0"], "argument --inner: must be >= 1, got 0"),
    (["--reps", "-1"], "argument --reps: must be >= 1, got -1"),
    (["--impls", "xla,triton"], "argument --impls: ['triton'] is not a list of xla, gpu, tpu"),
    (["--rows", "B=8 T=4096;B=7 T=1"], "argument --rows: unknown rows ['B=7 T=1']"),
    (["--tunings", "{bad"], "argument --tunings: not JSON"),
    (["--tunings", '{"kv": "packed"}'], "argument --tunings: must be a JSON list of objects"),
    (["--check", "--no-check"], "--check and --no-check exclude each other"),
    (["--attention-only", "--no-attention"], "exclude each other"),
])
def test_bench_kernels_refuses(argv, match, capsys):
    """Bad options: exit status 2 and one line naming the option, before anything runs."""
    with pytest.raises(SystemExit) as e:
        bk.parse_args(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dsv41-bench-kernels: error: ") and match in last


def test_profile_rows_build_on_cpu():
    """The profiling tools' rows: an op and its inputs, runnable with the XLA path."""
    fn, sets = bk.profile_row("decode B=1", "xla", {}, jax.random.key(0))
    assert len(sets) == 4 and fn(*sets[0]).shape == (1, 1, bk.H, bk.K)
    with pytest.raises(KeyError):
        bk.profile_row("decode B=7", "xla", {}, jax.random.key(0))


def test_every_option_of_the_commands_has_help():
    from benchmarks import ced_vs_exact, prefill
    from dsv41_jax.cli import generate
    for mod in (bk, prefill, pb, ced_vs_exact, generate):
        for action in mod.build_parser()._actions:
            assert action.help, (mod.__name__, action.option_strings)


def test_decode_panel_reads_the_steps_and_floor(tmp_path):
    """The decode figure's bars: the layer-by-layer range's midpoint, then each recorded step;
    its floor line is the current row's."""
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({
        "before": {"decode_ms": "32-36"},
        "steps": [{"change": "a", "ms_queued": 16.1}, {"change": "b", "ms_queued": 11.0}],
        "decode_4096": {"floor_ms": 2.07}}))
    bars, floor = pb.decode_steps(str(path))
    assert [ms for _, ms in bars] == [34.0, 16.1, 11.0] and floor == 2.07
    assert pb.main(["--decode", str(path), "--out", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").stat().st_size > 1000


def test_grouped_matmul_panels_read_both_formats(tmp_path):
    """The grouped matmul figure's rows: the first run's format (the kernel among
    ``kernel_top``) and the benchmark's (``kernel_us``), later files winning per row."""
    from benchmarks import plot
    first = {"rows": [{"name": "rel w1 b64", "E": 384, "N": 2304, "K": 5120, "tokens": 64,
                       "pairs": 384, "experts_hit": 240, "kernel_us": 2000.0,
                       "kernel_top": [{"name": "MemcpyD2D", "us_per_op": 9.0},
                                      {"name": "anonymous_mosaic_gpu_kernel", "us_per_op": 1000.0}]},
                      {"name": "rel w1 16K", "error": "out of memory"}]}
    later = {"rows": [{"name": "mid w1 4K", "experts": 16, "N": 512, "K": 2048, "tokens": 4096,
                       "pairs": 24576, "experts_hit": 16, "kernel_us": 150.0}]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(later))
    rows = plot.grouped_matmul_rows([str(a), str(b)])
    assert set(rows) == {"rel w1 b64", "mid w1 4K"}
    assert rows["rel w1 b64"]["kernel_us"] == 1000.0
    assert rows["rel w1 b64"]["tbps"] == pytest.approx(
        (240 * 2304 * 5120 // 2 + 240 * 2304 * 160 * 2) / 1000.0 / 1e6)
    assert rows["mid w1 4K"]["tflops"] == pytest.approx(2 * 24576 * 512 * 2048 / 150.0 / 1e6)
    out = tmp_path / "gm.png"
    assert plot.main(["--grouped-matmul", str(a), str(b), "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def test_plot_decode_ab_runs(tmp_path):
    """The decode A/B panel's runs: a decode_ab file is one run, a file with ``"runs"`` holds
    several; failed variants are left out; the figure is written."""
    ok = {"variant": "base", "ms_per_step": 8.0, "ms_per_step_queued": 6.5,
          "device_ms_per_step": 6.9, "launches_per_step": 1851.0}
    one = {"config": "mid", "batch": 1, "context": 4096, "device": "GPU",
           "variants": [ok, {"variant": "broken", "error": "ValueError: no"}]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(one))
    b.write_text(json.dumps({"runs": [one, {**one, "batch": 4}]}))
    runs = pb.decode_ab_runs([str(a), str(b)])
    assert [r["batch"] for r in runs] == [1, 1, 4]
    assert all([v["variant"] for v in r["variants"]] == ["base"] for r in runs)
    out = tmp_path / "ab.png"
    assert pb.main(["--decode-ab", str(a), "--out", str(out)]) == 0 and out.stat().st_size > 0
