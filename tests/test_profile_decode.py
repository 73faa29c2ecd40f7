"""tools/profile_decode.py: the per-step kernel table read from trace events."""

from __future__ import annotations

import pytest
from tools_util import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("profile_decode")


def _ev(name, dur, thread="Stream #13(Kernel)", process="/device:GPU:0"):
    return {"name": name, "dur": dur, "thread": thread, "process": process}


def test_kernel_table_per_step(tool):
    events = [_ev("input_reduce_fusion.12", 10.0), _ev("input_reduce_fusion_3", 30.0),
              _ev("gemm_fusion_dot.7", 100.0), _ev("memcpy", 20.0),
              _ev("host op", 500.0, thread="python", process="/host:CPU"),
              _ev("summary", 999.0, thread="XLA Ops")]
    launches, device_ms, rows = tool.kernel_table(events, steps=2)
    assert launches == 2.0                       # 4 device-stream events over 2 steps
    assert device_ms == pytest.approx(0.08)      # 160 us / 2 steps
    assert rows[0] == ("gemm_fusion_dot", 0.5, pytest.approx(0.05))
    assert rows[1] == ("input_reduce_fusion", 1.0, pytest.approx(0.02))
    assert [r[0] for r in rows] == ["gemm_fusion_dot", "input_reduce_fusion", "memcpy"]


def test_bad_arguments_exit_2(tool):
    with pytest.raises(SystemExit) as e:
        tool.main(["--contexts", "0"])
    assert e.value.code == 2


def test_kernel_table_key_and_select(tool):
    events = [_ev("a.1", 10.0), _ev("b.2", 30.0), _ev("c.3", 5.0, thread="tf_XLAEigen/1",
                                                       process="/host:CPU")]
    launches, ms, rows = tool.kernel_table(events, 1, key=lambda e: e["name"][0].upper(),
                                           select=lambda e: True)
    assert launches == 3.0 and ms == pytest.approx(0.045)
    assert [r[0] for r in rows] == ["B", "A", "C"]
    with pytest.raises(ValueError, match="steps"):
        tool.kernel_table(events, 0)


def test_split_on_the_tiny_config(tool, tmp_path):
    """``--tiny --split`` end to end on the CPU: the step's time is split by op group (the CPU
    trace's host thunks stand in for device streams) and every group is named."""
    import json
    out = tmp_path / "split.json"
    assert tool.main(["--tiny", "--split", "--steps", "2", "--top", "5", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    groups = {g["group"]: g for g in row["groups"]}
    assert {"attention", "moe", "projections", "mhc", "unmatched"} <= set(groups)
    assert sum(g["share"] for g in row["groups"]) == pytest.approx(1.0)
    assert groups["attention"]["kernels"] > 0 and groups["moe"]["ms"] > 0
    assert 0 < len(row["instructions"]) <= 5
