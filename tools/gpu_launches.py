"""Kernel launches of a step compiled for an H200, counted on a machine without a GPU.

XLA compiles for a GPU it is only told about (a *deviceless* compile: a PJRT topology made from
an H200's target description, no CUDA driver needed; ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` of the installed jax's version must be importable, run with
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``). The entry point's jitted function is lowered as the
GPU would lower it (the Pallas kernels, the stored FP8 / FP4 forms of ``prepare_params``) on
abstract parameters (nothing of the model's size is built), compiled, and the compiled
program's kernels are counted statically: every fusion, custom call (Pallas Triton / Mosaic
GPU, cuBLAS) and copy of the entry computation, each loop body times its known trip count
(the scanned layer groups), a conditional by its largest branch. The count is per call and
split by op group (``tools/profile_prefill.py``'s classifier) and by source line.

What it does not see: kernels the runtime adds (memsets, a cuBLAS GEMM's split-K pass) and
XLA's autotuning (none runs deviceless, so a GEMM may pick another kernel than on the GPU).
Checked against an H200 profile of the same code (`mid`, decode B=1 after 4K): 2,866 launches
traced, see docs/benchmarks.md "Kernel launches counted without a GPU".

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python tools/gpu_launches.py --config mid \\
        --targets decode,prefill:ced:4096 --out launches.json
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time
from unittest import mock

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import dsv41_jax  # noqa: E402,F401  (first: the XLA numerics flag)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.config import e2e_config  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402
from dsv41_jax import model, state as st  # noqa: E402
from dsv41_jax.cli.args import Parser, positive_int  # noqa: E402
from dsv41_jax.random_weights import random_params_device  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_compile import parse_target  # noqa: E402
from profile_prefill import GROUPS, parse_hlo  # noqa: E402

# An H200 as XLA's GPU compiler sees it (stream_executor's GpuTargetConfigProto, text form).
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""

# opcodes that launch nothing
NO_LAUNCH = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                       "after-all", "partition-id", "replica-id", "opt-barrier",
                       "add-dependency", "fusion-done", "copy-done", "async-done",
                       "async-update"})


def h200_device():
    """The one device of a deviceless H200 topology. Raises ``RuntimeError`` naming the
    missing packages where the CUDA PJRT plugin is not installed."""
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET,
                                            topology="1x1x1")
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError(
            "a deviceless CUDA compile needs jax-cuda12-plugin and jax-cuda12-pjrt of jax "
            f"{jax.__version__} (pip install --no-deps; no CUDA libraries needed): {e}") from e
    return topo.devices[0]


def _as_gpu():
    """Context: the code paths of an NVIDIA GPU (``jax.default_backend()`` says "cuda"; the
    Pallas Triton backend targets an H200)."""
    from contextlib import ExitStack

    from jax._src.pallas.triton import gpu_info
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    stack = ExitStack()
    stack.enter_context(mock.patch("jax.default_backend", lambda: "cuda"))
    stack.enter_context(mock.patch.object(gpu_info, "get_gpu_info", lambda: h200))
    return stack


def abstract_params(cfg, linears: str = "stored", experts: str = "kernel"):
    """Shapes and dtypes of ``model.prepare_params(random_params_device(cfg), cfg, linears,
    experts)`` as a GPU prepares them, without building them: the load-time value checks
    (``wo_a`` exactly FP8 blocks, the head exact in bf16) taken to pass, as they do for the
    stored checkpoint and the random weights."""
    def fp8_blocks(w):
        if (w is None or w.dtype != jnp.bfloat16 or w.ndim != 2 or w.shape[0] % 32
                or w.shape[1] % 32):
            return None
        N, K = w.shape
        return {"fp8": w.astype(jnp.float8_e4m3fn),
                "scale": jnp.zeros((N // 32, K // 32), jnp.uint8)}

    def head(w):
        return w.astype(jnp.bfloat16) if w.dtype == jnp.float32 else w

    with _as_gpu(), mock.patch.object(model, "_fp8_blocks_of", fp8_blocks), \
            mock.patch.object(model, "_bf16_if_exact", head):
        return jax.eval_shape(lambda: model.prepare_params(random_params_device(cfg, 0), cfg,
                                                           linears, experts))


def lower_target(cfg, target: tuple, device, batch: int, context: int, moe_impl: str = "auto"):
    """``jit(...).lower`` of one entry point's compiled step for ``device`` (deviceless):
    ``("decode",)`` (one token per row after ``context`` tokens), ``("prefill", mode, N)``
    (a fresh state) or ``("verify", K)``; abstract parameters (:func:`abstract_params`)."""
    sh = jax.sharding.SingleDeviceSharding(device)

    def abstract(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree)

    params = abstract(abstract_params(cfg))
    kind = target[0]
    n_new = target[2] if kind == "prefill" else (target[1] + 1 if kind == "verify" else 1)
    start = 0 if kind == "prefill" else context
    state = jax.eval_shape(lambda: st.init_state(cfg, batch, start + n_new + 8))
    state = abstract(state)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)  # noqa: E731
    compat = jax.ShapeDtypeStruct((), jnp.bool_, sharding=sh)
    with _as_gpu():
        impls = model.kernel_impls(cfg, "auto")
        static = model.Static(cfg, False, False, *impls, moe_impl=moe_impl, mesh=None)
        if kind == "decode":
            return model._chunk_jit.jitted.lower(
                params, i32(batch, 1), i32(batch), state, None, None, compat, static=static,
                mode="exact", replay_len=1, all_logits=False)
        if kind == "prefill":
            n = target[2]
            return model._chunk_jit.jitted.lower(
                params, i32(batch, n), i32(batch), state, None, None, compat, static=static,
                mode=target[1], replay_len=min(cfg.window_size, n), all_logits=False)
        k = target[1]
        return model._verify_jit.jitted.lower(params, i32(batch, k + 1), i32(batch), state,
                                              compat, static=static)


_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


def _opcode(rest: str) -> str:
    """The opcode of an instruction's text after ``=`` (its type, possibly a tuple, first)."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += (c == "(") - (c == ")")
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"\s*([\w\-]+)\(", rest)
    return m.group(1) if m else ""


