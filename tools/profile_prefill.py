"""Where a prefill chunk's device time goes, by op group: attention, indexer, MoE, projections,
quantisation, compressor, mHC and the rest.

Builds an end-to-end benchmark config (``benchmarks.config.e2e_config``: ``mid``, ``tiny``,
``release-fit``) with seeded random weights on the device, prepared once
(``model.prepare_params``), and times ``model.prefill`` of ``--lengths`` tokens at batch 1 into
a fresh state of capacity length + ``--headroom`` (as the prefill rows of ``dsv41-bench-e2e``),
one call per prompt, in each of ``--modes`` with the routed experts as ``--moe-impl``: a first
call that compiles, the median of ``--reps`` calls (wall time), then a ``jax.profiler`` trace
of ``--calls`` calls (device time and kernels per call).

The split: the first call's program is compiled ahead of time (``lower(...).compile()`` on the
very arguments ``model.prefill`` passes to its jitted chunk function, whose cache the call
then hits) and its optimized HLO text parsed: each instruction's name, opcode and metadata
(``op_name`` and the Python stack, from ``stack_frame_id`` and the module's ``StackFrames``
table, or ``source_file`` / ``source_line`` in older XLA). Each kernel of the trace is mapped
to the instruction that launched it (the event's ``hlo_op`` argument; else its name, which
for XLA's own kernels is the instruction's name with ``.`` written ``_``) and each
instruction to a group by its innermost stack frame that :data:`SOURCE_GROUPS` classifies
(:func:`classify`, :func:`group_of_frames`: a quantiser called by the attention counts as
quantisation, a linear called by the attention as projections, except that the linears of
the MoE's experts are the MoE's). Kernels that no instruction of the prefill's program
claims (memory copies, other programs, kernels inside a command buffer that the trace does
not attribute) are "unmatched". Table: per group the kernels and device ms per call and the
share.

    python tools/profile_prefill.py --config mid --lengths 4096 --modes ced --moe-impl routed \\
        --out prefill_split.json
    python tools/profile_prefill.py --tiny               # CPU smoke test (about 30 s)
    python tools/profile_prefill.py --dump DIR ...       # keep the HLO text and the trace

On CPU (``--tiny``) the trace has no device streams: device time and kernel launches are 0 and
the split comes from the host events of the XLA CPU runtime's thunks, which carry the same
``hlo_op`` argument: their durations summed over the runtime's threads (CPU time, not the
call's wall time), loops (``while``) counted through their bodies.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import types
from typing import NamedTuple

import dsv41_jax  # noqa: F401  (first: the XLA numerics flag)
import jax

from benchmarks.config import E2E_CONFIGS, e2e_config
from benchmarks.e2e import MODES, prefill_all, prompt_tokens
from benchmarks.timing import device_stream, kernel_table, trace_events, write_json, xla_compiles
from dsv41_jax import model, state as st
from dsv41_jax.cli.args import Parser, positive_int, positive_ints
from dsv41_jax.layers.moe import MOE_IMPLS
from dsv41_jax.random_weights import random_params_device
from pallas_kernels.impls import check_family


# ----------------------------------------------------------------------------- classifier

GROUPS = ("attention", "indexer", "moe", "projections", "quantisation", "compressor", "mhc",
          "rest")
UNMATCHED = "unmatched"

# (path fragment, function or None for any, group): for one stack frame, the first row whose
# fragment is in the frame's file (and whose function is the frame's, or encloses it) gives the
# group. "rest" rows pass the frame to its caller: an RMS norm belongs to whatever normalises.
SOURCE_GROUPS = (
    ("pallas_kernels/mhc/reference.py", "rms_norm", "rest"),
    ("dsv41_jax/layers/linear.py", "rms_norm", "rest"),     # where it lived before
    ("dsv41_jax/layers/attention.py", "_index", "indexer"),
    ("dsv41_jax/layers/attention.py", None, "attention"),
    ("pallas_kernels/sparse_attention/", None, "attention"),
    ("dsv41_jax/layers/indexer.py", None, "indexer"),
    ("pallas_kernels/indexer/", None, "indexer"),
    ("dsv41_jax/layers/moe.py", None, "moe"),
    ("pallas_kernels/grouped_matmul/", None, "moe"),
    ("dsv41_jax/layers/linear.py", None, "projections"),
    ("pallas_kernels/gemv/", None, "projections"),
    ("dsv41_jax/quant.py", None, "quantisation"),
    ("pallas_kernels/fp4/", None, "quantisation"),
    ("dsv41_jax/layers/compressor.py", None, "compressor"),
    ("dsv41_jax/layers/mhc.py", None, "mhc"),
    ("pallas_kernels/sinkhorn/", None, "mhc"),
    ("pallas_kernels/mhc/", None, "mhc"),
)
# (fragment of the op_name, group) where no row of SOURCE_GROUPS matches the file.
OP_NAME_GROUPS = (
    ("ragged_dot", "moe"),
)
# (fragment of a kernel's name, group) for a kernel that no instruction claims: the Pallas
# kernels carry their own names, and on a GPU their trace events may not name their custom call.
KERNEL_NAME_GROUPS = (
    ("csa2_sparse_attention", "attention"),
    ("csa2_merge_splits", "attention"),
    ("csa2_indexer", "indexer"),
    ("fp4_grouped_matmul", "moe"),
    ("fp8_stacked_gemv", "projections"),
    ("sinkhorn_pairs", "mhc"),
    ("mhc_glue", "mhc"),
)
# (inner, outer): an instruction whose innermost classified frame is of group ``inner`` takes
# group ``outer`` where a frame further out is of that group: the experts' matmuls (dense
# routed experts and the shared expert) go through layers.linear, but they are the MoE's.
ENCLOSING_GROUPS = (
    ("projections", "moe"),
)


def classify(source_file: str, op_name: str = "", function: str | None = None) -> str:
    """The op group (one of :data:`GROUPS`) of an HLO instruction from one frame of its Python
    stack: ``source_file`` (any prefix; ``\\`` or ``/``), its ``function`` (None: unknown, then
    only the rows for any function apply) and the instruction's ``op_name``, by
    :data:`SOURCE_GROUPS`, then :data:`OP_NAME_GROUPS`; ``"rest"`` where neither matches."""
    path = (source_file or "").replace("\\", "/")
    for frag, fn, group in SOURCE_GROUPS:
        if frag in path and (fn is None or function is not None and (
                function == fn or function.startswith(fn + "."))):
            return group
    for frag, group in OP_NAME_GROUPS:
        if frag in (op_name or ""):
            return group
    return "rest"


def group_of_frames(frames, op_name: str = "") -> str:
    """The group of an instruction from its Python stack (``frames``: ``(file, function,
    ...)`` tuples, innermost first): that of the innermost frame :func:`classify` does not call
    "rest", unless :data:`ENCLOSING_GROUPS` hands it to an outer frame's group; from the
    ``op_name`` alone where no frame is classified; else "rest"."""
    groups = [classify(f[0], op_name, f[1]) for f in frames]
    for k, g in enumerate(groups):
        if g != "rest":
            for inner, outer in ENCLOSING_GROUPS:
                if g == inner and outer in groups[k + 1:]:
                    return outer
            return g
    return classify("", op_name)


class Frame(NamedTuple):
    """One Python frame of an HLO instruction's stack."""
    file: str
    function: str
    line: int


