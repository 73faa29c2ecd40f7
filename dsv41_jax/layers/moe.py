"""Mixture of experts: sqrt-softplus gate with a selection-only bias, SwiGLU experts
(docs/architecture.md, "Mixture of experts").

Routed experts are stacked along a leading expert axis ``E`` (packed FP4 or bf16); the shared
expert is a plain (fp8 or bf16) SwiGLU. The combination follows the reference exactly: expert
outputs (bf16) are added into an fp32 sum in increasing expert id, the shared expert is added
last, and the sum is rounded to bf16 once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax.config import ModelConfig
from dsv41_jax import quant
from dsv41_jax.layers.linear import (dequant_weight, is_quantized, linear, linear_pair,
                                     swiglu_linear)
from dsv41_jax.dtypes import BF16, F32, HIGHEST
from pallas_kernels import gathered_experts, grouped_matmul


def _softplus(z):
    # torch.nn.functional.softplus(beta=1, threshold=20): identity above the threshold.
    return jnp.where(z > 20.0, z, jnp.log1p(jnp.exp(jnp.minimum(z, 20.0))))


def gate_scores(x: Float[Array, "N D"], weight: Float[Array, "E D"], cfg: ModelConfig
                ) -> Float[Array, "N E"]:
    """The router's scores (fp32): ``f32(x) @ f32(weight)^T / gate_temp`` through
    ``cfg.score_func`` (``sqrt(softplus)``, softmax or sigmoid). See docs/architecture.md,
    "Mixture of experts"."""
    logits = jnp.einsum("nd,ed->ne", x.astype(F32), weight.astype(F32), precision=HIGHEST,
                        preferred_element_type=F32) / cfg.gate_temp
    if cfg.score_func == "sqrtsoftplus":
        return jnp.sqrt(_softplus(logits))
    if cfg.score_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def gate_keys(x: Float[Array, "N D"], p: dict, cfg: ModelConfig,
              image_mask: Bool[Array, "N"] | None) -> tuple[Float[Array, "N E"], Float[Array, "N E"]]:
    """The router's scores (:func:`gate_scores`) and its selection keys: the scores plus the
    bias (``bias_vl`` for image-span tokens), fp32. See docs/architecture.md, "Mixture of
    experts"."""
    s = gate_scores(x, p["weight"], cfg)
    bias = p["bias"][None, :]
    if image_mask is not None and "bias_vl" in p:
        bias = jnp.where(image_mask[:, None], p["bias_vl"][None, :], bias)
    return s, s + bias


def gate(x: Float[Array, "N D"], p: dict, cfg: ModelConfig, image_mask: Bool[Array, "N"] | None,
         n_active: int) -> tuple[Int[Array, "N k"], Float[Array, "N k"]]:
    """Router: top-k expert ids (``lax.top_k`` order: descending biased score) and weights.

    ``logits = f32(x) @ f32(W)^T / gate_temp``; ``s = sqrt(softplus(logits))``; the bias (or
    ``bias_vl`` for image-span tokens) only selects; weights are the unbiased scores,
    renormalised with +1e-20 and multiplied by ``route_scale``. See docs/architecture.md,
    "Mixture of experts".
    """
    s, keys = gate_keys(x, p, cfg, image_mask)
    _, idx = jax.lax.top_k(keys, n_active)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and n_active > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx, w * cfg.route_scale


#: A stacked FP8 expert without routing weight (the shared expert) in a decode step on a GPU:
#: its ``w2`` GEMV makes its input, the SwiGLU, from the ``w1`` / ``w3`` pair GEMV's partial
#: sums (:func:`dsv41_jax.layers.linear.swiglu_linear`; no launch for the pair's reduction or
#: the activation; bitwise XLA's on an H100; timed with ``layers.linear.ROPE_IN_KERNEL``, see
#: there). False: XLA computes the SwiGLU from the pair's outputs.
SWIGLU_IN_KERNEL = True


