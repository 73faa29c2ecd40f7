"""``tools/time_sampling.py``: every case timed per batch, the settings recorded, the rows
sorted at once when asked (same tokens), bad arguments refused."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from tools_util import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("time_sampling")


def test_tiny_run_writes_every_case(tool, tmp_path):
    out = tmp_path / "s.json"
    assert tool.main(["--batches", "1,3", "--vocab", "512", "--iters", "2", "--out",
                      str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["vocab"] == 512 and res["top_p_candidate_rows"]["default"] == 1
    assert [(r["batch"], r["case"]) for r in res["rows"]] == [
        (b, c[0]) for b in (1, 3) for c in tool.CASES]
    assert all(r["synced_ms"] > 0 and r["queued_ms"] > 0 for r in res["rows"])
    assert tool.main(["--batches", "2", "--vocab", "64", "--iters", "1", "--cases",
                      "flat"]) == 0


def test_peaked_nucleus_lies_in_the_16_largest(tool):
    """The ``peaked`` rows put the nucleus of top-p 0.95 inside the GPU's 16 candidates."""
    x = np.asarray(tool.logits("peaked", 2, 129_280))
    p = np.asarray(jax.nn.softmax(x, axis=-1))
    assert (np.sort(p, axis=-1)[:, ::-1][:, :16].sum(-1) >= 0.95).all()
    flat = np.asarray(jax.nn.softmax(tool.logits("flat", 2, 129_280), axis=-1))
    assert (np.sort(flat, axis=-1)[:, ::-1][:, :16].sum(-1) < 0.95).all()


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--batches", "x"], ["--vocab", "8"],
                                  ["--iters", "0"]])
def test_bad_arguments_exit_2(tool, argv):
    with pytest.raises(SystemExit) as e:
        tool.main(argv)
    assert e.value.code == 2