class Instruction(NamedTuple):
    """An HLO instruction: its ``name``, ``opcode``, metadata ``op_name`` and Python stack
    (``frames``, innermost first; empty without source metadata); ``via``: the instruction
    whose stack it took where it has none of its own (:func:`parse_hlo`)."""
    name: str
    opcode: str
    op_name: str = ""
    frames: tuple = ()
    via: str = ""

    @property
    def group(self) -> str:
        """Its op group: :func:`group_of_frames` of its stack and ``op_name``."""
        return group_of_frames(self.frames, self.op_name)

    @property
    def source(self) -> str:
        """``file:line function`` of the innermost frame of the instruction's group (or the
        innermost frame), the path from its package folder on; "" without frames."""
        group = self.group
        pick = next((f for f in self.frames
                     if classify(f.file, self.op_name, f.function) == group),
                    self.frames[0] if self.frames else None)
        if pick is None:
            return ""
        path = pick.file.replace("\\", "/")
        for root in ("dsv41_jax/", "pallas_kernels/", "benchmarks/", "tools/"):
            if root in path:
                path = path[path.index(root):]
                break
        return f"{path}:{pick.line} {pick.function}".strip()


class HloIndex:
    """A parsed HLO module (:func:`parse_hlo`): its ``module`` name and ``instructions``
    (name -> :class:`Instruction`)."""

    def __init__(self, module: str, instructions: dict):
        self.module = module
        self.instructions = instructions
        self._by_kernel_name = None

    def lookup_kernel(self, name: str) -> Instruction | None:
        """The instruction a kernel ``name`` is named after: the name itself, or the name with
        every character other than a letter, digit or ``_`` written ``_`` (XLA's GPU kernel
        names: ``loop_add_fusion.12`` -> ``loop_add_fusion_12``)."""
        if name in self.instructions:
            return self.instructions[name]
        if self._by_kernel_name is None:
            self._by_kernel_name = {}
            for k, v in self.instructions.items():
                self._by_kernel_name.setdefault(_sanitize(k), v)
        return self._by_kernel_name.get(name)


