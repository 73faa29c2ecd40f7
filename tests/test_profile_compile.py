"""tools/profile_compile.py: the phases of a first call's compile from trace events, the HLO
counts, the targets it takes, and a CPU smoke run."""

from __future__ import annotations

import json

import pytest
from tools_util import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("profile_compile")


def _ev(name, ts, dur, tid=1, process="/host:CPU", thread="python"):
    return {"name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "process": process,
            "thread": thread}


def test_exclusive_times_subtract_nested_phases(tool):
    events = [_ev("compile", 0, 100), _ev("fusion.1", 10, 30), _ev("fusion.22", 50, 20),
              _ev("ptxas", 55, 5), _ev("other thread", 0, 40, tid=2),
              _ev("kernel", 0, 999, process="/device:GPU:0", thread="Stream #1")]
    ex = tool.exclusive_times(events)
    assert ex["compile"] == [50.0, 100.0, 1, 100.0]          # 100 - 30 - 20
    assert ex["fusion.#"] == [45.0, 50.0, 2, 30.0]           # 30 + (20 - 5)
    assert ex["ptxas"] == [5.0, 5.0, 1, 5.0]
    assert ex["other thread"][0] == 40.0
    assert "kernel" not in ex                                # device streams are not phases


def test_hlo_stats_counts():
    text = """HloModule m

%fused_computation.1 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %a = f32[4]{0} add(%p, %p)
}

ENTRY %main.3 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation.1
  ROOT %c = f32[4]{0} custom-call(%f), custom_call_target="__gpu$xla.gpu.triton"
}
"""
    stats = load_tool("profile_compile").hlo_stats(text)
    assert stats["instructions"] == 5 and stats["computations"] == 2
    assert stats["fusions"] == 1 and stats["while_loops"] == 0
    assert stats["custom_calls"] == {"__gpu$xla.gpu.triton": 1}
    assert stats["largest"][0] == ("main.3", 3)


def test_targets(tool):
    assert tool.parse_target("decode") == ("decode",)
    assert tool.parse_target("prefill:ced:4096") == ("prefill", "ced", 4096)
    assert tool.parse_target("verify:5") == ("verify", 5)
    for bad in ("prefill:fast:12", "verify", "decode:1", "prefill:ced:x"):
        with pytest.raises(ValueError, match="target must be"):
            tool.parse_target(bad)
    with pytest.raises(SystemExit) as e:
        tool.main(["--tiny", "--targets", "warp"])
    assert e.value.code == 2


def test_tiny_run_on_cpu(tool, tmp_path):
    """Each target compiles one program of the model's; its first call covers lowering and
    compiling; the phases and the dumped HLO are written."""
    out = tmp_path / "c.json"
    assert tool.main(["--tiny", "--targets", "decode,verify:2", "--top", "5",
                      "--dump-hlo", str(tmp_path / "hlo"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["target"]: r for r in res["rows"]}
    assert set(rows) == {"decode", "verify:2"}
    for r in rows.values():
        assert r["programs"] == 1 and r["xla_compiles"] >= 1
        assert 0 < r["lower_s"] + r["compile_s"] <= r["first_call_s"]
        assert len(r["phases"]) == 5 and r["hlo"]["instructions"] > 1000
    assert (tmp_path / "hlo" / "decode" / "0.hlo.txt.gz").stat().st_size > 0
