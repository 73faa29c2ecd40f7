"""The prefill benchmark (:mod:`benchmarks.prefill`) and its pieces: the bench configs, random
weights built on the device (same pytree as the loader's), an in-process CPU smoke run of the
benchmark and its refusals of bad options."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import config as bench_config
from benchmarks import prefill as bp
from dsv41_jax import checkpoint, random_weights
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.linear import dequant_weight


def _leaves(tree):
    return [(jax.tree_util.keystr(p), x.shape, x.dtype)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def test_bench_config_keeps_attention_and_layout():
    cfg, release = bench_config.bench_config()
    ref = ModelConfig.from_dict(release)
    for k in bench_config.ATTENTION_LAYOUT_KEYS:
        assert getattr(cfg, k) == getattr(ref, k), k
    red = bench_config.reductions(cfg, release)
    assert red["n_routed_experts"] == {"release": 384, "bench": 8}
    assert red["vocab_size"] == {"release": 129280, "bench": 4096}
    assert cfg.n_activated_experts == 6 <= cfg.n_routed_experts
    assert cfg.engram_layer_ids == (1, 14) and max(cfg.engram_num_embeddings) < 500_000
    assert cfg.image_token_id < cfg.vocab_size
    # Engram tables consistent with the hash constants; dropping Engram works too
    from dsv41_jax.layers import engram
    engram.engram_constants(cfg, bench_config.identity_token_map(cfg.vocab_size))
    assert bench_config.bench_config(engram="drop")[0].engram_layer_ids == ()


@pytest.mark.parametrize("variant", ["tiny", "tiny-no-engram", "fp8-experts", "bf16"])
def test_random_params_device_matches_loader_tree(variant):
    """Same structure, shapes and dtypes as params_from_tensors(random_tensors(cfg))."""
    cfg, _ = bench_config.tiny_config("drop" if variant == "tiny-no-engram" else "shrink")
    if variant == "fp8-experts":
        cfg = cfg.replace(expert_dtype=None)
    elif variant == "bf16":
        cfg = cfg.replace(dtype="bf16", expert_dtype=None)
    tmap = bench_config.identity_token_map(cfg.vocab_size)
    ref = checkpoint.params_from_tensors(random_weights.random_tensors(cfg, 0), cfg, tmap)
    if variant == "tiny":
        got = random_weights.random_params_device(cfg, 0, tmap)
        for k, v in ref["engram_consts"].items():
            np.testing.assert_array_equal(np.asarray(got["engram_consts"][k]), np.asarray(v))
        np.testing.assert_array_equal(np.asarray(got["engram_token_map"]),
                                      np.asarray(ref["engram_token_map"]))
        # same magnitudes as the host recipe (dequantised std of a few weights)
        for path in [(0, "attn", "wq_a"), (1, "attn", "wo_a"), (1, "attn", "wo_b"),
                     (2, "ffn", "experts", "w1"), (2, "ffn", "experts", "w2"),
                     (3, "ffn", "shared_experts", "w2"), (1, "engram", "wkv")]:
            a, b = ref["layers"], got["layers"]
            for k in path:
                a, b = a[k], b[k]
            sa = float(jnp.std(dequant_weight(a, jnp.float32)))
            sb = float(jnp.std(dequant_weight(b, jnp.float32)))
            assert abs(sb / sa - 1) < 0.15, (path, sa, sb)
        assert bool(jnp.isfinite(got["head"]["weight"]).all())
    else:   # structure only (nothing compiled)
        got = jax.eval_shape(lambda: random_weights.random_params_device(cfg, 0, tmap))
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert _leaves(got) == _leaves(ref)


def test_bench_prefill_tiny(tmp_path, capsys):
    """CED and exact on the tiny config, two lengths of one capacity, chunked: the warm-up
    compiles (the first length of each mode), the timed runs never do."""
    out = tmp_path / "bench.json"
    assert bp.main(["--tiny", "--lengths", "64,128", "--capacity", "128", "--chunk", "64",
                    "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "CED/exact speedup" in text and "Engram: shrunk" in text
    rec = json.loads(out.read_text())
    assert rec["reductions"]["n_layers"] == {"release": 40, "bench": 6}
    assert rec["device"] and rec["jax_version"] == jax.__version__
    assert rec["kernel_impls"] and all(isinstance(i, str) for i in rec["kernel_impls"])
    runs = rec["runs"]
    assert [(r["length"], r["mode"]) for r in runs] == [(64, "ced"), (64, "exact"),
                                                        (128, "ced"), (128, "exact")]
    for r in runs:
        assert "error" not in r, r.get("error")
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0 and r["warmup_s"] > 0
        assert r["logits_finite"]
        assert r["state_pos_after"] == r["length"]
        assert r["chunks"] == r["length"] // 64
        assert r["xla_compiles_in_timed_run"] == 0
        # one capacity: the 128-token runs reuse what the 64-token runs compiled
        assert (r["xla_compiles_in_warmup"] == 0) == (r["length"] == 128), r
    sp = {s["length"]: s for s in rec["speedups"]}
    assert set(sp) == {64, 128}
    for s in sp.values():
        assert s["speedup"] > 0
        assert s["speedup"] == pytest.approx(s["ced_tokens_per_s"] / s["exact_tokens_per_s"])


def test_bench_prefill_max_chunks_projects(tmp_path, capsys):
    """--max-chunks times the first chunks only and projects the prompt's seconds from them
    (marked as projected)."""
    out = tmp_path / "mc.json"
    res = bp.benchmark(bp.parse_args(["--tiny", "--lengths", "128", "--capacity", "128",
                                      "--chunk", "64", "--modes", "exact", "--max-chunks", "1",
                                      "--no-progress", "--out", str(out)]))
    assert "* projected" in capsys.readouterr().out
    [r] = json.loads(out.read_text())["runs"]
    assert (r["chunks"], r["chunks_timed"], r["seconds_projected"]) == (2, 1, True)
    assert r["state_pos_after"] == 64 and r["xla_compiles_in_timed_run"] == 0
    assert r["seconds"] == pytest.approx(2 * r["ms_per_chunk"] / 1e3)
    assert r["tokens_per_s"] == pytest.approx(64 / r["timed_seconds"])
    assert res["runs"][0]["_logits"].shape == (1, 512)


def test_bench_prefill_mesh(tmp_path, capsys):
    """``--mesh`` over this process's devices (one in the usual test run: the one-device mesh
    ``tensor=1``): the parameters and each run's states are placed on the mesh before the
    timing (the timed run compiles nothing), the mesh is recorded, and the last logits equal
    the run without a mesh bit for bit (whose program test_bench_prefill_tiny compiled)."""
    n = jax.device_count()
    argv = ["--tiny", "--lengths", "64", "--capacity", "128", "--chunk", "64", "--modes", "ced",
            "--no-progress"]
    args = bp.parse_args(argv + ["--mesh", f"tensor={n}", "--out", str(tmp_path / "m.json")])
    assert args.mesh == {"data": 1, "tensor": n, "expert": 1} and args.device_mesh is None
    got = bp.benchmark(args)
    assert f"mesh: {{'data': 1, 'tensor': {n}, 'expert': 1}} over {n} device(s)" in (
        capsys.readouterr().out)
    rec = json.loads((tmp_path / "m.json").read_text())
    assert rec["mesh"] == {"data": 1, "tensor": n, "expert": 1}
    assert "device_mesh" not in rec["args"] and rec["args"]["mesh"] == rec["mesh"]
    [r] = rec["runs"]
    assert "error" not in r, r.get("error")
    assert r["state_pos_after"] == 64 and r["xla_compiles_in_timed_run"] == 0
    assert bp.parse_args(argv).mesh is None
    want = bp.benchmark(bp.parse_args(argv))
    assert want["mesh"] is None
    np.testing.assert_array_equal(got["runs"][0]["_logits"], want["runs"][0]["_logits"])


@pytest.mark.parametrize("argv, match", [
    (["--mesh", "tensor=2,pipe=2"], "argument --mesh: unknown mesh axis 'pipe'; the axes are"),
    (["--mesh", "expert=0"], "argument --mesh: the size of 'expert' must be an integer >= 1"),
    (["--mesh", "data=2"], "argument --mesh: data=2 splits rows of a batch, and the prompts "
                           "have batch 1 (use data=1)"),
    (["--mesh", "expert=3"], "argument --mesh: the config's 4 routed experts do not divide by "
                             "expert=3"),
    (["--chunk", "0"], "argument --chunk: must be >= 1, got 0"),
    (["--lengths", "64,-1"], "argument --lengths: must be >= 1, got -1"),
    (["--modes", "ced,fast"], "argument --modes: ['ced', 'fast'] is not a list of ced, exact"),
    (["--warmup-chunks", "0"], "argument --warmup-chunks: must be >= 1, got 0"),
    (["--max-chunks", "0"], "argument --max-chunks: must be >= 1, got 0"),
    (["--experts", "4", "--activated", "6"], "--activated 6 is more than --experts 4"),
    (["--lengths", "256", "--capacity", "128"], "--capacity 128 is below the longest length"),
    (["--out", "no/such/dir/x.json"], "argument --out: no such directory: no/such/dir"),
    (["--attn-impl", "bogus"], "bogus"),
])
def test_bench_prefill_refuses(argv, match, capsys):
    """Bad options: exit status 2 and one line naming the option, before anything is built."""
    with pytest.raises(SystemExit) as e:
        bp.parse_args(["--tiny", *argv])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dsv41-bench-prefill: error: ") and match in last