def _sanitize(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", name)


# ----------------------------------------------------------------------------- HLO text

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=\s*(.*)$")
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_METADATA = re.compile(r"metadata=\{((?:[^{}\"]|" + _QUOTED + r")*)\}")
_KV = re.compile(r"(\w+)=(" + _QUOTED + r"|[^\s}]+)")
_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _unquote(v: str) -> str:
    if len(v) >= 2 and v[0] == v[-1] == '"':
        return re.sub(r"\\(.)", r"\1", v[1:-1])
    return v


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] == "(") - (text[i] == ")")
        if depth == 0:
            return i + 1
    return len(text)


def _opcode_operands(rest: str) -> tuple[str, list[str], str]:
    """``(opcode, operand names, attributes)`` of an instruction line's right-hand side: after
    the shape (a tuple shape's parentheses skipped whole), the word before ``(``, the ``%``
    names inside those parentheses and the text after them; ``("", [], "")`` if there is no
    opcode."""
    if rest.startswith("("):
        rest = rest[_balanced(rest, 0):]
    else:
        rest = rest.split(None, 1)[1] if " " in rest else ""
    m = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    if not m:
        return "", [], ""
    end = _balanced(rest, m.end() - 1)
    return m.group(1), re.findall(r"%([\w.\-]+)", rest[m.end():end - 1]), rest[end:]


def _stack_tables(lines: list[str]) -> dict:
    """The ``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames`` tables of
    a module's text (``{section: {id: text}}``; each runs from its title to the first line that
    is not ``<id> <text>``), empty where there are none."""
    out, cur = {}, None
    for line in lines:
        s = line.strip()
        if s in _SECTIONS:
            cur = out.setdefault(s, {})
        elif cur is not None:
            m = re.match(r"^(\d+)\s+(.*)$", s)
            if m:
                cur[int(m.group(1))] = m.group(2)
            else:
                cur = None
    return out