def static_launches(text: str) -> dict:
    """Kernel launches per call of a compiled GPU program's text (``compiled.as_text()``).

    Returns ``{"launches": int, "by_kind": {kind: n}, "by_group": {group: n}, "by_source":
    {source: n}, "by_instruction": {name: n}, "unknown_trip_counts": int}``: a fusion, custom
    call, copy or any other instruction outside :data:`NO_LAUNCH` is one launch; a ``while``
    counts its body and condition times its ``known_trip_count`` (once where XLA does not
    know it: ``unknown_trip_counts``); a ``conditional`` its largest branch; a ``call`` its
    callee.
    Kinds: ``fusion:<kind>`` (``kLoop``, ``kInput``, ``__triton`` GEMMs...), ``cc:<target>``,
    else the opcode. Raises ``ValueError`` for text without an ENTRY computation."""
    comps, entry, cur = {}, None, None
    for line in text.splitlines():
        if not line.startswith(" "):
            m = _COMP.match(line)
            if m and " = " not in line:
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
                continue
            if line.startswith("}"):
                cur = None
            continue
        mi = _INSTR.match(line)
        if cur is not None and mi:
            comps[cur].append((mi.group(1), _opcode(mi.group(2)), mi.group(2)))
    if entry is None:
        raise ValueError("no ENTRY computation in the text (expected compiled.as_text())")
    hlo = parse_hlo(text)
    unknown = [0]

    def walk(comp: str, times: int, out: dict):
        for name, op, rest in comps.get(comp, ()):
            if op in NO_LAUNCH or not op:
                continue
            if op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                n = int(trip.group(1)) if trip else 1
                unknown[0] += trip is None
                for key in ("condition", "body"):
                    walk(re.search(key + r"=%?([\w.\-]+)", rest).group(1), times * n, out)
                continue
            if op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", rest)
                branches = (re.findall(r"%?([\w.\-]+)", m.group(1)) if m else
                            [re.search(k + r"=%?([\w.\-]+)", rest).group(1)
                             for k in ("true_computation", "false_computation")])
                subs = []
                for b in branches:
                    sub = collections.defaultdict(collections.Counter)
                    walk(b, times, sub)
                    subs.append(sub)
                best = max(subs, key=lambda s: sum(s["kind"].values()))
                for k, c in best.items():
                    out[k].update(c)
                continue
            if op == "call":
                walk(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1), times, out)
                continue
            if op in ("fusion", "fusion-start"):
                m = re.search(r'"kind":"(\w+)"', rest) or re.search(r"kind=(\w+)", rest)
                kind = "fusion:" + (m.group(1) if m else "?")
            elif op == "custom-call":
                kind = "cc:" + re.search(r'custom_call_target="([^"]+)"', rest).group(1)
            else:
                kind = op
            ins = hlo.instructions.get(name)
            out["kind"][kind] += times
            out["group"][ins.group if ins else "rest"] += times
            out["source"][(ins.source or "?") if ins else "?"] += times
            out["instruction"][name] += times

    out = collections.defaultdict(collections.Counter)
    walk(entry, 1, out)
    return {"launches": sum(out["kind"].values()),
            "by_kind": dict(out["kind"].most_common()),
            "by_group": {g: out["group"].get(g, 0) for g in GROUPS},
            "by_source": dict(out["source"].most_common()),
            "by_instruction": dict(out["instruction"].most_common()),
            "unknown_trip_counts": unknown[0]}


