"""Gathered FP4 experts: a MoE sublayer's routed experts for a few tokens, each token through
its own ``k`` experts, the weights read in place in the expert stack (docs/architecture.md,
"Mixture of experts"; docs/kernels.md, "Gathered FP4 experts").

``gathered_experts(x [T, D] bf16, w1, w3, w2, ids [T, k] int32, route_w [T, k] fp32, limit)
-> fp32 [T, D]``: for each token ``t`` and each of its experts ``e = ids[t, j]`` (ascending in
``j``: increasing expert id) ``a = bf16(silu(g) * u * route_w[t, j])`` with ``g, u`` the
token's FP8 QDQ input times ``w1[e]``, ``w3[e]`` (each rounded to bf16; ``u`` clamped to
``[-limit, limit]``, ``g`` from above, where ``limit > 0``), then ``y = bf16(QDQ(a) @
w2[e]^T)``, added into an fp32 sum in ``j`` order: the routed part of
:func:`dsv41_jax.layers.moe.moe`, whose shared expert and one bf16 rounding follow. The
experts are in the grouped matmul's kernel form (:func:`pallas_kernels.grouped_matmul.
prepare_experts`; ``"at"``: a layer's index in a stack of layers). The products are exact in
fp32, so implementations differ only in summation order.

Why: a decode step of a small batch routes each token to 6 of the experts. The XLA path
gathers their packed weights (a copy), quantises the activations in kernels of their own and
runs each projection as a multiply-reduce: some ten launches a layer. The two kernels
(:mod:`.triton`) read the weights where they lie and quantise in registers.

``routed_experts(x [T, D] bf16, scores [T, E] fp32, keys [T, E] fp32, w1, w3, w2, *, k,
route_scale, normalize, limit) -> fp32 [T, D]``: the same sum with the router's choice made in
the up kernel (:func:`.triton.route`: each program takes its token's ``k`` experts of largest
key (the scores plus the selection bias), its pair's id in increasing order and its weight;
the up kernel hands the ids to the down kernel). A decode step's router is then the scores'
XLA kernels and no launch of its own, where XLA takes two more (the top-k, the weights in
increasing expert id). The same experts as :func:`.reference.route` (``lax.top_k``: equal
keys, the lower id first); the weights' normalising sum is taken in another order (within an
fp32 rounding).

Implementations (``impl``, :mod:`pallas_kernels.impls`): ``"xla"`` (:mod:`.reference`),
``"gpu"`` (:mod:`.triton`), ``"gpu_interpret"``, ``"auto"`` (``"gpu"`` on an NVIDIA GPU where
:func:`kernel_fits`, else ``"xla"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import impls
from pallas_kernels.gathered_experts import reference, triton

__all__ = ["gathered_experts", "kernel_fits", "routed_experts"]


def _offsets_fit(w: dict) -> bool:
    """Whether Pallas Triton addresses the stack's bytes right: it computes offsets in 32
    bits up to 2**32 bytes, and a signed 32-bit offset past 2**31 points before the stack
    (jax 0.11.2: a release ``w1`` of 384 experts, 2.3 GB, gave an illegal address)."""
    size = w["i4"].size // 2
    return size < 2 ** 31 or size > 2 ** 32


def kernel_fits(w1: dict, w2: dict) -> bool:
    """Whether the GPU kernels take these experts: the kernel form, ``D`` and ``I`` (the
    inputs of ``w1`` and ``w2``) multiples of 64, and each stack's bytes addressable
    (:func:`_offsets_fit`)."""
    if "i4" not in w1 or "i4" not in w2:
        return False
    I, D = w1["i4"].shape[-2:]
    return (D % 64 == 0 and I % 64 == 0 and w2["i4"].shape[-2] == D
            and w2["i4"].shape[-1] == I and _offsets_fit(w1) and _offsets_fit(w2))


def gathered_experts(x: Float[Array, "T D"], w1: dict, w3: dict, w2: dict,
                     ids: Int[Array, "T k"], route_w: Float[Array, "T k"], limit: float, *,
                     impl: str = "auto", up_tuning: dict | None = None,
                     down_tuning: dict | None = None) -> Float[Array, "T D"]:
    """See the module docstring. ``ids`` must be ascending within each row (a token's
    experts are added in that order). ``up_tuning`` / ``down_tuning``: ``block_n``,
    ``block_k``, ``num_warps``, ``num_stages`` of each GPU kernel (:mod:`.triton`). Raises
    ``ValueError`` for an unknown ``impl``, and for ``impl="gpu"`` on experts
    :func:`kernel_fits` refuses."""
    impl = impls.check_family(impl)
    if impl == "auto":
        impl = "gpu" if impls.on_gpu() and kernel_fits(w1, w2) else "xla"
    if impl in ("xla", "tpu", "tpu_interpret"):
        return reference.gathered_experts(x, w1, w3, w2, ids, route_w, limit)
    if not kernel_fits(w1, w2):
        raise ValueError("gathered_experts: the GPU kernels need kernel-form experts whose "
                         "inputs are multiples of 64, each stack under 2**31 or over 2**32 "
                         "bytes")
    T, k = ids.shape
    E = w1["i4"].shape[-3]
    pair = ids.reshape(-1).astype(jnp.int32)
    pair13 = pair + (w1["at"] * E if "at" in w1 else 0)     # w1 and w3 stacked alike
    pair2 = pair + (w2["at"] * E if "at" in w2 else 0)
    interpret = impls.interpret(impl)
    up_tuning, down_tuning = up_tuning or {}, down_tuning or {}
    b1, s1 = triton.as_bytes(w1)
    b3, s3 = triton.as_bytes(w3)
    b2, s2 = triton.as_bytes(w2)
    a = triton.up(x, b1, s1, b3, s3, pair13, route_w.reshape(-1), k=k, limit=float(limit),
                  interpret=interpret, **up_tuning)
    y = triton.down(a, b2, s2, pair2, interpret=interpret, **down_tuning).reshape(T, k, -1)
    acc = jnp.zeros(y[:, 0].shape, jnp.float32)
    for j in range(k):                  # increasing expert id (XLA fuses it with what follows)
        acc = acc + y[:, j].astype(jnp.float32)
    return acc


def routed_experts(x: Float[Array, "T D"], scores: Float[Array, "T E"],
                   keys: Float[Array, "T E"], w1: dict, w3: dict, w2: dict, *, k: int,
                   route_scale: float, normalize: bool, limit: float, impl: str = "auto",
                   up_tuning: dict | None = None, down_tuning: dict | None = None
                   ) -> Float[Array, "T D"]:
    """See the module docstring: ``scores`` the router's scores, ``keys`` its selection keys
    (finite), ``k`` experts a token (``1 <= k <= E``). Raises ``ValueError`` for an unknown
    ``impl``, ``k`` out of range, ``scores`` / ``keys`` not ``[T, E]`` for the ``E`` experts of
    the stacks, and for ``impl="gpu"`` on experts :func:`kernel_fits` refuses."""
    impl = impls.check_family(impl)
    T, E = scores.shape
    if x.shape[0] != T or keys.shape != (T, E) or w1["i4"].shape[-3] != E:
        raise ValueError(f"scores {tuple(scores.shape)} and keys {tuple(keys.shape)} must be "
                         f"[T, E] for x {tuple(x.shape)} and {w1['i4'].shape[-3]} experts a "
                         f"layer")
    if not 1 <= k <= E:
        raise ValueError(f"k must be in 1 .. {E} (the experts), got {k}")
    if impl == "auto":
        impl = "gpu" if impls.on_gpu() and kernel_fits(w1, w2) else "xla"
    if impl in ("xla", "tpu", "tpu_interpret"):
        return reference.routed_experts(x, scores, keys, w1, w3, w2, k, route_scale, normalize,
                                        limit)
    if not kernel_fits(w1, w2):
        raise ValueError("routed_experts: the GPU kernels need kernel-form experts whose "
                         "inputs are multiples of 64, each stack under 2**31 or over 2**32 "
                         "bytes")
    Ep = 1 << (E - 1).bit_length()          # the lanes of the routing: a power of two
    scores, keys = scores.astype(jnp.float32), keys.astype(jnp.float32)
    if Ep != E:
        scores = jnp.pad(scores, ((0, 0), (0, Ep - E)))
        keys = jnp.pad(keys, ((0, 0), (0, Ep - E)), constant_values=-jnp.inf)
    zero = jnp.zeros((1,), jnp.int32)
    interpret = impls.interpret(impl)
    up_tuning, down_tuning = up_tuning or {}, down_tuning or {}
    b1, s1 = triton.as_bytes(w1)
    b3, s3 = triton.as_bytes(w3)
    b2, s2 = triton.as_bytes(w2)
    a, ids = triton.routed_up(scores, keys, w1.get("at", zero), x, b1, s1, b3, s3, k=k, E=E,
                              limit=float(limit), route_scale=float(route_scale),
                              normalize=bool(normalize), interpret=interpret, **up_tuning)
    y = triton.down(a, b2, s2, ids, w2.get("at", zero), E=E, interpret=interpret,
                    **down_tuning).reshape(T, k, -1)
    acc = jnp.zeros(y[:, 0].shape, jnp.float32)
    for j in range(k):                  # increasing expert id (XLA fuses it with what follows)
        acc = acc + y[:, j].astype(jnp.float32)
    return acc