def _frames_resolver(tables: dict):
    """A function ``stack_frame_id -> tuple[Frame]`` (innermost first) over the tables.

    XLA prints a frame's parent as the parent's id + 1 (so 1 is "no parent", and a frame with
    no caller reads as its own parent): checked on jax 0.11.2, where following ``parent - 1``
    walks every frame's chain down to the script's ``<module>``. Parents precede children, so a
    chain stops at an id that does not decrease."""
    names = {k: _unquote(v) for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: _unquote(v) for k, v in tables.get("FunctionNames", {}).items()}
    locs, frames = {}, {}
    for k, v in tables.get("FileLocations", {}).items():
        d = dict(_KV.findall(v))
        locs[k] = Frame(names.get(int(d.get("file_name_id", 0)), ""),
                        funcs.get(int(d.get("function_name_id", 0)), ""),
                        int(d.get("line", 0)))
    for k, v in tables.get("StackFrames", {}).items():
        d = dict(_KV.findall(v))
        frames[k] = (int(d.get("file_location_id", 0)), int(d.get("parent_frame_id", 0)) - 1)
    memo: dict[int, tuple] = {}

    def resolve(fid: int) -> tuple:
        if fid in memo:
            return memo[fid]
        chain, i = [], fid
        while i in frames and len(chain) < 1000:
            loc, parent = frames[i]
            if loc in locs:
                chain.append(locs[loc])
            if parent <= 0 or parent >= i:
                break
            i = parent
        memo[fid] = tuple(chain)
        return memo[fid]
    return resolve


def parse_hlo(text: str) -> HloIndex:
    """Every instruction of an HLO module's text (``compiled.as_text()``, any computation,
    fused ones included) with its opcode, ``op_name`` and Python stack.

    An instruction without a stack of its own (XLA makes some: layout copies, a CPU dot split
    off a fusion, a fusion that lost its metadata) takes the stack of its called computation's
    root, else of its first operand that has one (three levels deep at most); its ``via`` names
    that instruction. Raises ``ValueError`` for text with no instruction."""
    lines = text.splitlines()
    m = re.search(r"^HloModule\s+([^\s,]+)", text, re.M)
    module = m.group(1) if m else ""
    resolve = _frames_resolver(_stack_tables(lines))
    instrs, links, roots, comp = {}, {}, {}, None
    for line in lines:
        mi = _INSTR.match(line)
        if not mi:
            mc = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if mc and " = " not in line:
                comp = mc.group(1)
            continue
        name, rest = mi.group(1), mi.group(2)
        opcode, operands, attrs = _opcode_operands(rest)
        if not opcode:
            continue
        if line.lstrip().startswith("ROOT") and comp is not None:
            roots[comp] = name
        op_name, frames = "", ()
        mm = _METADATA.search(attrs)
        if mm:
            kv = {k: _unquote(v) for k, v in _KV.findall(mm.group(1))}
            op_name = kv.get("op_name", "")
            if "stack_frame_id" in kv:
                frames = resolve(int(kv["stack_frame_id"]))
            if not frames and kv.get("source_file"):
                frames = (Frame(kv["source_file"], "", int(kv.get("source_line", 0) or 0)),)
        called = re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", attrs)
        links[name] = (called, operands)
        instrs[name] = Instruction(name, opcode, op_name, frames)
    if not instrs:
        raise ValueError("no HLO instructions in the text (expected the text of an HLO module, "
                         "e.g. jax.jit(f).lower(...).compile().as_text())")

    def donor(name: str, depth: int) -> Instruction | None:
        called, operands = links.get(name, ((), ()))
        cands = [roots[c] for c in called if c in roots] + list(operands)
        for c in cands:
            if c in instrs and instrs[c].frames:
                return instrs[c]
        if depth > 1:
            for c in cands:
                d = donor(c, depth - 1) if c in instrs else None
                if d is not None:
                    return d
        return None

    for name, ins in list(instrs.items()):
        if not ins.frames:
            d = donor(name, 3)
            if d is not None:
                instrs[name] = ins._replace(op_name=ins.op_name or d.op_name, frames=d.frames,
                                            via=d.name)
    return HloIndex(module, instrs)


# ----------------------------------------------------------------------------- trace events

# Instructions whose events enclose other instructions' events (CPU thunks): never counted.
CONTAINERS = frozenset({"while", "conditional", "call", "async-start", "async-update",
                        "async-done"})


def match_instruction(event: dict, hlo: HloIndex) -> Instruction | None:
    """The instruction of ``hlo`` that launched a trace ``event``: its ``hlo_op`` argument, or
    else (or where that names a loop, call or command buffer) its name
    (:meth:`HloIndex.lookup_kernel`); None for an event of another module or none found."""
    args = event.get("args") or {}
    mod = args.get("hlo_module")
    if mod and hlo.module and hlo.module not in mod and mod not in hlo.module:
        return None
    ins = hlo.instructions.get(args.get("hlo_op", ""))
    if ins is not None and ins.opcode not in CONTAINERS:
        return ins
    return hlo.lookup_kernel(event.get("name", ""))


