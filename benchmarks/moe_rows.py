"""The MoE rows of ``dsv41-bench-e2e`` (``--rows moe``): the FP4 grouped matmul at the routed
experts' shapes beside XLA's ``lax.ragged_dot``, the dense scan and the roofline, all measured
in the same run.

A row is a name of :mod:`benchmarks.grouped_matmul` (``"rel w1 b64"``: the release's 384
experts, 5120 -> 2304, 64 tokens routed to 6 experts each; ``w2`` is 2304 -> 5120; tokens
``b1`` .. ``b256`` are a decode step's batch, ``1K`` .. ``64K`` prefill tokens), with its
inputs (:func:`benchmarks.grouped_matmul.make_inputs`) and timing
(:func:`benchmarks.grouped_matmul.op_times`). Three implementations of the same projection:

* **kernel**: :func:`pallas_kernels.grouped_matmul.grouped_matmul` with ``impl="gpu"`` (the
  Mosaic GPU kernel with its padded layout's gather and un-padding) on an NVIDIA GPU; on other
  platforms ``"gpu_interpret"`` for the ``tiny`` shapes only (seconds on a CPU; its times say
  nothing about the GPU) and for the others nothing (null times and ratios, ``kernel_none``
  says why: XLA and the dense scan are not run either, there being no kernel to compare);
* **XLA**: :func:`pallas_kernels.grouped_matmul.reference.fp4_grouped_matmul` (dequantise all
  experts to bf16, ``lax.ragged_dot``), skipped where its dense fallback's ``[pairs, experts,
  K]`` mask would pass ``XLA_MAX_BYTES`` (null, ``xla_none``);
* **dense scan**: what ``dsv41_jax/layers/moe.py``'s ``moe_impl="dense"`` does for this
  projection, a ``lax.scan`` over every expert in increasing id that dequantises it and runs
  it over every token, adding each token's product times its routing weight (0 for the
  experts it is not routed to) into an fp32 ``[tokens, N]`` sum: ``2 x experts x tokens x N x
  K`` FLOPs. Skipped (null, ``dense_none``) where its roofline time (those FLOPs at the
  run's bf16 matmul rate, or its experts' FP4 bytes at the copy bandwidth, whichever is
  longer) passes ``--moe-dense-max-s`` (default 1 s a call: at the H200's ~700 TFLOP/s every
  default row runs, the longest, 64K tokens, at about 0.85 s a call; on a slower device the
  prefill-sized rows are skipped), or where its fp32 ``[tokens, N]`` sum and product and its
  ``[tokens, experts]`` routing weights would pass ``DENSE_MAX_BYTES``.

Times are device times (the trace's device streams, per call, mean of ``calls`` calls after
one that compiles: ``dsv41-bench-e2e`` makes 5 on a GPU, 2 on a CPU, where a call of the
interpret-mode kernel takes about 0.5 s) where the trace has them, else wall times
(``time_basis``: ``"device"`` on a GPU, ``"wall"`` on CPU).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grouped_matmul as gmb
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.fp4.reference import F32
from pallas_kernels.grouped_matmul import reference

#: The issue's rows: both projections of the release's experts at a decode step's batch
#: 1-256 and at 1K-64K prefill tokens.
DEFAULT_ROWS = tuple(f"rel {w} {t}" for w in ("w1", "w2")
                     for t in ("b1", "b8", "b64", "b256", "1K", "4K", "16K", "64K"))
#: ``--tiny``: shapes the interpret-mode kernel runs in seconds on a CPU.
TINY_ROWS = ("tiny w1 b1", "tiny w1 b8", "tiny w2 b8")
#: Default ``--moe-dense-max-s``: the dense scan runs only where its roofline time per call is
#: at most this many seconds.
DENSE_MAX_S = 1.0
#: The dense scan's largest working set (its fp32 sum and product, the tokens' rows, the
#: routing weights), bytes.
DENSE_MAX_BYTES = 16 << 30


def parse_rows(text: str) -> list[str]:
    """Comma-separated MoE row names -> a list; raises ``ValueError`` (one line) for an empty
    list or an unknown name."""
    rows = [r.strip() for r in text.split(",") if r.strip()]
    if not rows:
        raise ValueError("no MoE row given")
    for r in rows:
        try:
            gmb.parse_row(r)
        except ValueError:
            raise ValueError(f"unknown row {r!r}: '<{'|'.join(gmb.SHAPES)}> "
                             f"<{'|'.join(gmb.TOKENS)}>'") from None
    return rows


def kernel_impl(name: str, platform: str | None = None) -> str | None:
    """How the kernel runs for row ``name`` on ``platform`` (default: JAX's backend):
    ``"gpu"`` on a GPU, ``"gpu_interpret"`` elsewhere for the ``tiny`` shapes, None (not run)
    for the other shapes."""
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda"):
        return "gpu"
    return "gpu_interpret" if name.startswith("tiny ") else None


def dense_scan(x_tok: jax.Array, codes: jax.Array, scale: jax.Array, dense_w: jax.Array
               ) -> jax.Array:
    """The dense path of the routed experts for one projection: fp32 ``[T, N]`` = the sum over
    every expert ``e`` (a ``lax.scan`` in increasing id, as ``moe.py``'s ``moe_impl="dense"``)
    of ``dense_w[:, e]`` times ``x_tok [T, K] @ W[e]^T``, ``W[e]`` dequantised to bf16 inside
    the scan. ``dense_w`` fp32 [T, E]: routing weights, 0 where a token is not routed."""
    def body(acc, a):
        c, s, we = a
        w = reference.dequant_experts(c[None], s[None])[0]             # bf16 [N, K]
        y = jnp.dot(x_tok, w.T, preferred_element_type=F32)
        return acc + we[:, None] * y, None

    T, N = x_tok.shape[0], codes.shape[1]
    acc, _ = jax.lax.scan(body, jnp.zeros((T, N), F32), (codes, scale, dense_w.T))
    return acc


def dense_estimate_s(E: int, N: int, K: int, tokens: int, roof: dict) -> float:
    """The dense scan's roofline seconds per call: its ``2 E T N K`` FLOPs at the bf16 matmul
    rate or every expert's FP4 bytes at the copy bandwidth, whichever is longer."""
    return max(2.0 * E * tokens * N * K / (roof["bf16_matmul_TFLOPs"] * 1e12),
               gmb.expert_bytes(E, N, K) / (roof["copy_GBps"] * 1e9))


def dense_bytes(E: int, N: int, K: int, tokens: int) -> int:
    """The dense scan's working set in bytes: fp32 ``[T, N]`` sum and product, bf16 ``[T, K]``
    rows, fp32 ``[T, E]`` routing weights."""
    return tokens * (2 * 4 * N + 2 * K + 4 * E)


def _time(t: dict) -> float:
    return t["device_us"] if t["device_us"] is not None else t["wall_us"]


@jax.jit
def _rel_err(got, want):
    """Largest |got - want| over the largest |want|."""
    got, want = got.astype(F32), want.astype(F32)
    return jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-30)


@functools.partial(jax.jit, static_argnames=("tokens",))
def _pair_sums(y, pair_w, pair_token, tokens: int):
    """The pairs' products ``y`` [P, N] times their routing weights, summed per token: fp32
    [tokens, N] (one fused pass: no fp32 copy of ``y``)."""
    return jnp.zeros((tokens, y.shape[1]), F32).at[pair_token].add(
        pair_w[:, None] * y.astype(F32))


def moe_row(name: str, roof: dict, seed: int = 0, dense_max_s: float = DENSE_MAX_S,
            xla_max_bytes: int = gmb.XLA_MAX_BYTES, calls: int = 5) -> dict:
    """Measure one MoE row (module docstring) against the roofline ``roof``
    (:func:`benchmarks.timing.roofline` of the same run). Returns its record: the shape
    (``experts``, ``N``, ``K``, ``tokens``, ``pairs``, ``experts_hit``), ``flops`` (``2 P N
    K``), ``weight_bytes`` (the hit experts' int4 codes and bf16 scales), per implementation
    the microseconds per call (``op_us``: the kernel's whole op; ``kernel_us``: its own
    launches, GPU only; ``xla_us``, ``dense_us``) or null with the reason (``kernel_none``,
    ``xla_none``, ``dense_none``), ``tflops`` and ``weights_TBps`` of the op (TFLOP/s, TB/s
    of expert weights; ``kernel_*`` on ``kernel_us``), the ratios ``x_xla`` = ``xla_us /
    op_us`` and ``x_dense`` = ``dense_us / op_us`` (how many times faster the kernel is), the
    floor ``floor_us`` = max(flops at the bf16 matmul rate, weight bytes at the copy
    bandwidth) with ``x_floor`` = ``op_us / floor_us`` and the roofline fractions
    ``flops_frac`` (TFLOP/s over the matmul rate) and ``bw_frac`` (weight bytes per second
    over the copy bandwidth), and the errors of the kernel against XLA and of the kernel's
    weighted pair sums against the dense scan (``max_err``, ``dense_max_err``:
    largest difference over the largest value)."""
    E, N, K, tokens = gmb.parse_row(name)
    impl = kernel_impl(name)
    if impl is None:
        return {"kind": "moe", "name": name, "experts": E, "N": N, "K": K, "tokens": tokens,
                "pairs": tokens * min(gmb.TOP_K, E), "experts_hit": None, "kernel_impl": None,
                "kernel_none": f"no GPU ({jax.default_backend()}): the Mosaic GPU kernel runs "
                               "in interpret mode off the GPU for the tiny shapes only",
                **dict.fromkeys(("time_basis", "op_us", "kernel_us", "xla_us", "dense_us",
                                 "x_xla", "x_dense", "x_floor"))}
    inp = gmb.make_inputs(E, N, K, tokens, seed)
    codes, scale, gs, x, x_tok = (inp[k] for k in ("codes", "scale", "group_sizes", "x",
                                                   "x_tok"))
    P, hit = x.shape[0], inp["hit"]
    flops = 2.0 * P * N * K
    weight_bytes = gmb.expert_bytes(hit, N, K)
    rate, bw = roof["bf16_matmul_TFLOPs"] * 1e12, roof["copy_GBps"] * 1e9
    floor_us = 1e6 * max(flops / rate, weight_bytes / bw)
    rec = {"kind": "moe", "name": name, "experts": E, "N": N, "K": K, "tokens": tokens,
           "top_k": inp["idx"].shape[1], "pairs": P, "experts_hit": hit, "flops": flops,
           "weight_bytes": weight_bytes, "roof_TFLOPs": roof["bf16_matmul_TFLOPs"],
           "roof_GBps": roof["copy_GBps"], "floor_us": floor_us,
           "floor_basis": "max(FLOPs / bf16 matmul rate, expert weight bytes / copy bandwidth)"}
    outs = {}
    rec["kernel_impl"] = impl
    w = jax.jit(gm.prepare_experts)(codes, scale)
    kernel = jax.jit(lambda x, w, gs: gm.grouped_matmul(x, w, gs, impl=impl))
    t0 = time.perf_counter()
    outs["kernel"] = jax.block_until_ready(kernel(x, w, gs))
    rec["first_call_s"] = time.perf_counter() - t0
    t = gmb.op_times(kernel, (x, w, gs), calls)
    op_us = _time(t)
    kern = gmb.kernel_us(t["kernels"]) if t["device_us"] is not None else None
    rec.update(time_basis="device" if t["device_us"] is not None else "wall",
               op_us=op_us, kernel_us=kern or None,
               tflops=flops / op_us / 1e6, weights_TBps=weight_bytes / op_us / 1e6,
               kernel_tflops=flops / kern / 1e6 if kern else None,
               kernel_weights_TBps=weight_bytes / kern / 1e6 if kern else None,
               x_floor=op_us / floor_us,
               flops_frac=flops / (op_us * 1e-6) / rate,
               bw_frac=weight_bytes / (op_us * 1e-6) / bw,
               kernels=[{"name": k["name"][:60], "us": k["us_per_op"]}
                        for k in t["kernels"][:5]])
    del w
    if P * E * K * 2 <= xla_max_bytes:
        xla = jax.jit(reference.fp4_grouped_matmul)
        outs["xla"] = jax.block_until_ready(xla(x, codes, scale, gs))
        t = gmb.op_times(xla, (x, codes, scale, gs), calls)
        rec["xla_us"] = _time(t)
        if "kernel" in outs:
            rec["max_err"] = float(_rel_err(outs["kernel"], outs["xla"]))
    else:
        rec.update(xla_us=None, xla_none=f"its dense fallback's [pairs, experts, K] mask, "
                                         f"{P * E * K * 2 / 1e9:.0f} GB, passes "
                                         f"{xla_max_bytes / 1e9:.0f} GB")
    est = dense_estimate_s(E, N, K, tokens, roof)
    rec["dense_estimate_s"] = est
    if dense_bytes(E, N, K, tokens) > DENSE_MAX_BYTES:
        rec.update(dense_us=None, dense_none=f"its working set, "
                                             f"{dense_bytes(E, N, K, tokens) / 1e9:.0f} GB, "
                                             f"passes {DENSE_MAX_BYTES / 1e9:.0f} GB")
    elif est <= dense_max_s:
        dense_w = np.zeros((tokens, E), np.float32)
        np.put_along_axis(dense_w, inp["idx"], inp["weights"], axis=1)
        dense_w = jnp.asarray(dense_w)
        dense = jax.jit(dense_scan)
        want = jax.block_until_ready(dense(x_tok, codes, scale, dense_w))
        t = gmb.op_times(dense, (x_tok, codes, scale, dense_w), calls)
        rec["dense_us"] = _time(t)
        got = _pair_sums(outs["kernel"], jnp.asarray(inp["weights"].ravel()[inp["order"]]),
                         jnp.asarray(inp["pair_token"]), tokens)
        rec["dense_max_err"] = float(_rel_err(got, want))
        del want
    else:
        rec.update(dense_us=None, dense_none=f"its roofline time, {est:.3g} s a call, passes "
                                             f"--moe-dense-max-s {dense_max_s:g}")
    rec["x_xla"] = rec["xla_us"] / op_us if op_us and rec["xla_us"] else None
    rec["x_dense"] = rec["dense_us"] / op_us if op_us and rec["dense_us"] else None
    return rec