def expert(x: Float[Array, "N D"], p: dict, limit: float,
           route_w: Float[Array, "N"] | None = None) -> Float[Array, "N D"]:
    """SwiGLU expert with the reference clamps; the routing weight multiplies before ``w2``.

    ``up`` is clamped to [-limit, limit], the gate branch from above only
    (docs/architecture.md, "Mixture of experts"; B15).
    """
    g, up, parts = linear_pair(x, p["w1"], p["w3"], partials=True)   # one GEMV launch
    if SWIGLU_IN_KERNEL and route_w is None:    # w2's GEMV makes its input from the pair's sums
        y = swiglu_linear(parts, p["w2"], limit, x.shape[0])
        if y is not None:
            return y
    g, up = g.astype(F32), up.astype(F32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        g = jnp.minimum(g, limit)
    a = jax.nn.silu(g) * up
    if route_w is not None:
        a = a * route_w[:, None]
    return linear(a.astype(BF16), p["w2"])


def ascending_order(idx: Int[Array, "N k"]) -> Int[Array, "N k"]:
    """``jnp.argsort(idx, axis=-1, stable=True)`` for the few expert ids of each row, without
    a sort: an id's slot is the number of smaller ids in its row plus the equal ones before it,
    and slot ``s`` of the result holds the position whose slot is ``s``. For the few rows of
    the gathered paths these ``k x k`` comparisons fuse with their neighbours, where a sort is
    a kernel of its own on a GPU; at 64 rows XLA makes the two reductions two kernels, so the
    grouped path keeps ``jnp.argsort``."""
    k = idx.shape[-1]
    pos = jnp.arange(k, dtype=jnp.int32)
    a, b = idx[:, None, :], idx[:, :, None]                         # [N, i, j]: j against i
    slot = jnp.sum((a < b) | ((a == b) & (pos[None, :] < pos[:, None])), axis=-1,
                   dtype=jnp.int32)                                 # [N, k] slot of position i
    return jnp.sum(jnp.where(slot[:, :, None] == pos, pos[:, None], 0), axis=1,
                   dtype=jnp.int32)


def _routed_experts(x: Float[Array, "N D"], experts: dict, idx: Int[Array, "N k"],
                    w: Float[Array, "N k"], limit: float) -> Float[Array, "N D"]:
    """The routed experts of each token, gathered: fp32 sum in increasing expert id."""
    N, k = idx.shape
    order = ascending_order(idx)
    ids = jnp.take_along_axis(idx, order, axis=-1)
    ws = jnp.take_along_axis(w, order, axis=-1)

    # One vmap over the N * k (token, expert) pairs (each pair its own expert call, as a vmap
    # over tokens of a vmap over their experts would run it, at half the tracing).
    pe = jax.tree.map(lambda a: a[ids.reshape(-1)], experts)    # packed weights per pair
    xp = jnp.repeat(x, k, axis=0)
    ys = jax.vmap(lambda x_p, pe_p, w_p: expert(x_p[None], pe_p, limit, w_p[None])[0])(
        xp, pe, ws.reshape(-1)).reshape(N, k, -1)               # bf16 [N, k, D]
    acc = jnp.zeros(x.shape, F32)
    for j in range(k):
        acc = acc + ys[:, j].astype(F32)
    return acc


def _expert_weights_in_out(pe: dict) -> jax.Array:
    """Stacked expert weights ``[E, out, in]`` (any stored or prepared form) -> bf16
    ``[E, in, out]``, the right-hand side of a grouped matmul (exact)."""
    return jnp.swapaxes(dequant_weight(pe, BF16), -1, -2)


def _grouped_linear(x: Float[Array, "P I"], pe: dict, group_sizes: Int[Array, "E"]
                    ) -> Float[Array, "P O"]:
    """Rows sorted by expert times their expert's weight, as :func:`linear` would for each row
    (FP8 act-quant for a quantised weight, fp32 accumulation, bf16 out): one grouped matmul
    over the stacked experts (FP4 experts: :func:`pallas_kernels.grouped_matmul.grouped_matmul`,
    the GPU kernel for the kernel form; otherwise ``lax.ragged_dot``)."""
    if is_quantized(pe):
        x = quant.act_quant_qdq(x, 32)
    if "fp4" in pe or grouped_matmul.is_kernel_form(pe):
        return grouped_matmul.grouped_matmul(x, pe, group_sizes)
    y = jax.lax.ragged_dot(x.astype(BF16), _expert_weights_in_out(pe), group_sizes,
                           preferred_element_type=F32)
    return y.astype(BF16)


#: A decode step's grouped path on the GPU kernel lays its (token, expert) pairs out where
#: they are (:func:`pallas_kernels.grouped_matmul.row_padding`: counts and comparisons, no
#: sort, no scatter of a permutation) instead of sorting them by expert first; the padded
#: layout, hence every output bit, is the same. False: sorted first (the layout before).
ROW_PADDING = True


def _grouped_experts(x: Float[Array, "N D"], experts: dict, idx: Int[Array, "N k"],
                     w: Float[Array, "N k"], limit: float) -> Float[Array, "N D"]:
    """The routed experts as grouped matmuls over the (token, expert) pairs only: the pairs
    sorted by expert id (stable), one grouped matmul per expert projection, the outputs put
    back per token and summed in fp32 in increasing expert id (the reference's order; within
    one product only the summation order may differ from :func:`expert`). Experts in the GPU
    kernel's form on a GPU: the pairs laid out once in the kernel's padded layout for all
    three projections (:func:`_padded_experts`)."""
    N, k = idx.shape
    E = next(v for key, v in experts["w1"].items() if key != "at").shape[-3]
    flat_e = idx.reshape(-1)
    if (grouped_matmul.uses_kernel(experts["w1"])
            and N * k <= grouped_matmul.ROW_PADDING_MAX_ROWS and ROW_PADDING):
        # the pairs where they are: each token's in increasing expert id, no sort
        pad = grouped_matmul.row_padding(flat_e, E)
        pos = (jnp.arange(N)[:, None] * k + ascending_order(idx)).reshape(-1)
        return _padded_experts(x, experts, jnp.arange(N * k, dtype=jnp.int32) // k,
                               w.reshape(-1), pad, pos, limit)
    perm = jnp.argsort(flat_e, stable=True)                      # pairs sorted by expert
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    ws = w.reshape(-1)[perm]
    # each token's pairs in increasing expert id -> their positions in the sorted order
    pairs = (jnp.arange(N)[:, None] * k + jnp.argsort(idx, axis=-1)).reshape(-1)
    pos = jnp.zeros_like(perm).at[perm].set(jnp.arange(N * k, dtype=perm.dtype))[pairs]
    if grouped_matmul.uses_kernel(experts["w1"]):
        pad = grouped_matmul.padding(group_sizes, N * k)
        return _padded_experts(x, experts, perm // k, ws, pad, pos, limit)
    xs = x[perm // k]                                            # [P, D] the pairs' tokens
    g = _grouped_linear(xs, experts["w1"], group_sizes).astype(F32)
    up = _grouped_linear(xs, experts["w3"], group_sizes).astype(F32)
    a = _swiglu(g, up, ws, limit)
    ys = _grouped_linear(a, experts["w2"], group_sizes)          # bf16 [P, D], sorted
    y = ys[pos].reshape(N, k, -1)                                # per token, by expert id
    acc = jnp.zeros(x.shape, F32)
    for j in range(k):
        acc = acc + y[:, j].astype(F32)
    return acc


def _swiglu(g, up, ws, limit: float):
    """The expert's clamped SwiGLU times the routing weight (fp32 in, bf16 out)."""
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        g = jnp.minimum(g, limit)
    return (jax.nn.silu(g) * up * ws[:, None]).astype(BF16)


def _padded_experts(x: Float[Array, "N D"], experts: dict, token: Int[Array, "P"],
                    ws: Float[Array, "P"], pad: grouped_matmul.Padding, pos: Int[Array, "Nk"],
                    limit: float) -> Float[Array, "N D"]:
    """The routed experts' three projections on the GPU kernel, ``pad``'s rows being the
    pairs (``token`` and routing weight ``ws`` of each): the pairs gathered once into the
    kernel's padded layout, kept in it between the projections; then each token's ``k``
    outputs (pairs ``pos.reshape(N, k)``, in increasing expert id) added in fp32."""
    N = x.shape[0]
    xp = pad.pad(quant.act_quant_qdq(x, 32), token)            # the FP8 QDQ rows, padded
    g = grouped_matmul.padded_matmul(xp, experts["w1"], pad).astype(F32)     # [R, F]
    up = grouped_matmul.padded_matmul(xp, experts["w3"], pad).astype(F32)
    a = _swiglu(g, up, pad.pad(ws), limit)
    y = grouped_matmul.padded_matmul(quant.act_quant_qdq(a, 32), experts["w2"], pad)  # [R, D]
    y = y[pad.dest[pos]].reshape(N, pos.shape[0] // N, -1)                   # [N, k, D]
    acc = jnp.zeros((N, y.shape[-1]), F32)
    for j in range(y.shape[1]):
        acc = acc + y[:, j].astype(F32)
    return acc


def _pair_experts(x: Float[Array, "N D"], experts: dict, idx: Int[Array, "N k"],
                  w: Float[Array, "N k"], limit: float) -> Float[Array, "N D"]:
    """The few-pairs call (:func:`gathered`) on the GPU kernel: each token's pairs in
    increasing expert id, one token tile per pair (:func:`grouped_matmul.pair_padding`: no
    sort by expert, no group sizes), the experts' FP4 weights read in place from their stack;
    the same sums as :func:`_routed_experts` up to the summation order inside each product."""
    N, k = idx.shape
    order = ascending_order(idx)
    ids = jnp.take_along_axis(idx, order, axis=-1).reshape(-1)
    ws = jnp.take_along_axis(w, order, axis=-1).reshape(-1)
    pad = grouped_matmul.pair_padding(ids)
    token = jnp.repeat(jnp.arange(N, dtype=jnp.int32), k)
    return _padded_experts(x, experts, token, ws, pad, jnp.arange(N * k), limit)


MOE_IMPLS = ("auto", "dense", "routed")
#: Calls of fewer (token, expert) pairs than ``max(E, GATHERED_PAIRS)`` may run the gathered
#: path (:func:`gathered`); the floor keeps the few-token calls of configs with few experts
#: (the mid benchmark's 16, a CPU's dense path) off the dense scan over every expert.
GATHERED_PAIRS = 64

#: The routed path's bound on the gathered path (:func:`gathered`): the expected number of
#: expert weight reads beyond one per routed expert (:func:`expected_rereads`). The gathered path
#: reads one expert's weights per (token, expert) pair, so an expert that two tokens share is
#: read twice; the grouped matmul reads each routed expert once but lays the pairs out in some
#: ten more launches per layer. Timed on an H100 (mid config: 16 experts, top-6; 4K context;
#: synced ms per step, gathered against grouped): batch 3 (5.9 expected rereads) 12.1 against
#: 14.3, batch 5 (15.5) 12.7 against 13.8, batch 8 (32.4) 17.5 against 15.9. The bound sits
#: between the last two: up to 6 tokens gathered there, up to 24 at the release's 384 experts
#: (not yet timed there).
GATHERED_REREADS = 24.0


#: Whether a few-pairs call (:func:`gathered`) with kernel-form experts on a GPU runs the
#: grouped matmul kernel with one token tile per pair (:func:`_pair_experts`: the FP4 bytes of
#: the pairs' experts read in place) instead of gathering the experts' weights and
#: dequantising them to bf16 (:func:`_routed_experts`). Off until it is timed against the
#: gathered path on the H200 (``.carry``'s decode A/B); the two agree up to the summation
#: order inside each product (tests/test_grouped_matmul.py). Counted without a GPU
#: (``tools/gpu_launches.py``, ``mid`` decode at batch 1, H200): 2,008 launches per step with
#: it against 1,912 without (the MoE's 536 against 400: the padding, the activation
#: quantisations and the three projections stay separate kernels);
#: docs/results/deviceless_launches_mid_gathered_on_kernel.json.
GATHERED_ON_KERNEL = False

#: Whether a few-pairs call (:func:`gathered`) with kernel-form experts on a GPU runs the two
#: gathered-experts kernels (:mod:`pallas_kernels.gathered_experts`: the pairs' FP4 weights
#: read in place, the activations quantised in registers, SwiGLU and the routing weight in
#: the first kernel, each pair's ``w2`` in the second, the fp32 sum in increasing expert id
#: fused by XLA with the shared expert's addition) instead of the XLA path
#: (:func:`_routed_experts`: the pairs' weights gathered, the projections as multiply-reduce
#: fusions, some ten launches a layer). The same sums up to the order inside each product.
#: Timed on an H100 (``mid`` decode step after 4K, ``tools/decode_ab.py --variants
#: gathered_xla,gathered_kernels``; docs/benchmarks.md, "Gathered FP4 experts"): batch 1
#: 6.55 -> 6.16 ms queued (device 6.89 -> 6.42 ms, 1,851 -> 1,611 launches), batch 4 9.62 ->
#: 8.82 ms, and a first call 7 s shorter to compile.
GATHERED_KERNELS = True

#: Whether the gathered-experts kernels (:data:`GATHERED_KERNELS`) make the router's choice
#: themselves (:func:`pallas_kernels.gathered_experts.routed_experts`: each up-kernel program
#: takes its token's top-k of the selection keys and its pair's expert and weight from the
#: scores): of the XLA router's four launches a layer (the scores' product, the scores with
#: the bias, the top-k, the weights in increasing expert id) the last two are gone. The same
#: experts (equal keys: the lower id, as ``lax.top_k``); the weights' normalising sum in
#: another order (an fp32 rounding). ``moe`` still returns the XLA gate's ids and weights,
#: which a decode step does not read (XLA drops them). Counted without a GPU (``mid`` decode
#: at batch 1, H200): 1,476 launches a step against 1,539. Timed on an H100 (``mid`` decode
#: after 4K, batch 1, ``tools/decode_ab.py --variants route_xla,base``; docs/benchmarks.md,
#: "Switches timed"): 6.11 -> 6.00 ms queued, 1,487 -> 1,423 launches traced. False: XLA's
#: router before the gathered-experts kernels.
ROUTE_IN_KERNEL = True
#: The most routed experts for which :data:`ROUTE_IN_KERNEL` applies. Checked against XLA on
#: an H100: at 16 experts (``mid``) the sums are 99.98-100% bitwise equal; at 384 (the
#: release's; 1,024 x 256 experts, 2 tokens) the ids are equal but only 91.6% of the sums,
#: against 99.95% in interpret mode at that shape, which is not yet explained: above this the
#: XLA router feeds the gathered-experts kernels, as before.
ROUTE_MAX_EXPERTS = 64


def expected_rereads(n_tokens: int, k: int, n_exp: int) -> float:
    """Expected expert weight reads of the gathered path beyond one per routed expert, for
    ``n_tokens`` tokens each routed to ``k`` distinct of ``n_exp`` experts uniformly: ``n_tokens
    * k - n_exp * (1 - (1 - k / n_exp) ** n_tokens)`` (the second term: the expected number of
    distinct experts routed). 0 for one token."""
    return n_tokens * k - n_exp * (1.0 - (1.0 - k / n_exp) ** n_tokens)


def gathered(n_tokens: int, k: int, n_exp: int, impl: str = "routed") -> bool:
    """Whether ``n_tokens`` tokens routed to ``k`` of ``n_exp`` experts run the gathered path
    (each token its ``k`` experts, their packed weights gathered): fewer (token, expert) pairs
    than ``max(n_exp, GATHERED_PAIRS)`` and, where the alternative is the grouped matmul
    (``impl == "routed"``), fewer than :data:`GATHERED_REREADS` expected rereads
    (:func:`expected_rereads`)."""
    if n_tokens * k >= max(n_exp, GATHERED_PAIRS):
        return False
    return impl != "routed" or expected_rereads(n_tokens, k, n_exp) < GATHERED_REREADS


def moe(x: Float[Array, "N D"], p: dict, cfg: ModelConfig, image_mask: Bool[Array, "N"] | None,
        n_active: int | None = None, impl: str = "auto", mesh=None
        ) -> tuple[Float[Array, "N D"], Int[Array, "N k"], Float[Array, "N k"]]:
    """MoE sublayer on flattened tokens: ``(bf16 output, expert ids, routing weights)``.

    When the tokens route to few (token, expert) pairs (:func:`gathered`: ``N * k <
    max(E, GATHERED_PAIRS)`` and, for ``"routed"``, few experts shared; e.g. a decode step of
    a small batch or a verify), each token runs only its ``k`` experts, their packed weights
    gathered; otherwise ``impl`` decides:
    ``"dense"`` runs the routed experts densely over the stacked expert axis (a ``lax.scan``
    in increasing expert id, non-routed tokens carry weight 0 and contribute an exact 0),
    ``"routed"`` runs grouped matmuls over the (token, expert) pairs only
    (:func:`_grouped_experts`). All reproduce the
    reference's fp32 accumulation order (increasing expert id, the shared expert last, one
    bf16 rounding); the gathered and dense paths bit for bit, the routed one up to the
    summation order inside each product. Experts in the grouped matmul's kernel form
    (``prepare_params(..., experts="kernel")``) run the routed path through the GPU kernel
    (:mod:`pallas_kernels.grouped_matmul`). ``"auto"``: ``"routed"`` where that kernel runs
    (an NVIDIA GPU, kernel-form experts), ``"dense"`` elsewhere. Raises ``ValueError`` for an
    unknown ``impl``. See docs/architecture.md, "Mixture of experts".

    ``mesh`` (a :func:`dsv41_jax.sharding.make_mesh` mesh) with an ``expert`` axis above 1:
    expert parallelism (:func:`_expert_parallel`; docs/architecture.md, "Sharding").
    """
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe impl must be one of {MOE_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "routed" if grouped_matmul.uses_kernel(p["experts"]["w1"]) else "dense"
    k = n_active or cfg.n_activated_experts
    idx, w = gate(x, p["gate"], cfg, image_mask, k)
    n_exp = p["gate"]["weight"].shape[0]
    if mesh is not None and dict(mesh.shape).get("expert", 1) > 1:
        acc = _expert_parallel(x, p["experts"], idx, w, n_exp, impl, cfg.swiglu_limit, mesh)
    elif _routes_in_kernel(x.shape[0], k, n_exp, impl, p):
        ex = p["experts"]
        acc = gathered_experts.routed_experts(
            x, *gate_keys(x, p["gate"], cfg, image_mask), ex["w1"], ex["w3"], ex["w2"], k=k,
            route_scale=cfg.route_scale, normalize=cfg.norm_topk_prob, limit=cfg.swiglu_limit)
    else:
        acc = _routed_sum(x, p["experts"], idx, w, n_exp, impl, cfg.swiglu_limit)
    return _with_shared(acc, x, p, cfg), idx, w


def _routes_in_kernel(n_tokens: int, k: int, n_exp: int, impl: str, p: dict) -> bool:
    """Whether :func:`moe` takes :data:`ROUTE_IN_KERNEL`'s path: where the few-pairs call of
    :func:`_routed_sum` would run the gathered-experts kernels."""
    ex = p["experts"]
    return (ROUTE_IN_KERNEL and n_exp <= ROUTE_MAX_EXPERTS and GATHERED_KERNELS
            and not GATHERED_ON_KERNEL
            and gathered(n_tokens, k, n_exp, impl) and grouped_matmul.uses_kernel(ex["w1"])
            and gathered_experts.kernel_fits(ex["w1"], ex["w2"]))


def _routed_sum(x: Float[Array, "N D"], experts: dict, idx: Int[Array, "N k"],
                w: Float[Array, "N k"], n_exp: int, impl: str, limit: float
                ) -> Float[Array, "N D"]:
    """The routed experts' fp32 sum (:func:`moe` without the gate and the shared expert).
    ``experts`` may be a slice of the model's ``n_exp`` experts (expert parallelism: ``idx``
    then indexes the slice, tokens of other experts carrying weight 0); the path is chosen by
    ``n_exp``, as on one device."""
    k = idx.shape[1]
    few = gathered(x.shape[0], k, n_exp, impl)
    if impl == "routed" and grouped_matmul.is_kernel_form(experts["w1"]) and not few:
        # the stacks handed on whole: the grouped matmul reads them in place
        return _grouped_experts(x, experts, idx, w, limit)
    if few and GATHERED_ON_KERNEL and grouped_matmul.uses_kernel(experts["w1"]):
        return _pair_experts(x, experts, idx, w, limit)
    if (few and GATHERED_KERNELS and grouped_matmul.uses_kernel(experts["w1"])
            and gathered_experts.kernel_fits(experts["w1"], experts["w2"])):
        order = ascending_order(idx)
        return gathered_experts.gathered_experts(
            x, experts["w1"], experts["w3"], experts["w2"],
            jnp.take_along_axis(idx, order, axis=-1), jnp.take_along_axis(w, order, axis=-1),
            limit)
    experts = {name: grouped_matmul.in_layer(v) for name, v in experts.items()}
    if few:
        return _routed_experts(x, experts, idx, w, limit)
    if impl == "routed":
        return _grouped_experts(x, experts, idx, w, limit)
    n_local = next(v for key, v in experts["w1"].items() if key != "at").shape[-3]
    dense_w = jnp.zeros((x.shape[0], n_local), F32).at[
        jnp.arange(x.shape[0])[:, None], idx].add(w)

    def body(acc, args):
        pe, we = args
        return acc + expert(x, pe, limit, we).astype(F32), None

    acc, _ = jax.lax.scan(body, jnp.zeros(x.shape, F32), (experts, dense_w.T))
    return acc


def _expert_spec(a) -> P:
    """An expert stack's leaf (``[..., E, N, K']``; ``"at"`` a scalar) split over ``expert``
    on its expert axis."""
    nd = jnp.ndim(a)
    return P(*([None] * (nd - 3)), "expert") if nd >= 3 else P()


def _expert_parallel(x: Float[Array, "N D"], experts: dict, idx: Int[Array, "N k"],
                     w: Float[Array, "N k"], n_exp: int, impl: str, limit: float, mesh
                     ) -> Float[Array, "N D"]:
    """Expert parallelism (docs/architecture.md, "Sharding"): the routing (``idx``, ``w``) is
    replicated; in a ``shard_map`` manual over the mesh's ``expert`` axis (the others left to
    the compiler), each shard holds ``E / expert`` whole experts, runs :func:`_routed_sum` on
    them for every token (a token's pairs with experts of other shards get weight 0 and an id
    clamped into the shard: an exact 0 in the sum) and a ``psum`` over ``expert`` adds the
    shards' fp32 partial sums. The shared expert and the one bf16 rounding follow, as on one
    device.

    Numerics: the fp32 sum of a token's expert outputs is taken in another association (each
    shard's experts in increasing id, then the shards); where that sum is exact in fp32 (the
    usual case: ``k`` bf16 values whose exponents lie within fp32's extra 16 bits) the result
    is bitwise the single-device one, otherwise it may differ by the fp32 rounding before the
    bf16 one (at most 1 bf16 ulp of the output)."""
    n_shards = dict(mesh.shape)["expert"]
    if n_exp % n_shards:
        raise ValueError(f"{n_exp} routed experts do not divide by the mesh's expert axis "
                         f"({n_shards})")
    n_local = n_exp // n_shards

    def local(x, experts, idx, w, shard):
        lo = shard[0] * n_local          # this shard's first expert (shard: its index, [1])
        loc = idx - lo
        mine = (loc >= 0) & (loc < n_local)
        acc = _routed_sum(x, experts, jnp.clip(loc, 0, n_local - 1), jnp.where(mine, w, 0.0),
                          n_exp, impl, limit)
        return jax.lax.psum(acc, "expert")

    specs = jax.tree.map(_expert_spec, experts)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(), P(), P("expert")),
                         out_specs=P(), axis_names=frozenset({"expert"}), check_vma=False)(
        x, experts, idx, w, jnp.arange(n_shards, dtype=jnp.int32))


def _with_shared(acc: Float[Array, "N D"], x: Float[Array, "N D"], p: dict, cfg: ModelConfig
                 ) -> Float[Array, "N D"]:
    """The routed experts' fp32 sum plus the shared expert, rounded to bf16 once."""
    acc = acc + expert(x, p["shared_experts"], cfg.swiglu_limit).astype(F32)
    return acc.astype(BF16)
