"""The end-to-end benchmark (:mod:`benchmarks.e2e`): its byte and FLOP counts against hand
counts on the tiny config, its configs, the peer's plumbing (a stand-in script), its refusals
of bad options, and a CPU smoke run of the whole command."""

from __future__ import annotations

import argparse
import json
import math
import textwrap

import jax
import numpy as np
import pytest

from benchmarks import config as bench_config
from benchmarks import e2e
from dsv41_jax import random_weights
from dsv41_jax.config import LayerPlan


@pytest.fixture(scope="module")
def tiny():
    return bench_config.e2e_config("tiny")[0]


def test_loaded_bytes_match_the_params(tiny):
    """The loader's bytes (load-time conversions included) are those of the real pytree."""
    shapes = jax.eval_shape(lambda: random_weights.random_params_device(tiny, 0))
    real = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    assert sum(bench_config.loaded_tensor_bytes(tiny).values()) == real
    g = bench_config.param_bytes_by_group(tiny)
    assert g["head"] == 512 * 64 * 4                        # fp32 head
    assert g["embed"] == 512 * 64 * 2
    # 6 layers x 4 experts x (w1, w3: [64, 32] codes + [64, 2] scales; w2: [64, 32] + [64, 2])
    assert g["experts"] == 6 * 4 * 3 * (64 * 32 + 64 * 2)
    assert g["engram_tables"] == 0


