"""tools/gpu_launches.py: the static kernel count of a compiled GPU program's text (the
deviceless compile itself needs the CUDA PJRT plugin, which CI does not install)."""

from __future__ import annotations

import pytest
from tools_util import load_tool

HLO = """HloModule jit_step, entry_computation_layout={(f32[4]{0}, s32[])->f32[4]{0}}

%fused_neg (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%fused_inc (q: s32[]) -> s32[] {
  %q = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %a = s32[] add(%q, %one)
}

%fused_lt (q: s32[]) -> pred[] {
  %q = s32[] parameter(0)
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%q, %three), direction=LT
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_neg, metadata={op_name="jit(step)/while/body/neg" source_file="/repo/pallas_kernels/mhc/reference.py" source_line=84}
  %f2 = f32[4]{0} fusion(%f1), kind=kLoop, calls=%fused_neg
  %inc = s32[] fusion(%i), kind=kLoop, calls=%fused_inc
  ROOT %r = (s32[], f32[4]{0}) tuple(%inc, %f2)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %c = pred[] fusion(%i), kind=kLoop, calls=%fused_lt
}

%br0 (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  ROOT %g = f32[4]{0} fusion(%b), kind=kLoop, calls=%fused_neg
}

%br1 (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  %g1 = f32[4]{0} fusion(%b), kind=kLoop, calls=%fused_neg
  ROOT %g2 = f32[4]{0} fusion(%g1), kind=kLoop, calls=%fused_neg
}

ENTRY %main (x: f32[4], k: s32[]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %k = s32[] parameter(1)
  %e = f32[4]{0} fusion(%x), kind=kInput, calls=%fused_neg, metadata={op_name="jit(step)/neg" source_file="/repo/pallas_kernels/mhc/reference.py" source_line=84}
  %cc = f32[4]{0} custom-call(%e), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/pallas_call" source_file="/repo/pallas_kernels/gemv/triton.py" source_line=259}
  %init = (s32[], f32[4]{0}) tuple(%k, %cc)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[4]{0} get-tuple-element(%w), index=1
  %s = f32[4]{0} fusion-start(%y), kind=kLoop, calls=%fused_neg
  %sd = f32[4]{0} fusion-done(%s)
  %z = f32[4]{0} bitcast(%sd)
  %cnd = f32[4]{0} conditional(%k, %z, %z), branch_computations={%br0, %br1}
  ROOT %out = f32[4]{0} copy(%cnd)
}
"""


def test_static_launches_counts_loops_branches_and_async_pairs():
    """One launch per fusion, custom call and copy; a loop's body and condition times its
    known trip count; a conditional by its largest branch; an async fusion once (start, not
    done); nothing for parameters, tuples, bitcasts. Kinds and groups from the text and the
    instructions' source files."""
    gl = load_tool("gpu_launches")
    r = gl.static_launches(HLO)
    # e, cc, 3 x (condition + f1, f2, inc), fusion-start, the larger branch (2), copy
    assert r["launches"] == 1 + 1 + 3 * 4 + 1 + 2 + 1
    assert r["by_kind"] == {"fusion:kLoop": 12 + 1 + 2, "fusion:kInput": 1,
                            "cc:__gpu$xla.gpu.triton": 1, "copy": 1}
    # an instruction without a source takes its operand's (profile_prefill.parse_hlo): f2
    # takes f1's (e, 3 x f1, 3 x f2), the async fusion and the copy trace back to the GEMV
    assert r["by_group"]["mhc"] == 1 + 3 + 3 and r["by_group"]["projections"] >= 1
    assert sum(r["by_group"].values()) == sum(r["by_source"].values()) == r["launches"]
    assert r["by_instruction"]["f1"] == 3 and r["by_instruction"]["g2"] == 1
    assert "g" not in r["by_instruction"] and "sd" not in r["by_instruction"]
    assert r["unknown_trip_counts"] == 0
    unknown = gl.static_launches(HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}',
                                             ""))
    assert unknown["launches"] == r["launches"] - 2 * 4 and unknown["unknown_trip_counts"] == 1
    with pytest.raises(ValueError, match="no ENTRY computation"):
        gl.static_launches(HLO.replace("ENTRY ", ""))
