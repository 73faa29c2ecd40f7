"""scripts/bench_prefill.py and its pieces: the bench configs, random weights built on the
device (same pytree as the loader's), and an in-process CPU smoke run of the benchmark."""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import bench_config, checkpoint, model, random_weights
from dsv41_jax.layers.linear import dequant_weight

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_prefill.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_prefill", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _leaves(tree):
    return [(jax.tree_util.keystr(p), x.shape, x.dtype)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def test_bench_config_keeps_attention_and_layout():
    cfg, release = bench_config.bench_config()
    ref = bench_config.ModelConfig.from_dict(release)
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


def test_predict_seconds():
    bp = _load_script()
    assert bp.predict_seconds([], 4096, "ced", 2, 2048) is None
    done = [{"length": 4096, "mode": "ced", "seconds": 1.0}]
    p = bp.predict_seconds(done, 16384, "ced", 2, 2048)
    assert 4.0 < p < 10.0                                   # >= linear, with the warm-up
    assert bp.predict_seconds(done, 4096, "exact", 2, 2048) > 2.0   # from CED, conservative
    done.append({"length": 16384, "mode": "ced", "seconds": 8.0})   # quadratic growth seen
    assert bp.predict_seconds(done, 65536, "ced", 2, 2048) >= 8.0 * 4 ** 1.5


def test_bench_prefill_tiny(tmp_path, capsys):
    """CED and exact on the tiny config, two lengths, chunked, compiled ahead in threads."""
    bp = _load_script()
    out = tmp_path / "bench.json"
    res = bp.main(["--tiny", "--lengths", "64,128", "--capacity", "128", "--chunk", "64",
                   "--compile-threads", "2", "--time-budget", "100000", "--no-progress",
                   "--out", str(out)])
    text = capsys.readouterr().out
    assert "CED/exact speedup" in text and "Engram: shrunk" in text
    assert hasattr(model._chunk_jit, "lower")     # the precompiler put the jitted function back
    rec = json.loads(out.read_text())
    assert rec["reductions"]["n_layers"] == {"release": 40, "bench": 6}
    assert rec["device"] and rec["jax_version"] == jax.__version__
    assert not rec["skipped"]
    runs = rec["runs"]
    assert {(r["length"], r["mode"]) for r in runs} == {(64, "ced"), (64, "exact"),
                                                       (128, "ced"), (128, "exact")}
    for r in runs:
        assert "error" not in r, r.get("error")
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
        assert r["logits_finite"]
        assert r["state_pos_after"] == r["length"]
        assert r["chunks"] == r["length"] // 64
        assert r["xla_compiles_in_timed_run"] == 0
        if rec["precompile_threads"]:
            assert r["precompiled"] and r["xla_compiles_in_warmup"] == 0
    sp = {s["length"]: s for s in rec["speedups"]}
    assert set(sp) == {64, 128}
    for s in sp.values():
        assert s["speedup"] > 0
        assert s["speedup"] == pytest.approx(s["ced_tokens_per_s"] / s["exact_tokens_per_s"])
    assert res["speedups"][0]["length"] == 64
    for r in runs:   # XLA's memory plan of each compiled chunk function is recorded
        if rec["precompile_threads"]:
            assert r["xla_memory"]["temp_size_in_bytes"] >= 0


def test_bench_prefill_dry_run(tmp_path, capsys):
    """--dry-run: abstract weights, lowered and compiled through the public prefill, no run
    (the shapes of the test above, so the compiles come from JAX's cache)."""
    # the compile-ahead hook of the benchmark: if the model drops it, update the script
    assert hasattr(getattr(model, "_chunk_jit", None), "lower")
    bp = _load_script()
    out = tmp_path / "dry.json"
    bp.main(["--tiny", "--lengths", "64,128", "--capacity", "128", "--chunk", "64",
             "--dry-run", "--out", str(out)])
    assert "dry run (nothing executed)" in capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["runs"] == []
    jobs = rec["precompile_jobs"]
    assert [(j["capacity"], j["mode"], j["state"]) for j in jobs] == [(128, "ced", "done"),
                                                                       (128, "exact", "done")]
    assert all(j["xla_memory"]["argument_size_in_bytes"] > 0 for j in jobs)
    assert hasattr(model._chunk_jit, "lower")


def test_bench_prefill_max_chunks_projects(tmp_path, capsys):
    """--max-chunks times the first chunks only and projects the prompt's seconds from them
    (marked as projected); --wait-file gates the timed runs (here: already there)."""
    bp = _load_script()
    out, gate = tmp_path / "mc.json", tmp_path / "go"
    gate.write_text("")
    bp.main(["--tiny", "--lengths", "128", "--capacity", "128", "--chunk", "64", "--modes",
             "exact", "--max-chunks", "1", "--compile-threads", "0", "--wait-file", str(gate),
             "--no-progress", "--out", str(out)])
    assert "* projected" in capsys.readouterr().out
    [r] = json.loads(out.read_text())["runs"]
    assert (r["chunks"], r["chunks_timed"], r["seconds_projected"]) == (2, 1, True)
    assert r["state_pos_after"] == 64 and r["xla_compiles_in_timed_run"] == 0
    assert r["seconds"] == pytest.approx(2 * r["ms_per_chunk"] / 1e3)
    assert r["tokens_per_s"] == pytest.approx(64 / r["timed_seconds"])
