"""tools/load_peak.py: the memory peak of preparing the parameters with and without
``donate``, each setting in a process of its own (a CPU smoke test on the tiny config)."""

from __future__ import annotations

import json

from tools_util import load_tool


def test_tiny_run_records_both_settings(tmp_path):
    """Both settings run in their own process and record the loaded tree's bytes (those the
    memory plan counts), the prepared tree's, the memory held and the plan's largest layer;
    a bad argument exits 2."""
    from dsv41_jax import memory_plan
    tool = load_tool("load_peak")
    out = tmp_path / "peak.json"
    assert tool.main(["--config", "tiny", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["donate"] for r in res["settings"]] == [False, True]
    cfg = tool._config("tiny", None, None)
    weights = memory_plan.weight_bytes(cfg)
    for r in res["settings"]:
        assert r["device"] and r["loaded_bytes"] == sum(weights.values()) - weights["vision"]
        assert r["prepared_bytes"] > 0 and r["peak_bytes"] >= r["held_after"] - 2 ** 20
        assert r["largest_layer_bytes"] == memory_plan.largest_layer_bytes(cfg) > 0
        assert r["over_after"] == r["peak_bytes"] - r["held_after"]
    assert res["settings"][0]["prepared_bytes"] == res["settings"][1]["prepared_bytes"]
    try:
        tool.main(["--experts", "0"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--experts 0 was accepted")
