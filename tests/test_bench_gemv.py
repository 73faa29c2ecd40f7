"""The GEMV tuning sweep (:mod:`benchmarks.gemv`) as a CPU smoke test: the shapes of a decode
step and their calls per step, the rows it writes, and its summary arithmetic."""

from __future__ import annotations

import json
import math

import jax
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from benchmarks import gemv as bench
from benchmarks.config import e2e_config
from dsv41_jax import model
from dsv41_jax.random_weights import random_params_device


def test_decode_calls_count_every_fp8_linear_of_a_step():
    """On a GPU every stored FP8 linear of a decode step is one GEMV: the recorded calls per
    step add up to the FP8 linears of all layers (a scanned group's stack counted per layer)."""
    cfg, _ = e2e_config("tiny")
    p = model.prepare_params(random_params_device(cfg, 0), cfg, linears="stored")
    entries = bench.decode_calls(cfg, p, 1, gpu=True)
    want = sum(math.prod(leaf.shape[:-2]) for path, leaf in jax.tree_util.tree_leaves_with_path(p)
               if jax.tree_util.keystr(path).endswith("['fp8']"))
    # a pair (wq_a and wkv, a shared expert's w1 and w3) is one launch of two linears
    assert want > 0 and sum(e["calls"] * (2 if e["pair"] else 1) for e in entries) == want
    assert any(e["pair"] for e in entries)
    assert len({(e["x"], e["w"][1:], e["act_quant"], e["pair"]) for e in entries}) == \
        len(entries)
    assert any(e["act_quant"] for e in entries) and any(not e["act_quant"] for e in entries)


def test_tiny_sweep_writes_rows(tmp_path):
    out = tmp_path / "gemv.json"
    assert bench.main(["--tiny", "--shapes", "0,2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"] == "tiny" and len(res["rows"]) == 2
    for row in res["rows"]:
        ran = [t for t in row["tunings"] if "us" in t]
        assert ran and ran[0]["us"] == row["default_us"]
        assert row["best_us"] == min(t["us"] for t in ran) <= row["default_us"]
        assert row["step_saving_us"] == pytest.approx(
            (row["default_us"] - row["best_us"]) * row["calls_per_step"])
        assert all(t["max_rel_err"] < 1e-5 for t in ran)
        assert row["default_TBps"] == pytest.approx(
            row["weight_bytes"] / row["default_us"] / 1e6)


def test_mosaic_sweep_writes_rows(tmp_path):
    """``--kernel mosaic``: its ``k_splits`` timed (interpret mode) on the shapes it takes, a
    row with an error on those it does not (the tiny config's grouped ``wo_a``: 64 rows a
    group)."""
    out = tmp_path / "gemv.json"
    assert bench.main(["--tiny", "--kernel", "mosaic", "--shapes", "0,2", "--out",
                       str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kernel"] == "mosaic"
    took, refused = res["rows"]
    assert [set(t) >= {"k_splits", "us"} for t in took["tunings"]] == [True]
    assert took["tunings"][0]["max_rel_err"] == 0 and took["best"] == {"k_splits": 1}
    assert "does not take" in refused["error"] and refused["tunings"] == []


def test_tunings_skip_what_the_kernel_refuses():
    args = bench.build_parser().parse_args(["--block-k", "32,64,512", "--k-splits", "1,3"])
    tunings = bench._tunings(64, 128, args)
    assert tunings[0] == {"block_k": 128, "k_splits": 1, "block_n": 32, "num_warps": 4,
                          "num_stages": 3}
    assert {t["block_n"] for t in tunings} == {32, 64}          # 128 > N = 64
    assert {t["block_k"] for t in tunings} == {64, 128}          # 32 < 64, 512 > K
    assert {t["k_splits"] for t in tunings} == {1}               # 3 divides no K / block_k
