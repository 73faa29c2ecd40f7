"""tools/profile_prefill.py: the op-group classifier, the HLO metadata parser (on hand-written
text and on a real compiled tiny prefill), the mapping of trace events to instructions and
groups, and a CPU run of the command."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
from tools_util import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("profile_prefill")


# ----------------------------------------------------------------------------- classify

@pytest.mark.parametrize("path, function, group", [
    ("/a/dsv41_jax/layers/attention.py", "attention", "attention"),
    ("/a/dsv41_jax/layers/attention.py", "kv_source_update", "attention"),
    ("/a/dsv41_jax/layers/attention.py", "_index", "indexer"),
    ("/a/dsv41_jax/layers/attention.py", "_index.<locals>.f", "indexer"),
    ("/a/dsv41_jax/layers/attention.py", None, "attention"),       # function unknown
    ("/a/pallas_kernels/sparse_attention/gpu.py", "rows", "attention"),
    ("/a/dsv41_jax/layers/indexer.py", "candidate_pool", "indexer"),
    ("/a/pallas_kernels/indexer/reference.py", "index_scores", "indexer"),
    ("/a/dsv41_jax/layers/moe.py", "_grouped_linear", "moe"),
    ("/a/pallas_kernels/grouped_matmul/reference.py", "ref", "moe"),
    ("/a/dsv41_jax/layers/linear.py", "linear", "projections"),
    ("/a/pallas_kernels/mhc/reference.py", "rms_norm", "rest"),   # its caller decides
    ("/a/pallas_kernels/gemv/triton.py", "fp8_gemv", "projections"),
    ("/a/dsv41_jax/quant.py", "fp8_quantize", "quantisation"),
    ("/a/pallas_kernels/fp4/reference.py", "pack_nibbles", "quantisation"),
    ("/a/dsv41_jax/layers/compressor.py", "compress", "compressor"),
    ("/a/dsv41_jax/layers/mhc.py", "block_wiring", "mhc"),
    ("/a/pallas_kernels/mhc/reference.py", "sinkhorn_split", "mhc"),
    ("/a/pallas_kernels/mhc/triton.py", "sublayer_glue", "mhc"),
    ("/a/dsv41_jax/model.py", "block", "rest"),
    ("/a/dsv41_jax/layers/rope.py", "apply_rope", "rest"),
    ("C:\\a\\dsv41_jax\\layers\\moe.py", "gate", "moe"),
    ("", None, "rest"),
])
def test_classify_table(tool, path, function, group):
    assert tool.classify(path, "jit(f)/add", function) == group
    assert group in tool.GROUPS


def test_classify_op_name_only_where_no_file_matches(tool):
    assert tool.classify("", "jit(f)/ragged_dot_general") == "moe"
    assert tool.classify("/a/dsv41_jax/layers/attention.py", "jit(f)/ragged_dot") == "attention"


def test_group_is_the_innermost_classified_frame(tool):
    F, I = tool.Frame, tool.Instruction
    rope = F("/r/dsv41_jax/layers/rope.py", "apply_rope", 5)
    attn = F("/r/dsv41_jax/layers/attention.py", "attention", 50)
    quant = F("/r/dsv41_jax/quant.py", "fp8_quantize", 40)
    norm = F("/r/pallas_kernels/mhc/reference.py", "rms_norm", 60)
    block = F("/r/dsv41_jax/model.py", "block", 200)
    assert I("a", "fusion", "", (rope, attn, block)).group == "attention"
    assert I("b", "fusion", "", (quant, attn, block)).group == "quantisation"
    assert I("c", "fusion", "", (norm, block)).group == "rest"
    assert I("d", "fusion", "", (norm, attn, block)).group == "attention"
    assert I("e", "copy").group == "rest"
    # the experts' linears are the MoE's; their quantisers stay quantisation
    lin = F("/r/dsv41_jax/layers/linear.py", "linear", 137)
    expert = F("/r/dsv41_jax/layers/moe.py", "expert", 61)
    assert I("f", "dot", "", (lin, attn, block)).group == "projections"
    assert I("g", "dot", "", (lin, expert, block)).group == "moe"
    assert I("g", "dot", "", (lin, expert, block)).source == "dsv41_jax/layers/moe.py:61 expert"
    assert I("h", "fusion", "", (quant, lin, expert, block)).group == "quantisation"
    assert tool.group_of_frames([], "jit(f)/ragged_dot") == "moe"
    assert I("a", "fusion", "", (rope, attn, block)).source == \
        "dsv41_jax/layers/attention.py:50 attention"


# ----------------------------------------------------------------------------- parse_hlo

HLO = """HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

