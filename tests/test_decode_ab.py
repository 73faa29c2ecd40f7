"""tools/decode_ab.py: variants parsed and refused, switches set for a run and restored."""

from __future__ import annotations

import json

import pytest
from tools_util import load_tool

from dsv41_jax.layers import attention


@pytest.fixture(scope="module")
def tool():
    return load_tool("decode_ab")


def test_named_and_spelled_out_variants(tool):
    assert tool.parse_variant("base") == ("base", {})
    name, sw = tool.parse_variant("loop")
    assert name == "loop" and sw == {("dsv41_jax.model", "UNROLL_DECODE_RUNS"): "never"}
    name, sw = tool.parse_variant(
        "two=dsv41_jax.layers.attention.RING_IN_PLACE:False+pallas_kernels.gemv.AUTO_MAX_ROWS:32")
    assert name == "two"
    assert sw == {("dsv41_jax.layers.attention", "RING_IN_PLACE"): False,
                  ("pallas_kernels.gemv", "AUTO_MAX_ROWS"): 32}
    # every named variant points at switches that exist
    for v in tool.VARIANTS:
        for mod, attr in tool.VARIANTS[v]:
            tool.parse_variant(f"x={mod}.{attr}:0")


@pytest.mark.parametrize("text, match", [
    ("nope", "unknown variant 'nope'"),
    ("a=dsv41_jax.model.NOPE:1", "has no attribute 'NOPE'"),
    ("a=no_such_module.X:1", "no module 'no_such_module'"),
    ("a=dsv41_jax.model.UNROLL_DECODE_RUNS", "expected module.ATTR:VALUE"),
    ("a=dsv41_jax.model.UNROLL_DECODE_RUNS:never", "not a Python literal"),
])
def test_bad_variants_are_refused(tool, text, match):
    with pytest.raises(ValueError, match=match):
        tool.parse_variant(text)


def test_bad_variant_exits_2_with_one_line(tool, capsys):
    assert tool.main(["--tiny", "--variants", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown variant" in err[0]


def test_tiny_run_records_the_variant_and_restores_the_switch(tool, tmp_path):
    """A variant on the tiny config (CPU): its record with finite logits, the switch set
    during its run and back to its value afterwards (one variant: each compiles the step)."""
    seen = []
    real = tool.e2e.decode_row

    def spy(*a, **kw):
        seen.append(attention.RING_IN_PLACE)
        return real(*a, **kw)

    out = tmp_path / "ab.json"
    before = attention.RING_IN_PLACE
    tool.e2e.decode_row = spy
    try:
        rc = tool.main(["--tiny", "--variants", "copyring", "--context", "40",
                        "--steps", "2", "--out", str(out)])
    finally:
        tool.e2e.decode_row = real
    assert rc == 0
    assert before and seen == [False]
    assert attention.RING_IN_PLACE == before
    res = json.loads(out.read_text())
    assert (res["config"], res["batch"], res["context"], res["steps"]) == ("tiny", 1, 40, 2)
    assert [r["variant"] for r in res["variants"]] == ["copyring"]
    assert res["variants"][0]["switches"] == {
        "dsv41_jax.layers.attention.RING_IN_PLACE": "False"}
    for r in res["variants"]:
        assert r["logits_finite"] and r["ms_per_step"] > 0 and r["ms_per_step_queued"] > 0
        assert r["device_ms_per_step"] is None and "kernels" not in r   # no device on a CPU