def split_events(events: list[dict], hlo: HloIndex) -> tuple[str, list[dict]]:
    """``(source, events)`` the split counts: the device streams' events (``"device
    streams"``) where the trace has any, else (CPU) the host events of ``hlo``'s own
    instructions other than :data:`CONTAINERS` (``"host thunks"``)."""
    dev = [e for e in events if device_stream(e)]
    if dev:
        return "device streams", dev
    host = []
    for e in events:
        op = (e.get("args") or {}).get("hlo_op")
        ins = match_instruction(e, hlo) if op else None
        if ins is not None and ins.name == op and ins.opcode not in CONTAINERS:
            host.append(e)
    return "host thunks", host


def kernel_group(name: str) -> str:
    """The group of a kernel no instruction claims, by its name (:data:`KERNEL_NAME_GROUPS`);
    :data:`UNMATCHED` where no fragment matches (cuBLAS GEMMs, memory copies)."""
    return next((g for frag, g in KERNEL_NAME_GROUPS if frag in name), UNMATCHED)


def group_table(events: list[dict], calls: int, hlo: HloIndex) -> list[dict]:
    """Per group (:data:`GROUPS`, then :data:`UNMATCHED`, in that order) of the ``events`` of
    a trace of ``calls`` calls: ``kernels`` and ``ms`` per call and ``share`` of their sum.
    Raises ``ValueError`` for ``calls`` < 1."""
    def key(e):
        ins = match_instruction(e, hlo)
        return kernel_group(e.get("name", "")) if ins is None else ins.group
    _, total, rows = kernel_table(events, calls, key=key, select=lambda e: True)
    per = {g: (n, ms) for g, n, ms in rows}
    return [{"group": g, "kernels": per.get(g, (0, 0.0))[0], "ms": per.get(g, (0, 0.0))[1],
             "share": per.get(g, (0, 0.0))[1] / total if total else 0.0}
            for g in GROUPS + (UNMATCHED,)]


def instruction_table(events: list[dict], calls: int, hlo: HloIndex, top: int) -> list[dict]:
    """The ``top`` heaviest instructions of the ``events`` (``calls`` calls): name, group,
    source, opcode, kernels and ms per call; unmatched kernels under their own names."""
    def key(e):
        ins = match_instruction(e, hlo)
        return ("?", e.get("name", "")) if ins is None else ("", ins.name)
    _, _, rows = kernel_table(events, calls, key=key, select=lambda e: True)
    out = []
    for (flag, name), n, ms in rows[:top]:
        ins = None if flag else hlo.instructions[name]
        out.append({"name": name, "group": kernel_group(name) if ins is None else ins.group,
                    "source": "" if ins is None else ins.source,
                    "opcode": "" if ins is None else ins.opcode,
                    "via": "" if ins is None else ins.via, "kernels": n, "ms": ms})
    return out


# ----------------------------------------------------------------------------- the prefill


@contextlib.contextmanager
def capture_hlo():
    """Within the block, every call of ``model``'s jitted chunk function (what
    ``model.prefill`` runs) is first compiled ahead of time on its very arguments and the
    optimized HLO text appended to the yielded object's ``texts``; the call itself then hits
    the same compilation cache. ``compiles`` counts the XLA compiles of those calls, the
    ahead-of-time ones included: one per call where the cache was shared."""
    real = model._chunk_jit
    cap = types.SimpleNamespace(texts=[], compiles=0)

    def shim(*args, **kwargs):
        c = xla_compiles()
        cap.texts.append(real.lower(*args, **kwargs).compile().as_text())
        out = real(*args, **kwargs)
        cap.compiles += xla_compiles() - c
        return out

    model._chunk_jit = shim
    try:
        yield cap
    finally:
        model._chunk_jit = real