FileNames
1 "/x/run.py"
2 "/repo/dsv41_jax/model.py"
3 "/repo/dsv41_jax/layers/attention.py"
4 "/repo/dsv41_jax/layers/rope.py"
5 "/repo/dsv41_jax/layers/linear.py"

FunctionNames
1 "<module>"
2 "block"
3 "attention"
4 "apply_rope"
5 "rms_norm"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=20 end_line=20 column=1 end_column=9}
3 {file_name_id=3 function_name_id=3 line=30 end_line=30 column=1 end_column=9}
4 {file_name_id=4 function_name_id=4 line=40 end_line=40 column=1 end_column=9}
5 {file_name_id=5 function_name_id=5 line=50 end_line=50 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
4 {file_location_id=4 parent_frame_id=4}
5 {file_location_id=5 parent_frame_id=3}


%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%p, %p), metadata={op_name="jit(f)/mul" stack_frame_id=4}
}

ENTRY %main.1 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %fusion.1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(f)/mul" stack_frame_id=4}
  %fusion.2 = f32[4]{0} fusion(%fusion.1), kind=kLoop, calls=%fused_computation
  %norm.3 = f32[4]{0} add(%fusion.1, %x), metadata={op_name="jit(f)/add" stack_frame_id=5}
  %custom-call.4 = (f32[4]{0}, s8[64]{0}) custom-call(%norm.3), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/dot_general" source_file="/repo/dsv41_jax/layers/moe.py" source_line=99}
  %copy.5 = f32[4]{0} copy(%x)
  %call.6 = f32[4]{0} call(%x), to_apply=%fused_computation
  %gte.7 = f32[4]{0} get-tuple-element(%custom-call.4), index=0
  ROOT %add.8 = f32[4]{0} add(%gte.7, %call.6)
}
"""


def test_parse_hlo_stack_frames(tool):
    h = tool.parse_hlo(HLO)
    assert h.module == "jit_f"
    f1 = h.instructions["fusion.1"]
    assert f1.opcode == "fusion" and f1.op_name == "jit(f)/mul"
    # innermost first; a frame's printed parent is its parent's id + 1
    assert [(f.function, f.line) for f in f1.frames] == [
        ("apply_rope", 40), ("attention", 30), ("block", 20), ("<module>", 10)]
    assert f1.group == "attention" and f1.via == ""
    norm = h.instructions["norm.3"]
    assert [f.function for f in norm.frames] == ["rms_norm", "block", "<module>"]
    assert norm.group == "rest"


def test_parse_hlo_other_forms(tool):
    h = tool.parse_hlo(HLO)
    cc = h.instructions["custom-call.4"]               # tuple shape, source_file metadata
    assert cc.opcode == "custom-call" and cc.group == "moe"
    assert cc.source == "dsv41_jax/layers/moe.py:99"
    f2 = h.instructions["fusion.2"]                    # no metadata: its fused root's stack
    assert f2.via == "m" and f2.group == "attention"
    gte = h.instructions["gte.7"]                      # no metadata: its operand's
    assert gte.via == "custom-call.4" and gte.group == "moe"
    assert h.instructions["copy.5"].frames == () and h.instructions["copy.5"].group == "rest"
    assert h.instructions["p"].opcode == "parameter"


def test_parse_hlo_refuses_text_without_instructions(tool):
    with pytest.raises(ValueError, match="no HLO instructions"):
        tool.parse_hlo("HloModule empty\n")


# ----------------------------------------------------------------------------- trace events

def _ev(name, dur, args=None, thread="Stream #13(Kernel)", process="/device:GPU:0"):
    return {"name": name, "dur": dur, "thread": thread, "process": process, "args": args or {}}


def test_events_to_groups_device(tool):
    h = tool.parse_hlo(HLO)
    mod = {"hlo_module": "jit_f"}
    events = [
        _ev("fusion_1", 10.0, dict(mod, hlo_op="fusion.1")),          # by hlo_op
        _ev("fusion_2", 20.0),                                        # by name (. -> _)
        _ev("sm90_xmma_gemm_bf16", 30.0, dict(mod, hlo_op="custom-call.4")),
        _ev("norm_3", 4.0, dict(mod, hlo_op="call.6")),               # command buffer: name
        _ev("MemcpyDtoD", 6.0),                                       # unmatched
        _ev("fusion_1", 50.0, {"hlo_module": "jit_other", "hlo_op": "fusion.1"}),
        _ev("fusion.1", 999.0, thread="python", process="/host:CPU"),
    ]
    source, picked = tool.split_events(events, h)
    assert source == "device streams" and len(picked) == 6
    rows = {r["group"]: r for r in tool.group_table(picked, 2, h)}
    assert [r["group"] for r in tool.group_table(picked, 2, h)] == \
        list(tool.GROUPS) + [tool.UNMATCHED]
    assert rows["attention"]["kernels"] == 1.0 and rows["attention"]["ms"] == pytest.approx(0.015)
    assert rows["moe"]["ms"] == pytest.approx(0.015)
    assert rows["rest"]["ms"] == pytest.approx(0.002)
    assert rows["unmatched"]["kernels"] == 1.0 and rows["unmatched"]["ms"] == pytest.approx(0.028)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    assert rows["unmatched"]["share"] == pytest.approx(56 / 120)
    top = tool.instruction_table(picked, 2, h, 3)
    assert top[0]["name"] == "fusion_1" and top[0]["group"] == "unmatched"
    assert (top[1]["name"], top[1]["group"], top[1]["opcode"]) == \
        ("custom-call.4", "moe", "custom-call")


def test_unclaimed_kernels_grouped_by_name(tool):
    """Pallas kernels no instruction claims (their events name no custom call) go to their
    group by name; cuBLAS GEMMs and copies stay unmatched."""
    h = tool.parse_hlo(HLO)
    events = [_ev("csa2_sparse_attention_rows_mgpu_mosaic_gpu_kernel", 8.0),
              _ev("fp4_grouped_matmul_mosaic_gpu_kernel", 4.0),
              _ev("nvjet_sm90_tss_176x128", 2.0), _ev("MemcpyDtoD", 2.0)]
    rows = {r["group"]: r for r in tool.group_table(events, 1, h)}
    assert rows["attention"]["ms"] == pytest.approx(0.008)
    assert rows["moe"]["ms"] == pytest.approx(0.004)
    assert rows["unmatched"]["kernels"] == 2.0
    top = tool.instruction_table(events, 1, h, 4)
    assert [t["group"] for t in top] == ["attention", "moe", "unmatched", "unmatched"]


def test_events_to_groups_cpu(tool):
    """No device streams: the host events of the module's own non-loop instructions."""
    h = tool.parse_hlo(HLO)
    host = dict(thread="tf_XLAEigen/1", process="/host:CPU")
    mod = {"hlo_module": "jit_f"}
    events = [_ev("fusion.1", 10.0, dict(mod, hlo_op="fusion.1"), **host),
              _ev("end: fusion.1", 1.0, **host),
              _ev("call.6", 40.0, dict(mod, hlo_op="call.6"), **host),       # encloses others
              _ev("copy", 7.0, {"hlo_module": "jit_convert", "hlo_op": "copy"}, **host),
              _ev("$core.py trace", 30.0, thread="python", process="/host:CPU")]
    source, picked = tool.split_events(events, h)
    assert source == "host thunks" and [e["dur"] for e in picked] == [10.0]
    rows = {r["group"]: r for r in tool.group_table(picked, 1, h)}
    assert rows["attention"]["share"] == 1.0