def test_decode_bytes_hand_count(tiny):
    """Tiny: 6 layers, ratios [0, 2, 2, 1, 1, 1], index sources 1, 3, 5 (5 inside the
    candidate pool of 4 blocks x 4), window 16, top-k 8, head dim 64, indexer dim 64."""
    parts = e2e.decode_bytes_parts(tiny, 2, 20)
    win = 15 * (64 + 2) * 6              # ring entries (new token computed) x FP8 row x layers
    topk = 8 * (32 + 4) * 5              # 5 sparse layers: min(8, visible) FP4 main KV rows
    index = (21 // 2 + 21 + 16) * (32 + 2)   # layer 1: 10 visible, layer 3: 21, layer 5: pool
    assert parts["kv"] == 2 * (win + topk + index)
    assert parts["experts"] == 6 * 4 * 3 * 2176             # 2 rows x 2 experts: all 4 read
    assert e2e.decode_bytes_parts(tiny, 1, 20)["experts"] == 6 * 2 * 3 * 2176
    assert parts["head"] == 512 * 64 * 4 and parts["embed_rows"] == 2 * 64 * 2
    g = bench_config.param_bytes_by_group(tiny)
    wo_a = 6 * (128 * 128 * 2 - (128 * 128 + 4 * 4))   # [2 x 64, 4 x 64 / 2]: bf16 -> FP8
    assert parts["dense"] == g["dense"] - wo_a and parts["engram_rows"] == 0
    assert e2e.decode_bytes(tiny, 2, 20) == sum(v for k, v in parts.items() if k != "total")
    # early context: fewer entries than the window and the top-k
    early = e2e.decode_bytes_parts(tiny, 1, 3)["kv"]
    assert early == 3 * 66 * 6 + (2 * 2 + 3 * 4) * 36 + (2 + 4 + 4) * 34


def test_prefill_flops_hand_count(tiny):
    """Hand counts on the tiny config (dim 64, q_lora 64, 4 heads x 64, 2 groups x 64, 4
    experts of 64 with 2 active + 1 shared, 4 streams, indexer 4 x 64, vocabulary 512)."""
    per_pos = 2 * ((4096 + 16384 + 4096 + 16384 + 8192)     # wq_a, wq_b, wkv, wo_a, wo_b
                   + 2 * 24 * 256                           # two mHC heads
                   + 256 + 3 * 4096 * 3)                    # router, 2 routed + 1 shared
    idx_pos = 2 * (16384 + 256)                             # indexer wq_b, weights_proj
    exact8 = e2e.prefill_flops_parts(tiny, 8, "exact")
    assert exact8["linear"] + exact8["mhc"] + exact8["moe"] == per_pos * 8 * 6
    # window lists 36 per layer; top-k lists 16 (ratio 2) and 36 (ratio 1); 1024 per entry
    assert exact8["attention"] == 1024 * (36 * 6 + 16 * 2 + 36 * 3)
    assert exact8["indexer"] == idx_pos * 8 * 3 + 2 * 256 * (16 + 36 + 36)
    assert exact8["compressor"] == (2 * 8 * 4096 * 2 + 2 * 4 * 4096) + (2 * 8 * 4096 * 2)
    assert exact8["head"] == 2 * 512 * 64
    assert exact8["total"] == 11_030_528
    # up to the window, CED replays every position: the same work
    assert e2e.prefill_flops(tiny, 8, "ced") == exact8["total"]
    # 32 tokens: the decoder (layers 3-5) runs over positions 16..31 only, its KV source
    # (layer 3) still compresses all 32
    ced = e2e.prefill_flops_parts(tiny, 32, "ced")
    assert ced["linear"] + ced["mhc"] + ced["moe"] == per_pos * (3 * 32 + 3 * 16)
    assert ced["attention"] == 1024 * (392 * 3 + 256 * 3 + 192 * 2 + 128 * 3)
    assert ced["indexer"] == idx_pos * (32 + 16 + 16) + 2 * 256 * (256 + 392 + 256)
    assert ced["compressor"] == 524_288 + 131_072 + 262_144 + 262_144
    assert ced["total"] == 35_000_320
    assert e2e.prefill_flops(tiny, 32, "exact") > ced["total"]
    # chunks of 16: the decoder replays the last 16 positions of each chunk (all 32 here)
    assert e2e.prefill_flops(tiny, 32, "ced", chunk=16) == e2e.prefill_flops(tiny, 32, "exact")


def test_trace_copies_are_not_launches():
    """A GPU stream's name lists the kinds of work it ran: only the event's name decides."""
    from benchmarks.timing import _is_copy
    assert _is_copy({"name": "MemcpyH2D", "thread": "Stream #13(MemcpyH2D)"})
    assert _is_copy({"name": "Memset (Device)", "thread": "Stream #7"})
    assert not _is_copy({"name": "loop_multiply_fusion_5",
                         "thread": "Stream #14(Kernel,Memset,MemcpyD2D)"})


def test_e2e_configs():
    mid, rel = bench_config.e2e_config("mid")
    assert (mid.dim, mid.n_routed_experts, mid.n_activated_experts, mid.moe_inter_dim) == (
        2048, 16, 6, 512)
    assert (mid.n_layers, mid.vocab_size, mid.n_heads, mid.head_dim) == (40, 129280, 64, 512)
    assert mid.engram_layer_ids == () and mid.n_mtp_layers == 0 and mid.vision_n_layers == 0
    assert mid.compress_ratios == tuple(rel["compress_ratios"])
    fit, _ = bench_config.e2e_config("release-fit")
    assert (fit.dim, fit.moe_inter_dim, fit.n_layers, fit.vocab_size) == (5120, 2304, 40, 129280)
    e, info = bench_config.release_fit_experts()
    assert fit.n_routed_experts == e and e % 8 == 0 and fit.n_activated_experts == 6
    assert bench_config.fit_bytes(fit) + 16e9 <= 141e9 < (
        bench_config.fit_bytes(fit.replace(n_routed_experts=e + 8)) + 16e9)
    assert info["fit_bytes"] == bench_config.fit_bytes(fit)
    full, _ = bench_config.e2e_config("release-384")
    assert (full.dim, full.moe_inter_dim, full.n_routed_experts, full.n_layers) == (
        5120, 2304, 384, 6)
    plan = LayerPlan.from_config(full)
    assert {r.mode for r in plan.roles} == {"swa", "full", "reuse", "reindex"}
    assert {r.ratio for r in plan.roles} == {0, 1, 2} and any(r.is_decoder for r in plan.roles)
    # weights and the stacked copy prepare_params builds beside them fit one 141 GB GPU
    assert 2 * bench_config.fit_bytes(full) + 16e9 <= 141e9
    with pytest.raises(ValueError, match="unknown end-to-end config"):
        bench_config.e2e_config("huge")


def test_table_placeholder_and_rows():
    text = e2e.markdown_table()
    lines = text.splitlines()
    assert lines[0].startswith("| row | time | tokens/s |")
    assert len(lines) == 2 + 6 + 6 * 2          # 6 prefill rows, 6 decode rows + their loops
    assert "| prefill CED 4K | not yet measured |" in text
    assert "| decode B=64, 32K, on-device loop | not yet measured |" in text


def test_peer_plumbing(tmp_path):
    """A stand-in peer script: its arguments, the wheel folder and the merge into rows."""
    script = tmp_path / "peer_nemo.py"
    script.write_text(textwrap.dedent("""
        import argparse, json, sys
        ap = argparse.ArgumentParser()
        for a in ("--preset", "--prefill", "--eager-prefill", "--eager-decode",
                  "--decode-prefix", "--try-lengths", "--try-eager", "--budget-s", "--json"):
            ap.add_argument(a)
        a = ap.parse_args()
        res = {f"sparse/prefill_{n}": {"ms_median": 2000.0, "tokens_per_s": int(n) / 2.0}
               for n in a.prefill.split(",") if n}
        res[f"sparse/decode1_after_{a.decode_prefix}_recompute"] = {"ms_median": 500.0}
        res["eager/prefill_4096"] = {"oom": "no"}
        json.dump({"preset": a.preset, "argv": sys.argv[1:], "results": res}, open(a.json, "w"))
    """))
    args = argparse.Namespace(config="mid", lengths=[4096, 65536], contexts=[4096, 32768],
                              rows=["prefill", "decode"], peer=str(script),
                              peer_python=e2e.sys.executable, peer_timeout=120)
    peer = e2e.run_peer(args)
    assert peer["rc"] == 0, peer
    assert peer["record"]["preset"] == "mid"
    argv = peer["record"]["argv"]
    assert argv[argv.index("--prefill") + 1] == "4096"      # 64K is past the peer's reach
    assert argv[argv.index("--decode-prefix") + 1] == "4096"
    assert peer["summary"] == {"prefill": {4096: {"seconds": 2.0, "tokens_per_s": 2048.0}},
                               "next_token": {4096: {"ms": 500.0}}}
    pre = {"kind": "prefill", "length": 4096, "seconds": 0.5}
    e2e.add_peer(pre, peer)
    assert pre["x_peer"] == 0.25 and pre["peer_tokens_per_s"] == 2048.0
    dec = {"kind": "decode", "batch": 1, "context": 4096, "ms_per_step": 50.0,
           "loop": {"ms_per_step": 25.0}}
    e2e.add_peer(dec, peer)
    assert dec["x_peer"] == 0.1 and dec["loop"]["x_peer"] == 0.05
    other = {"kind": "decode", "batch": 8, "context": 4096, "ms_per_step": 50.0}
    e2e.add_peer(other, peer)
    assert "x_peer" not in other
    assert "skipped" in e2e.run_peer(argparse.Namespace(**dict(vars(args),
                                                               config="release-fit")))


@pytest.mark.parametrize("argv, match", [
    (["--rows", "prefill,bogus"], "argument --rows: 'bogus' is not one of prefill, decode, moe"),
    (["--rows", ","], "argument --rows: '' is not one of prefill, decode, moe"),
    (["--rows", "none,decode"], "argument --rows: 'none' is not one of prefill, decode, moe (or"),
    (["--rows", "moe", "--moe-rows", "rel w1 b64,rel w3 b8"],
     "argument --moe-rows: unknown row 'rel w3 b8': '<mid w1|"),
    (["--rows", "moe", "--moe-rows", "rel w1 3K"], "argument --moe-rows: unknown row 'rel w1 3K'"),
    (["--rows", "moe", "--moe-rows", " , "], "argument --moe-rows: no MoE row given"),
    (["--moe-dense-max-s", "-1"], "argument --moe-dense-max-s: must be >= 0, got -1.0"),
    (["--modes", "ced,fast"], "argument --modes: ['ced', 'fast'] is not a list of ced, exact"),
    (["--batches", "0"], "argument --batches: must be >= 1, got 0"),
    (["--config", "huge"], "argument --config: invalid choice: 'huge'"),
    (["--steps", "300"], "argument --headroom: 256 tokens cannot hold the 905 decode steps"),
    (["--budget-s", "-1"], "argument --budget-s: must be >= 0, got -1.0"),
    (["--attn-impl", "bogus"], "argument --attn-impl: attn_impl must be one of"),
    (["--out", "no/such/dir/x.json"], "argument --out: no such directory: no/such/dir"),
    (["--peer", "no/such/peer.py"], "argument --peer: no such file: no/such/peer.py"),
    (["--mesh", "tensor=2,pipe=2"], "argument --mesh: unknown mesh axis 'pipe'; the axes are"),
    (["--mesh", "expert=0"], "argument --mesh: the size of 'expert' must be an integer >= 1"),
    (["--mesh", "data=2"], "argument --mesh: data=2 splits rows of a batch, and the prefill"),
    (["--mesh", "data=2", "--rows", "decode", "--batches", "2,3"],
     "argument --mesh: decode batch 3 does not divide by data=2"),
    (["--mesh", "expert=3"], "argument --mesh: the config's 4 routed experts do not divide"),
    (["--engram", "host"], "argument --engram: host places the tables over a mesh; pass --mesh"),
    (["--engram", "sharded", "--mesh", "expert=1"],
     "argument --engram: the tiny config has no Engram tables"),
    (["--mesh", "expert=2"], "argument --mesh: mesh (data=1, tensor=1, expert=2) needs 2"),
    (["--engram", "attic"], "argument --engram: invalid choice: 'attic'"),
])
def test_bench_e2e_refuses(argv, match, capsys):
    """Bad options: exit status 2 and one line naming the option, before anything runs."""
    with pytest.raises(SystemExit) as e:
        e2e.main(["--tiny", *argv])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dsv41-bench-e2e: error: ") and match in last, last


def test_mesh_option():
    """``--mesh`` parses into the axis sizes of ``sharding.make_mesh`` (left out: 1; none: no
    mesh)."""
    args = e2e.parse_args(["--tiny", "--mesh", "tensor=2,expert=4"])
    assert args.mesh == {"data": 1, "tensor": 2, "expert": 4} and args.device_mesh is None
    assert e2e.parse_args(["--tiny"]).mesh is None
    args = e2e.parse_args(["--tiny", "--rows", "decode", "--batches", "4", "--mesh",
                           " data = 2 , expert=2"])
    assert args.mesh == {"data": 2, "tensor": 1, "expert": 2}


def test_release_config():
    """``--config release``: configs/flash.json with Engram and the DSpark head, vision off;
    refused without a mesh (its weights exceed one GPU), its Engram tables placed as
    ``--engram`` says."""
    args = e2e.parse_args(["--config", "release", "--mesh", "expert=8", "--engram", "host",
                           "--no-peer"])
    cfg = args.cfg
    assert (cfg.dim, cfg.n_layers, cfg.n_routed_experts) == (5120, 40, 384)
    assert cfg.engram_layer_ids and cfg.dspark_on and cfg.vision_n_layers == 0
    assert args.engram == "host" and args.mesh == {"data": 1, "tensor": 1, "expert": 8}
    with pytest.raises(SystemExit) as e:
        e2e.parse_args(["--config", "release", "--no-peer"])
    assert e.value.code == 2


def test_rows_none_and_order():
    """``--rows none`` plans no row; otherwise per length its prefill rows, then its decode
    rows, shorter lengths first."""
    assert e2e.planned_rows(e2e.parse_args(["--tiny", "--rows", "none"])) == []
    args = e2e.parse_args(["--tiny", "--lengths", "128,64", "--contexts", "64",
                           "--batches", "8,1", "--modes", "exact"])
    assert [(r["kind"], r.get("length", r.get("context")), r.get("batch"))
            for r in e2e.planned_rows(args)] == [
        ("prefill", 64, None), ("decode", 64, 1), ("decode", 64, 8), ("prefill", 128, None)]


def _finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_e2e_tiny(tmp_path, capsys):
    """The whole command on the tiny config on CPU: one exact prefill row of 64 tokens and one
    decode row (batch 1, 3 steps) whose fill reuses that prefill's compiled program; no peer,
    no compile check. JSON, table and figure."""
    out = tmp_path / "e2e.json"
    assert e2e.main(["--tiny", "--modes", "exact", "--profile-steps", "1", "--no-peer",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| prefill exact 64 |" in text and "| decode B=1, 64 |" in text
    res = json.loads(out.read_text())
    for key in ("config", "device", "jax_version", "roofline", "params_bytes", "rows", "peer",
                "compile_check", "param_groups", "total_s"):
        assert key in res, key
    assert res["config_name"] == "tiny" and res["compile_check"] is None
    assert _finite_positive(res["roofline"]["copy_GBps"])
    assert _finite_positive(res["roofline"]["bf16_matmul_TFLOPs"])
    pre, dec = res["rows"]
    assert (pre["kind"], pre["mode"], pre["length"]) == ("prefill", "exact", 64)
    for k in ("seconds", "tokens_per_s", "first_call_s", "flops", "floor_s", "x_floor"):
        assert _finite_positive(pre[k]), (k, pre[k])
    assert pre["compile_s"] >= 0 and pre["xla_compiles_timed"] == 0
    assert pre["state_pos_after"] == 64 and pre["logits_finite"]
    assert "device_s" in pre and "launches" in pre          # None on CPU
    assert (dec["kind"], dec["batch"], dec["context"], dec["steps"]) == ("decode", 1, 64, 3)
    for k in ("ms_per_step", "ms_per_step_queued", "tokens_per_s", "first_step_s", "bytes",
              "floor_ms", "x_floor"):
        assert _finite_positive(dec[k]), (k, dec[k])
    assert dec["compile_s"] >= 0 and dec["xla_compiles_timed"] == 0
    assert dec["fill_mode"] == "exact" and dec["logits_finite"]
    assert dec["state_pos_after"] == 64 + 2 + 3 + 3 + 1      # warm-up, synced, queued, traced
    assert "device_ms_per_step" in dec and "launches_per_step" in dec
    assert dec["loop"]["ms_per_step"] is None or _finite_positive(dec["loop"]["ms_per_step"])
    assert dec["bytes"] == e2e.decode_bytes(e2e.bench_config.e2e_config("tiny")[0], 1, 64)
    if res.get("figure"):
        assert (tmp_path / "e2e.png").stat().st_size > 0


def test_synthetic_state(tiny):
    """The synthetic fill: every array of an empty state's shape and dtype, the position set,
    finite values in the float arrays, scales in their normal range; a decode step on it
    gives finite logits; a context outside the capacity is refused."""
    import numpy as np

    from dsv41_jax import model, state as st

    empty = st.init_state(tiny, 2, 80)
    s = e2e.synthetic_state(tiny, 2, 80, 64, seed=1)
    assert jax.tree.structure(s) == jax.tree.structure(empty)
    for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(empty)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert np.asarray(s.pos).tolist() == [64, 64]
    for x in jax.tree.leaves(s):
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            assert np.isfinite(np.asarray(x, np.float32)).all()
    for src in s.sources.values():
        assert np.asarray(src.main).std() > 50                 # random code bytes
        assert 120 <= np.asarray(src.index_scale).min() <= np.asarray(src.index_scale).max() <= 130
        assert (np.asarray(src.main_scale, np.float32) >= 0).all()
    params = model.prepare_params(random_weights.random_params_device(tiny, 0), tiny)
    logits, after = model.decode_step(params, tiny, s, np.array([1, 2], np.int32))
    assert np.isfinite(np.asarray(logits)).all() and np.asarray(after.pos).tolist() == [65, 65]
    with pytest.raises(ValueError, match="context must be in"):
        e2e.synthetic_state(tiny, 1, 64, 64)


def test_moe_rows_plan_and_budget(tmp_path, capsys):
    """``--rows moe`` plans the ``--moe-rows`` rows after the others (defaults: the issue's
    release rows, the tiny ones with ``--tiny``); the kernel runs on a GPU, in interpret mode
    elsewhere for the tiny shapes only; the inputs' pairs are sorted by expert; a budget spent
    by the roofline skips every MoE row."""
    from benchmarks import grouped_matmul as gmb
    from benchmarks import moe_rows

    args = e2e.parse_args(["--tiny", "--rows", "decode,moe", "--contexts", "64"])
    assert [(r["kind"], r.get("name")) for r in e2e.planned_rows(args)] == [
        ("decode", None)] + [("moe", n) for n in moe_rows.TINY_ROWS]
    args = e2e.parse_args(["--rows", "moe", "--no-peer"])
    assert args.moe_rows == list(moe_rows.DEFAULT_ROWS) and len(args.moe_rows) == 16
    assert {"rel w1 b1", "rel w1 b256", "rel w1 64K", "rel w2 1K"} <= set(args.moe_rows)
    assert gmb.parse_row("rel w2 64K") == (384, 5120, 2304, 65536)
    assert moe_rows.kernel_impl("rel w1 b64", "gpu") == "gpu"
    assert moe_rows.kernel_impl("tiny w1 b8", "cpu") == "gpu_interpret"
    assert moe_rows.kernel_impl("rel w1 b64", "cpu") is None
    # the guard at an H200's rates: batch 1 reads every expert (2.55 GB at 4.2 TB/s), 256
    # tokens compute 2.3 TFLOP (3.3 ms), 64K tokens 0.85 s: all under the default 1 s, and
    # 64K tokens' working set (fp32 sums of 5120 outputs: 2.7 GB) under DENSE_MAX_BYTES
    h200 = {"bf16_matmul_TFLOPs": 700.0, "copy_GBps": 4200.0}
    assert moe_rows.dense_estimate_s(384, 2304, 5120, 1, h200) == pytest.approx(
        384 * 2304 * (2560 + 160 * 2) / 4200e9)
    assert moe_rows.dense_estimate_s(384, 2304, 5120, 256, h200) == pytest.approx(
        2 * 384 * 256 * 2304 * 5120 / 700e12)
    assert moe_rows.dense_estimate_s(384, 5120, 2304, 65536, h200) == pytest.approx(0.8479,
                                                                                  rel=1e-3)
    assert moe_rows.dense_estimate_s(384, 5120, 2304, 65536, h200) < moe_rows.DENSE_MAX_S
    assert moe_rows.dense_bytes(384, 5120, 2304, 65536) < moe_rows.DENSE_MAX_BYTES < (
        moe_rows.dense_bytes(384, 5120, 2304, 8 * 65536))
    inp = gmb.make_inputs(8, 128, 256, 5, seed=3)
    ids = inp["idx"].ravel()[inp["order"]]
    assert (np.diff(ids) >= 0).all() and int(inp["group_sizes"].sum()) == 30
    assert np.asarray(inp["group_sizes"]).tolist() == np.bincount(ids, minlength=8).tolist()
    assert np.allclose(inp["weights"].sum(1), 1.0) and inp["hit"] == len(set(ids.tolist()))
    assert (np.asarray(inp["x"]) == np.asarray(inp["x_tok"])[inp["pair_token"]]).all()
    out = tmp_path / "moe.json"
    assert e2e.main(["--tiny", "--rows", "moe", "--budget-s", "0.001", "--no-peer",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rows"] == [] and [r["name"] for r in res["skipped"]] == list(moe_rows.TINY_ROWS)
    assert all(r["skipped"].startswith("time budget") for r in res["skipped"])
    assert "moe tiny w1 b1: time budget" in capsys.readouterr().out


def test_moe_row_guards():
    """A row whose XLA path and dense scan the guards skip: null times, the reasons, no
    ratios; the kernel still measured."""
    from benchmarks import moe_rows

    roof = {"bf16_matmul_TFLOPs": 1.0, "copy_GBps": 10.0}
    rec = moe_rows.moe_row("tiny w1 b1", roof, dense_max_s=0.0, xla_max_bytes=0, calls=1)
    assert rec["xla_us"] is None and rec["x_xla"] is None and "passes 0 GB" in rec["xla_none"]
    assert rec["dense_us"] is None and rec["x_dense"] is None
    assert "passes --moe-dense-max-s 0" in rec["dense_none"]
    assert _finite_positive(rec["op_us"]) and "max_err" not in rec
    # flops 2 x 6 pairs x 128 x 256 at 1 TFLOP/s: 0.393 us; 6 experts' 110,592 bytes at 10 GB/s
    assert rec["floor_us"] == pytest.approx(11.0592)
    assert rec["x_floor"] == rec["op_us"] / rec["floor_us"]
    assert "| moe tiny w1 b1 | 6 (6) |" in e2e.moe_table([rec], roof)
    assert "skipped (memory)" in e2e.moe_table([rec]) and "skipped (time)" in e2e.moe_table([rec])


def test_bench_e2e_moe_tiny(tmp_path, capsys):
    """``--tiny --rows moe`` end to end on CPU: the tiny MoE rows with the interpret-mode kernel,
    XLA and the dense scan all measured (wall times), no model weights; every ratio is the
    stored times' ratio, the floor the roofline's; the kernel agrees with XLA and its weighted
    pair sums with the dense scan; the table, printed and rendered from the JSON."""
    from benchmarks import grouped_matmul as gmb
    from benchmarks import moe_rows

    out = tmp_path / "moe.json"
    assert e2e.main(["--tiny", "--rows", "moe", "--no-peer", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert "params_bytes" not in res and res["skipped"] == []
    assert [r["name"] for r in res["rows"]] == list(moe_rows.TINY_ROWS)
    roof = res["roofline"]
    cpu = jax.default_backend() == "cpu"
    for r in res["rows"]:
        E, N, K, T = gmb.parse_row(r["name"])
        assert (r["kind"], r["experts"], r["N"], r["K"], r["tokens"]) == ("moe", E, N, K, T)
        assert r["pairs"] == 6 * T and 1 <= r["experts_hit"] <= min(E, 6 * T)
        assert r["flops"] == 2 * r["pairs"] * N * K
        assert r["weight_bytes"] == r["experts_hit"] * (N * K // 2 + N * K // 32 * 2)
        for k in ("op_us", "xla_us", "dense_us", "floor_us", "tflops", "weights_TBps",
                  "x_xla", "x_dense", "x_floor", "flops_frac", "bw_frac", "first_call_s"):
            assert _finite_positive(r[k]), (r["name"], k, r[k])
        assert r["kernel_impl"] == ("gpu_interpret" if cpu else "gpu")
        if cpu:
            assert r["time_basis"] == "wall" and r["kernel_us"] is None
        assert r["x_xla"] == pytest.approx(r["xla_us"] / r["op_us"], rel=1e-12)
        assert r["x_dense"] == pytest.approx(r["dense_us"] / r["op_us"], rel=1e-12)
        floor = 1e6 * max(r["flops"] / (roof["bf16_matmul_TFLOPs"] * 1e12),
                          r["weight_bytes"] / (roof["copy_GBps"] * 1e9))
        assert r["floor_us"] == pytest.approx(floor, rel=1e-12)
        assert r["x_floor"] == pytest.approx(r["op_us"] / floor, rel=1e-12)
        assert r["tflops"] == pytest.approx(r["flops"] / r["op_us"] / 1e6, rel=1e-12)
        assert r["weights_TBps"] == pytest.approx(r["weight_bytes"] / r["op_us"] / 1e6,
                                                  rel=1e-12)
        assert r["flops_frac"] == pytest.approx(r["tflops"] / roof["bf16_matmul_TFLOPs"])
        assert r["bw_frac"] == pytest.approx(r["weights_TBps"] * 1e3 / roof["copy_GBps"])
        assert 0 <= r["max_err"] <= 2 ** -7 and 0 < r["dense_max_err"] <= 2 ** -7
    assert "| moe tiny w1 b8 | 48 (8) |" in text and "MoE rows: wall times" in text
    assert "| row | time | tokens/s |" not in text      # no prefill or decode table
    assert e2e.main(["--render", str(out)]) == 0
    rendered = capsys.readouterr().out
    assert rendered.strip() == text[text.index("| MoE row"):text.index("\ntotal")].strip()