def build_parser():
    ap = Parser(prog="gpu_launches", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="mid", help="mid | release-fit | release-384 | "
                    "release | tiny (default mid)")
    ap.add_argument("--targets", default="decode",
                    help="comma-separated: decode, prefill:ced|exact:N, verify:K (default decode)")
    ap.add_argument("--batch", type=positive_int, default=1, help="rows (default 1)")
    ap.add_argument("--context", type=positive_int, default=4096,
                    help="tokens of context before a decode or verify step (default 4096)")
    ap.add_argument("--moe-impl", default="auto", help="routed MoE implementation (default auto)")
    ap.add_argument("--top", type=positive_int, default=25,
                    help="source lines printed (default 25)")
    ap.add_argument("--hlo-dir", default=None, help="also write each compiled program's text here")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        targets = [parse_target(t) for t in args.targets.split(",")]
    except ValueError as e:
        print(f"gpu_launches: --targets: {e}", file=sys.stderr)
        return 2
    try:
        cfg, _ = e2e_config(args.config)
    except ValueError as e:
        print(f"gpu_launches: --config: {e}", file=sys.stderr)
        return 2
    device = h200_device()
    res = {"config": args.config, "batch": args.batch, "context": args.context,
           "device": "H200 (deviceless compile)", "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "rows": []}
    for target in targets:
        label = ":".join(map(str, target))
        t0 = time.perf_counter()
        lowered = lower_target(cfg, target, device, args.batch, args.context, args.moe_impl)
        t1 = time.perf_counter()
        text = lowered.compile().as_text()
        t2 = time.perf_counter()
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, label.replace(":", "_") + ".hlo"), "w") as f:
                f.write(text)
        counts = static_launches(text)
        counts.pop("by_instruction")          # per HLO instruction: long, and in --hlo-dir
        row = {"target": label, "lower_s": t1 - t0, "compile_s": t2 - t1, **counts}
        res["rows"].append(row)
        print(f"{label}: {row['launches']} launches per call (lowering {row['lower_s']:.1f} s, "
              f"XLA for an H200 {row['compile_s']:.1f} s on this machine)")
        print("  by group: " + ", ".join(f"{g} {n}" for g, n in row["by_group"].items()))
        print("  by kind:  " + ", ".join(f"{k} {n}" for k, n in row["by_kind"].items()))
        print(f"  launches by source line, the {args.top} largest (? = no source):")
        for src, n in list(row["by_source"].items())[:args.top]:
            print(f"  {n:6d}  {src}")
    if args.out:
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