def test_group_table_refuses_no_calls(tool):
    with pytest.raises(ValueError, match="steps must be >= 1"):
        tool.group_table([], 0, tool.parse_hlo(HLO))


# ----------------------------------------------------------------------------- the command

@pytest.fixture(scope="module")
def tiny_run(tool, tmp_path_factory):
    """One CPU run: the tiny config, 32 tokens, exact mode (it compiles fastest), routed
    experts, the HLO text dumped."""
    d = tmp_path_factory.mktemp("profile_prefill")
    out, dump = str(d / "split.json"), str(d / "dump")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert tool.main(["--tiny", "--lengths", "32", "--modes", "exact", "--moe-impl",
                          "routed", "--top", "5", "--out", out, "--dump", dump]) == 0
    with open(out) as f:
        res = json.load(f)
    with open(os.path.join(dump, "prefill_32_exact_routed.hlo.txt")) as f:
        hlo = f.read()
    return res, hlo, buf.getvalue()


def test_tiny_run_record(tool, tiny_run):
    res, _, printed = tiny_run
    assert res["config"] == "tiny" and res["moe_impl"] == "routed"
    (r,) = res["rows"]
    assert (r["length"], r["mode"], r["batch"], r["programs"]) == (32, "exact", 1, 1)
    assert r["hlo_module"] == "jit__chunk_rows"
    # the ahead-of-time compile is the one the call ran; nothing compiles after it
    assert r["program_compiles"] == 1 and r["xla_compiles_timed"] == 0
    assert r["tokens_per_s"] == pytest.approx(32 / (r["wall_ms"] / 1e3))
    # CPU: no device streams, the split from the CPU thunks' events
    assert r["device_ms"] is None and r["launches"] == 0
    assert r["split_source"] == "host thunks"
    groups = {g["group"]: g for g in r["groups"]}
    assert list(groups) == res["groups"] == list(tool.GROUPS) + [tool.UNMATCHED]
    for g in ("attention", "indexer", "moe", "projections", "quantisation", "mhc"):
        assert groups[g]["ms"] > 0 and groups[g]["kernels"] > 0, g
    assert sum(g["share"] for g in r["groups"]) == pytest.approx(1.0)
    assert r["matched_share"] == pytest.approx(1.0)
    assert len(r["instructions"]) == 5
    assert all(i["group"] in tool.GROUPS and i["source"] for i in r["instructions"])
    assert "prefill 32 tokens, exact, moe routed" in printed and "tokens/s" in printed
    assert "    attention " in printed and "host events" in printed