def profile_prefill(params, cfg, n: int, mode: str, *, moe_impl: str = "auto",
                    attn_impl: str = "auto", reps: int = 3, calls: int = 3,
                    headroom: int = 256, seed: int = 0, top: int = 12,
                    dump: str | None = None) -> dict:
    """Time ``model.prefill`` of ``n`` tokens at batch 1 in ``mode`` and split its device time
    by op group (module docstring). ``dump``: a folder for the HLO text and the trace. Returns
    the row's record. Raises ``ValueError`` for a bad mode, ``moe_impl`` or count."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
    if min(n, reps, calls) < 1:
        raise ValueError(f"n, reps and calls must be >= 1, got {n}, {reps}, {calls}")
    tokens = prompt_tokens(cfg, 1, n, seed)

    def fresh():
        s = st.init_state(cfg, 1, n + headroom)
        jax.block_until_ready(s)
        return s

    def once(state):
        t0 = time.perf_counter()
        out, state = prefill_all(params, cfg, tokens, state, mode, None, attn_impl,
                                 moe_impl=moe_impl)
        jax.block_until_ready((out, state))
        return time.perf_counter() - t0

    c0 = xla_compiles()
    with capture_hlo() as cap:
        first = once(fresh())
    c1 = xla_compiles()
    hlo = parse_hlo(cap.texts[-1])
    wall = statistics.median(once(fresh()) for _ in range(reps))
    c2 = xla_compiles()
    states = [fresh() for _ in range(calls)]
    log_dir = tempfile.mkdtemp(prefix="profile_prefill_")
    try:
        with jax.profiler.trace(log_dir):
            for s in states:
                once(s)
        events = trace_events(log_dir)
        if dump:
            tag = f"prefill_{n}_{mode}_{moe_impl}"
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{tag}.hlo.txt"), "w") as f:
                f.write(cap.texts[-1])
            shutil.copytree(log_dir, os.path.join(dump, f"{tag}.trace"), dirs_exist_ok=True)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    launches, device_ms, kernels = kernel_table(events, calls)
    source, picked = split_events(events, hlo)
    groups = group_table(picked, calls, hlo)
    total = sum(g["ms"] for g in groups)
    unmatched = next(g["ms"] for g in groups if g["group"] == UNMATCHED)
    return {"length": n, "mode": mode, "moe_impl": moe_impl, "batch": 1,
            "capacity": n + headroom, "first_call_s": first, "wall_ms": 1e3 * wall,
            "tokens_per_s": n / wall, "device_ms": device_ms or None,
            "device_tokens_per_s": n / (device_ms / 1e3) if device_ms else None,
            "launches": launches, "hlo_module": hlo.module,
            "hlo_instructions": len(hlo.instructions), "programs": len(cap.texts),
            "program_compiles": cap.compiles, "xla_compiles_first_call": c1 - c0,
            "xla_compiles_timed": c2 - c1,
            "split_source": source, "split_ms": total,
            "matched_share": 1.0 - unmatched / total if total else None, "groups": groups,
            "instructions": instruction_table(picked, calls, hlo, top),
            "kernels": kernels[:top]}


def format_row(r: dict) -> list[str]:
    """The printed lines of a :func:`profile_prefill` record."""
    dev = (f"device {r['device_ms']:.2f} ms ({r['device_tokens_per_s']:,.0f} tokens/s) in "
           f"{r['launches']:.0f} kernels" if r["device_ms"] else "no device streams")
    out = [f"prefill {r['length']} tokens, {r['mode']}, moe {r['moe_impl']}: "
           f"{r['wall_ms']:.2f} ms wall ({r['tokens_per_s']:,.0f} tokens/s), {dev}; "
           f"first call {r['first_call_s']:.1f} s (the program compiled "
           f"{r['program_compiles']}x)",
           f"    {'group':<13}{'kernels/call':>13}{'ms/call':>11}{'share':>8}"]
    for g in r["groups"]:
        out.append(f"    {g['group']:<13}{g['kernels']:>13.1f}{g['ms']:>11.3f}"
                   f"{100 * g['share']:>7.1f}%")
    what = ("the device streams' kernels" if r["split_source"] == "device streams" else
            "the host events of the CPU runtime's thunks (CPU ms summed over threads)")
    matched = ("" if r["matched_share"] is None else
               f"; {100 * r['matched_share']:.1f}% of it matched to an HLO instruction or a "
               "kernel's name")
    out.append(f"    (split of {r['split_ms']:.3f} ms per call from {what}{matched})")
    for i in r["instructions"]:
        out.append(f"    {i['ms']:9.3f} ms x{i['kernels']:6.1f}  {i['group']:<12} "
                   f"{i['name'][:40]:<40} {i['source'][:70]}")
    return out


# ----------------------------------------------------------------------------- command line


def _modes(text: str) -> list[str]:
    vals = [m.strip() for m in text.split(",") if m.strip()]
    if not vals or any(m not in MODES for m in vals):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of "
                                         f"{', '.join(MODES)}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="profile_prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=E2E_CONFIGS, default="mid",
                    help="mid | release-fit | release-384 | tiny (default mid)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny config, 64 tokens, 1 timed and 1 traced call (CPU smoke test)")
    ap.add_argument("--lengths", type=positive_ints, default=None,
                    help="prompt tokens, comma-separated (default 4096; 64 with --tiny)")
    ap.add_argument("--modes", type=_modes, default=["ced"],
                    help="prefill modes, comma-separated: ced, exact (default ced)")
    ap.add_argument("--moe-impl", choices=MOE_IMPLS, default="auto",
                    help="routed experts of the prefill (model.prefill; default auto: routed where the "
                         "GPU kernel runs)")
    ap.add_argument("--attn-impl", default="auto",
                    help="kernel family of the prefill (model.prefill; default auto)")
    ap.add_argument("--linears", choices=model.LINEAR_FORMS, default="auto",
                    help="form of the FP8 linears and FP4 experts (model.prepare_params; "
                         "default auto: stored on a GPU, bf16 elsewhere)")
    ap.add_argument("--reps", type=positive_int, default=None,
                    help="timed calls after the first (default 3; 1 with --tiny)")
    ap.add_argument("--calls", type=positive_int, default=None,
                    help="traced calls (default 3; 1 with --tiny)")
    ap.add_argument("--headroom", type=positive_int, default=256,
                    help="state capacity beyond the prompt (default 256, as dsv41-bench-e2e)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens")
    ap.add_argument("--top", type=positive_int, default=12,
                    help="heaviest instructions printed per row (default 12)")
    ap.add_argument("--dump", default=None, metavar="DIR",
                    help="write each row's HLO text and keep its trace here")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Parsed and checked arguments (``SystemExit(2)`` with one line for a refused one)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.tiny:
        args.config = "tiny"
    small = args.config == "tiny"
    for key, big, tiny in (("lengths", [4096], [64]), ("reps", 3, 1), ("calls", 3, 1)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if small else big)
    try:
        check_family(args.attn_impl, "attn_impl")
    except ValueError as e:
        ap.error(f"argument --attn-impl: {e}")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"argument --out: no such directory: {os.path.dirname(args.out)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg, _ = e2e_config(args.config)
    params = model.prepare_params(random_params_device(cfg, args.seed), cfg, args.linears,
                                  donate=True)
    jax.block_until_ready(params)
    res = {"device": str(jax.devices()[0].device_kind), "config": args.config,
           "linears": args.linears, "moe_impl": args.moe_impl, "attn_impl": args.attn_impl,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "groups": list(GROUPS) + [UNMATCHED],
           "rows": []}
    for n in args.lengths:
        for mode in args.modes:
            r = profile_prefill(params, cfg, n, mode, moe_impl=args.moe_impl,
                                attn_impl=args.attn_impl, reps=args.reps, calls=args.calls,
                                headroom=args.headroom, seed=args.seed, top=args.top,
                                dump=args.dump)
            res["rows"].append(r)
            print("\n".join(format_row(r)), flush=True)
            write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