def test_real_hlo_classified(tool, tiny_run):
    """The compiled prefill's own HLO: instructions from attention.py, moe.py and linear.py
    are found, with their Python stacks, and land in their groups."""
    h = tool.parse_hlo(tiny_run[1])
    kernels = [i for i in h.instructions.values()
               if i.opcode in ("fusion", "dot", "custom-call", "copy", "sort")]
    assert all(i.group in tool.GROUPS for i in kernels)

    def first(path, function=None, caller=None):
        """An instruction with a stack of its own whose innermost frame is ``path``'s
        (``function``'s), called from ``caller`` (a file) where given."""
        for i in kernels:
            f = i.frames[0] if i.frames and not i.via else None
            if f is not None and f.file.endswith(path) and (
                    function is None or f.function == function) and (
                    caller is None or any(g.file.endswith(caller) for g in i.frames)):
                return i
        raise AssertionError(f"no instruction from {path} {function or ''}")

    assert first("dsv41_jax/layers/attention.py").group == "attention"
    assert first("dsv41_jax/layers/moe.py", "_grouped_linear").group == "moe"
    lin = first("dsv41_jax/layers/linear.py", "linear", "dsv41_jax/layers/attention.py")
    assert lin.group == "projections"
    assert first("dsv41_jax/layers/linear.py", "linear", "dsv41_jax/layers/moe.py").group == "moe"
    assert first("pallas_kernels/mhc/reference.py", "hc_mixes").group == "mhc"
    assert first("pallas_kernels/fp4/reference.py").group == "quantisation"
    # the whole stack, down to the model's block
    fns = [f.function for f in lin.frames]
    assert fns[0] == "linear" and fns.index("attention") < fns.index("block")
    assert any(f.file.endswith("dsv41_jax/model.py") and f.function == "block"
               for f in lin.frames)
    assert {"attention", "moe", "projections", "mhc", "quantisation", "indexer"} <= \
        {i.group for i in kernels}


def test_bad_arguments_exit_2(tool):
    for argv in (["--lengths", "0"], ["--modes", "ced,fast"], ["--moe-impl", "sparse"],
                 ["--attn-impl", "cuda"], ["--config", "huge"]):
        with pytest.raises(SystemExit) as e:
            tool.parse_args(argv)
        assert e.value.code == 2, argv


def test_profile_prefill_refuses_bad_arguments(tool):
    with pytest.raises(ValueError, match="mode"):
        tool.profile_prefill(None, None, 32, "fast")
    with pytest.raises(ValueError, match="moe_impl"):
        tool.profile_prefill(None, None, 32, "ced", moe_impl="sparse")
    with pytest.raises(ValueError, match=">= 1"):
        tool.profile_prefill(None, None, 32, "ced", calls=0)
