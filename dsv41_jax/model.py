"""The DeepSeek-V4.1-Flash text model: blocks, forward, CED prefill and decode.

See docs/architecture.md, "Forward pass" and "CED prefill and bounded replay"; a block's
sublayers are described under "Attention layer (CSA2)", "Mixture of experts",
"mHC: hyper-connections" and "Engram".

Entry points (pure; jit-compiled with the config static and the state donated):

* :func:`forward` - every position through every layer (the reference's semantics, the oracle);
  returns the logits of every position.
* :func:`prefill` - a chunk of prompt tokens per row (``lengths`` valid), continuing from any
  state. ``mode="ced"``: the encoder runs over all positions, the decoder's global KV is
  projected from the encoder output, and the decoder runs only over the last ``min(N, W)``
  positions (bounded replay). ``mode="exact"``: every position through every layer.
* :func:`decode_step` - one token per row through all layers; :func:`decode_fn` - the same as a
  pure traceable function, for loops that stay on the device (:mod:`dsv41_jax.generation`).
* :func:`draft` - DSpark drafts after the state's positions (docs/architecture.md, "DSpark
  draft head"); :func:`verify` - k + 1 positions per row in one call, only the accepted prefix
  committed (docs/architecture.md, "Verify and rollback"); :func:`draft_fn` /
  :func:`verify_fn` - the same as pure traceable functions.

The layers run as scanned groups over parameters stacked once by :func:`prepare_params`
(docs/architecture.md, "Scanned layer groups"); each layer gets the slices of the state it reads
(:class:`dsv41_jax.state.LayerState`).

Bad input raises ``ValueError`` before anything runs, so a rejected call never touches the state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.experimental.compute_on import compute_on

from dsv41_jax import checkpoint, quant, saved_steps, sharding, state as st
from dsv41_jax.config import LayerGroup, LayerPlan, ModelConfig
from dsv41_jax.layers import dspark
from dsv41_jax.layers import engram as engram_layer
from dsv41_jax.layers import mhc
from dsv41_jax.layers.attention import Bus, Chunk, attention, kv_source_update
from dsv41_jax.layers.linear import dequant_weight, lm_head, rms_norm
from dsv41_jax.layers.moe import MOE_IMPLS, moe
from dsv41_jax.layers.rope import rope_frequencies
from dsv41_jax.sampling import SamplingParams
from dsv41_jax.dtypes import BF16, F32
from pallas_kernels import grouped_matmul
from pallas_kernels.impls import check_family, on_gpu
from pallas_kernels.indexer import impl_for_family, select_impl_for_family
from pallas_kernels.sparse_attention import resolve_impl


class Static(NamedTuple):
    """Hashable static arguments of the compiled entry points."""

    cfg: ModelConfig
    collect: bool = False
    batch_invariant: bool = False
    attn_impl: str = "xla"   # resolved sparse-attention implementation (never "auto")
    index_impl: str = "xla"  # resolved indexer-scores implementation (never "auto")
    select_impl: str = "xla"  # resolved indexer top-k implementation (never "auto")
    moe_impl: str = "auto"   # routed experts of a large call (layers.moe.MOE_IMPLS)
    mesh: Any = None         # device mesh (dsv41_jax.sharding.make_mesh), None: one device


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["logits", "all_logits", "final_hidden", "replay_logits",
                                "records"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What :func:`prefill` and :func:`forward` return beside the state.

    * ``logits`` fp32 [B, V]: at each row's last valid token.
    * ``all_logits`` fp32 [B, S, V] and ``final_hidden`` bf16 [B, S, D]: every position of the
      chunk (``all_logits=True``, exact mode or decode), else ``None``.
    * ``replay_logits`` fp32 [B, R, V]: the bounded replay's positions (``all_logits=True`` in
      CED mode), else ``None``.
    * ``records``: per-layer intermediates, ``{layer: {name: array}}`` (``collect=True``), else
      ``None``.
    """

    logits: Any
    all_logits: Any = None
    final_hidden: Any = None
    replay_logits: Any = None
    records: Any = None


# ----------------------------------------------------------------------------- parameters


LINEAR_FORMS = ("auto", "bf16", "stored")
EXPERT_FORMS = ("auto", "stored", "kernel")


def _fp8_blocks_of(w) -> dict | None:
    """A bf16 weight ``[out, in]`` whose 32 x 32 blocks each hold FP8 values times one power of
    two (an FP8 linear dequantised at load, as ``wo_a``) -> ``{"fp8": codes, "scale": E8M0}``
    with exactly those values, or None if it is not one (or is traced: no check possible).
    Each block gets the smallest scale that keeps its amax within e4m3's 448; every value of
    an FP8-derived block divides exactly by it, which is checked."""
    if (isinstance(w, jax.core.Tracer) or w.dtype != BF16 or w.ndim != 2
            or w.shape[0] % 32 or w.shape[1] % 32):
        return None
    N, K = w.shape
    b = w.astype(F32).reshape(N // 32, 32, K // 32, 32)
    amax = jnp.max(jnp.abs(b), axis=(1, 3))
    e = quant._pow2_ceil_exponent(jnp.maximum(amax, np.float32(448.0 * 2.0 ** -126)) / 448.0)
    s = quant.exp2_int(e)[:, None, :, None]
    codes = (b / s).astype(jnp.float8_e4m3fn)
    if not bool(jnp.all(codes.astype(F32) * s == b)):
        return None
    return {"fp8": codes.reshape(N, K), "scale": (e + 127).astype(jnp.uint8)}


def _bf16_if_exact(w):
    """An fp32 weight whose values are all exact in bf16 (the LM head: stored BF16, an fp32
    parameter at run time) -> its bf16 copy, half the bytes a decode step reads; else (or
    traced: no check possible) ``w`` as it is."""
    if isinstance(w, jax.core.Tracer) or w.dtype != F32:
        return w
    wb = w.astype(BF16)
    return wb if bool(jnp.all(wb.astype(F32) == w)) else w


def _prepare_layer(lp: dict, linears: str, experts: str) -> dict:
    if linears == "stored" and "wo_a" in lp.get("attn", {}):
        fp8 = _fp8_blocks_of(lp["attn"]["wo_a"].get("weight"))
        if fp8 is not None:
            lp = {**lp, "attn": {**lp["attn"], "wo_a": fp8}}

    def walk(d, in_experts=False):
        if isinstance(d, dict):
            if "fp8" in d:
                return d
            w = d.get("weight")
            if w is not None and w.dtype == jnp.float8_e4m3fn:
                if linears == "bf16":
                    return {"dq": dequant_weight(d, BF16)}
                return {"fp8": w, "scale": d["scale"]}
            if in_experts and w is not None and w.dtype == jnp.uint8:
                if experts == "kernel" and grouped_matmul.kernel_fits(w.shape[-2],
                                                                      2 * w.shape[-1]):
                    return grouped_matmul.prepare_experts(w, d["scale"])
                if linears == "stored":
                    return {"fp4": w, "scale": d["scale"]}
            # Engram's table is an embedding, not a linear
            return {k: (v if k == "engram" else walk(v, in_experts or k == "experts"))
                    for k, v in d.items()}
        return d
    return walk(lp)


def prepare_params(params, cfg: ModelConfig, linears: str = "auto", experts: str = "auto",
                   *, donate: bool = False):
    """The parameters in the form the compiled steps read fastest, prepared once at load time
    (docs/architecture.md, "Scanned layer groups" and "Quantised linears").

    * The layers' parameters are stacked per :class:`~dsv41_jax.config.LayerGroup`: for every
      run of a group's units, one tree with leading axes [units, layers in the run].
    * ``linears``: the form of the FP8 block-scaled linears and the FP4 routed experts.
      ``"bf16"``: FP8 linears dequantised to bf16 once (``{"dq": W}``), experts packed as
      stored; every call is a GEMM. ``"stored"``: both kept as stored (``{"fp8": W, "scale":
      S}``, ``{"fp4": ...}``), and ``wo_a`` (dequantised to bf16 at load, as the reference
      does) back in FP8 where its values are exactly FP8 blocks (checked; else it stays
      bf16); a call of a few rows (decode) reads the stored bytes in place (the FP8 stacked
      GEMV kernel on a GPU, else a fused dequantise-multiply-reduce), a larger one
      dequantises and runs the GEMM (:func:`dsv41_jax.layers.linear.linear`). ``"auto"``: ``"stored"`` on an NVIDIA GPU,
      ``"bf16"`` elsewhere. Either way the numerics are the stored formats' (activations are
      still quantised on use; FP8 / FP4 values times a power of two are exact in bf16), the
      results differing only in summation order.

    * With ``linears="stored"`` the fp32 LM head is kept in bf16 where every value is exact
      there (checked; the checkpoint stores it BF16): the head reads half the bytes, its
      products still exact, accumulated in fp32 (:func:`head_logits`).

    * The DSpark draft head (``params["dspark"]``, when loaded) keeps one tree per stage
      (``stages``), its linears in the same form.

    ``params``: the pytree of :func:`dsv41_jax.checkpoint.params_from_tensors` (or
    :func:`~dsv41_jax.random_weights.random_params_device`); an already prepared tree is returned
    as it is. Every entry point accepts both; passing the raw tree re-prepares it per call.
    * ``experts``: the form of the FP4 routed experts. ``"kernel"``: the GPU grouped matmul's
      form (:func:`pallas_kernels.grouped_matmul.prepare_experts`: int4 codes, transposed
      bf16 scales; the same bytes as stored, plus the scales' width) where the kernel tiles
      the shapes; the routed MoE (``moe_impl="routed"``) then runs every routed pair through
      that kernel, a decode step streaming only the selected experts' weights. ``"stored"``:
      as ``linears`` says. ``"auto"``: ``"kernel"`` on an NVIDIA GPU, ``"stored"`` elsewhere.
      The kernel-form experts of every scanned layer are pooled into one stack,
      ``params["routed_experts"]`` (``[layers, E, ...]``), each layer keeping its index in it
      (``{"pool_at": ...}`` in place of its experts): every grouped-matmul call of one shape
      then reads the same array, so the program holds one kernel per shape, not one per
      layer group (:class:`_ExpertPool`; docs/architecture.md, "Mixture of experts").

    * ``donate``: the raw tree's device arrays are deleted as they are used, and each layer's
      prepared arrays once they are stacked, so the peak is the prepared tree plus about one
      layer (docs/architecture.md, "Loading at full size"); without it the raw and the prepared
      trees are both held, which a model of more than half a GPU's memory does not survive
      (the release dimensions with 384 experts: 45 + 46 GiB). The raw tree is unusable
      afterwards (arrays shared with the prepared tree are kept).

    Raises ``ValueError`` for a ``linears`` not in :data:`LINEAR_FORMS` or ``experts`` not in
    :data:`EXPERT_FORMS`.
    """
    if linears not in LINEAR_FORMS:
        raise ValueError(f"linears must be one of {LINEAR_FORMS}, got {linears!r}")
    if experts not in EXPERT_FORMS:
        raise ValueError(f"experts must be one of {EXPERT_FORMS}, got {experts!r}")
    if "layer_groups" in params:
        return params
    if linears == "auto":
        linears = "stored" if on_gpu() else "bf16"
    if experts == "auto":
        experts = "kernel" if on_gpu() else "stored"
    plan = LayerPlan.from_config(cfg)
    raw = params["layers"]
    out = {k: v for k, v in params.items() if k != "layers"}
    # arrays never deleted: those outside the layers and any a layer shares with another
    seen: set[int] = set()
    keep = {id(a) for k, v in out.items() if k != "dspark" for a in jax.tree.leaves(v)}
    for lp in raw:
        ids = {id(a) for a in jax.tree.leaves(lp)}
        keep |= ids & seen
        seen |= ids

    def prepared(i: int) -> dict:
        lp = _prepare_layer(raw[i], linears, experts)
        if donate:
            _release(raw[i], keep | {id(a) for a in jax.tree.leaves(lp)})
        return lp

    def stack(shape, *arrays):
        y = _stack_layers(arrays, shape)
        if donate:
            _release(arrays, keep)
        return y

    groups = []
    pool = _ExpertPool() if experts == "kernel" else None
    for g in plan.groups:
        runs = []
        for start, length in g.runs:
            members = [prepared(u[start + j]) for u in g.units for j in range(length)]
            run = jax.tree.map(functools.partial(stack, (len(g.units), length)), *members)
            del members
            runs.append(pool.take(run, donate) if pool is not None else run)
        groups.append(tuple(runs))
    out["layer_groups"] = tuple(groups)
    if pool is not None and pool.parts:
        out[POOLED_EXPERTS] = pool.stack()
    if linears == "stored" and "head" in out:
        head = out["head"]["weight"]
        out["head"] = {**out["head"], "weight": _bf16_if_exact(head)}
        if donate and out["head"]["weight"] is not head:
            _release(head, set())
    if "dspark" in params:
        ds = params["dspark"]
        out["dspark"] = {**_prepare_layer({k: v for k, v in ds.items() if k != "stages"},
                                          linears, experts),
                         "stages": tuple(_prepare_layer(lp, linears, experts)
                                         for lp in ds["stages"])}
        if donate:
            _release(ds, keep | {id(a) for a in jax.tree.leaves(out["dspark"])})
    return out


#: Key of the pooled kernel-form routed experts in the prepared tree (:class:`_ExpertPool`).
POOLED_EXPERTS = "routed_experts"
_EXPERT_LINEARS = ("w1", "w2", "w3")


class _ExpertPool:
    """The kernel-form routed experts of the scanned runs, gathered into one stack per leaf
    (``{w1, w2, w3} x {i4, scale_t}``, ``[layers, E, ...]``) by :func:`prepare_params`.

    Why: the grouped matmul's Mosaic GPU kernel takes the stack it reads in place, and the
    stack's length is part of the kernel's type; with one stack per run, each layer group's
    calls compiled a kernel of their own (about a second each in a first call). With one pool,
    the calls of one shape share a kernel.

    Memory: each run's experts go to the device's host memory a layer at a time as soon as the
    run is stacked (``pinned_host``; the device copy is freed), and come back into one device
    buffer at the end, a layer at a time: the device holds the pool plus one layer's experts
    at most.
    The pinned host memory holds all the routed experts meanwhile (``memory_plan``'s ``host``).
    A run whose experts are split over several devices (the sliced loader on a mesh), or on a
    device without pinned host memory, keeps its own stack; traced leaves
    (``jax.eval_shape``) are concatenated."""

    def __init__(self):
        self.parts: list[dict] = []
        self.count = 0
        self.traced = False

    def take(self, run: dict, donate: bool) -> dict:
        """``run`` with its kernel-form experts moved into the pool and replaced by
        ``{"pool_at": int32 [units, layers]}`` (their layers' indices in the pool); a run
        without such experts, or whose experts lie on several devices, as it is."""
        ffn = run.get("ffn")
        ex = ffn.get("experts") if isinstance(ffn, dict) else None
        if not isinstance(ex, dict) or not all(
                isinstance(ex.get(w), dict) and grouped_matmul.is_kernel_form(ex[w])
                and set(ex[w]) == {"i4", "scale_t"} for w in _EXPERT_LINEARS):
            return run
        leaves = jax.tree.leaves(ex)
        traced = any(isinstance(a, jax.core.Tracer) for a in leaves)
        if not traced and not all(isinstance(a, jax.Array) and len(a.sharding.device_set) == 1
                                  and _has_host_memory(a) for a in leaves):
            return run
        units, layers = ex["w1"]["i4"].shape[:2]
        n = units * layers
        if traced:
            self.parts.append({w: {k: v.reshape(n, *v.shape[2:]) for k, v in ex[w].items()}
                               for w in _EXPERT_LINEARS})
            self.traced = True
        else:
            # a layer at a time, each copy finished before the next: the device holds one
            # layer's experts more at most
            for u in range(units):
                for j in range(layers):
                    part = jax.tree.map(lambda v: _to_host_memory(v[u, j:j + 1]),
                                        {w: ex[w] for w in _EXPERT_LINEARS})
                    self.parts.append(jax.block_until_ready(part))
            if donate:
                _release(ex, set())
        at = np.arange(self.count, self.count + n, dtype=np.int32).reshape(units, layers)
        self.count += n
        return {**run, "ffn": {**ffn, "experts": {"pool_at": jnp.asarray(at)}}}

    def stack(self) -> dict:
        """The pool: one device array per leaf, ``[layers, E, ...]``."""
        if self.traced:
            return jax.tree.map(lambda *a: jnp.concatenate(a), *self.parts)
        first = self.parts[0]
        device = next(iter(jax.tree.leaves(first)[0].sharding.device_set))
        pool = _pool_zeros(jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            (self.count, *a.shape[1:]), a.dtype), first), device)
        on_device = jax.sharding.SingleDeviceSharding(device,
                                                      memory_kind=device.default_memory().kind)
        base = 0
        for i, part in enumerate(self.parts):
            n = jax.tree.leaves(part)[0].shape[0]
            pool = jax.block_until_ready(
                _pool_write(pool, jax.device_put(part, on_device), np.int32(base)))
            self.parts[i] = None
            base += n
        return pool


def _has_host_memory(a: jax.Array) -> bool:
    """Whether ``a``'s device has pinned host memory (:func:`sharding.host_memory_kind`)."""
    try:
        sharding.host_memory_kind(next(iter(a.sharding.device_set)))
    except ValueError:
        return False
    return True


def _to_host_memory(a: jax.Array) -> jax.Array:
    """``a`` in its device's pinned host memory."""
    return jax.device_put(a, a.sharding.with_memory_kind(sharding.HOST_MEMORY_KIND))


def _pool_zeros(shapes, device):
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                   out_shardings=jax.sharding.SingleDeviceSharding(
                       device, memory_kind=device.default_memory().kind))()


@functools.partial(jax.jit, donate_argnums=0)
def _pool_write(pool, part, base):
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, base, 0),
                        pool, part)


def _pooled(p: dict, pool: dict | None) -> dict:
    """A layer's parameters with ``{"pool_at": index}`` experts (:class:`_ExpertPool`) replaced
    by the pool handed on whole with the index (``"at"``), as a run's own stack would be."""
    ffn = p.get("ffn")
    ex = ffn.get("experts") if isinstance(ffn, dict) else None
    if not isinstance(ex, dict) or "pool_at" not in ex:
        return p
    if pool is None:
        raise ValueError("the layer's routed experts are pooled (prepare_params) but the "
                         f"parameters have no {POOLED_EXPERTS!r}")
    return {**p, "ffn": {**ffn, "experts": {w: {**pool[w], "at": ex["pool_at"]}
                                            for w in _EXPERT_LINEARS}}}


def _release(tree, keep: set[int]):
    """Delete the device arrays of ``tree`` whose ``id`` is not in ``keep`` (a computation
    already queued on one still completes; tracers and host arrays are left alone)."""
    for a in jax.tree.leaves(tree):
        if (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
                and id(a) not in keep and not a.is_deleted()):
            a.delete()


def _stack_layers(arrays, shape):
    """One leaf of a layer group: the layers' ``arrays`` stacked into leading axes ``shape``.
    Arrays in host memory (Engram tables loaded with ``engram="host"``) are stacked on the
    host (``compute_on("device_host")``), the result in host memory: the tables never pass
    through the device's memory (the host holds them twice while stacking)."""
    if not all(checkpoint.in_host_memory(a) for a in arrays):
        return _stacked(tuple(shape), *arrays)
    host = jax.memory.Space.Host
    stack = functools.partial(_stacked.__wrapped__, tuple(shape))
    return jax.jit(lambda *a: compute_on(compute_type="device_host",
                                         out_memory_spaces=host)(stack)(*a))(*arrays)


@functools.partial(jax.jit, static_argnums=0)
def _stacked(shape: tuple[int, ...], *arrays):
    """``arrays`` stacked into leading axes ``shape``, one program (run op by op, the reshape
    would copy the stack once more)."""
    return jnp.stack(arrays).reshape(*shape, *arrays[0].shape)


def layer_params(prepared, cfg: ModelConfig, layer: int) -> dict:
    """One layer's parameters out of :func:`prepare_params`' stacked groups (pooled routed
    experts as the pool with the layer's index, ``{"w1": {"i4": ..., "scale_t": ..., "at":
    index}, ...}``, the form the MoE reads in place)."""
    for g, runs in zip(LayerPlan.from_config(cfg).groups, prepared["layer_groups"]):
        for u, unit in enumerate(g.units):
            if layer in unit:
                j = unit.index(layer)
                r = max(k for k, (start, _) in enumerate(g.runs) if start <= j)
                p = jax.tree.map(lambda a: a[u, j - g.runs[r][0]], runs[r])
                return _pooled(p, prepared.get(POOLED_EXPERTS))
    raise ValueError(f"layer {layer} is outside the model's {cfg.n_layers} layers")


# ----------------------------------------------------------------------------- blocks


def block(p: dict, X, pre_mix, role, cfg: ModelConfig, ch: Chunk, ls: st.LayerState, bus: Bus,
          *, engram_ids=None, token_mask=None, image_mask=None, skip_kv_update=False,
          record=None, layer_id=None):
    """One backbone block with single-pass mHC wiring; Engram first if present
    (docs/architecture.md, "mHC: hyper-connections" and "Engram update").

    ``X`` bf16 [B, S, C, D]; ``pre_mix`` fp32 [B, S, C] from the previous block's FFN head;
    ``ls`` the layer's slices of the state; ``layer_id`` (int32, possibly traced: the layer's
    id inside a scanned group) where the block may be a DSpark target layer, whose input's
    stream mean then goes into ``bus.features``. Returns ``(X, f_pre, ls, bus)``.
    """
    if role.engram:
        X = engram_layer.engram_forward(p["engram"], X, engram_ids, token_mask, cfg)
        if record is not None:
            record["engram_out"] = X
    if layer_id is not None and bus.features is not None:
        bus = dspark.capture_features(bus, X, layer_id, cfg.dspark_target_layer_ids)

    def attn_fn(xa):
        y, ls2, bus2 = attention(p["attn"], xa, role, cfg, ch, ls, bus,
                                 skip_kv_update=skip_kv_update, record=record)
        return y, (ls2, bus2)

    def ffn_fn(xf):
        B, S, D = xf.shape
        im = None if image_mask is None else image_mask.reshape(B * S)
        y2, eidx, ew = moe(xf.reshape(B * S, D), p["ffn"], cfg, im, impl=ch.moe_impl,
                           mesh=ch.mesh)
        return y2.reshape(B, S, D), (eidx, ew)

    X, f_pre, (y, (ls, bus)), (y2, (eidx, ew)) = mhc.block_wiring(
        p, X, pre_mix, attn_fn, ffn_fn, hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    if record is not None:
        record.update(attn_out=y, ffn_out=y2, block_out=X, block_pre_mix=f_pre,
                      moe_topk_idx=eidx, moe_topk_weight=ew)
    return X, f_pre, ls, bus


def _stack(trees, shape):
    """Stack a flat list of equal pytrees into leading axes ``shape``."""
    return jax.tree.map(lambda *a: jnp.stack(a).reshape(*shape, *a[0].shape), *trees)


def _in_host_memory(tree) -> bool:
    """Whether ``tree`` is a dict of arrays (no sub-dicts) all in host memory: an Engram table
    placed with ``shard_params(..., engram="host")`` (inside a step its avals say so)."""
    return (isinstance(tree, dict) and bool(tree) and all(
        hasattr(a, "shape") and getattr(jax.typeof(a), "memory_space", None)
        == jax.memory.Space.Host for a in tree.values()))


#: Whether a decode step runs each unit's Reuse layers unrolled instead of as an inner
#: ``lax.scan`` (the same computation): no loop-counter kernels, and the layers' small
#: parameters become static slices that XLA reads inside the kernels using them (``mid`` on
#: an H200, counted by ``tools/gpu_launches.py``: 2,517 -> 2,379 launches per step) for
#: some 10 s more of the first call's compile. ``"gpu"`` (on an NVIDIA GPU), ``"always"`` or
#: ``"never"``; prefill chunks keep the loop either way.
UNROLL_DECODE_RUNS = "gpu"
#: Whether a decode step runs the units of a scanned group unrolled too ("gpu", "always" or
#: "never"): the groups that own their KV sources (:data:`UNROLL_ALL_UNITS`: every group),
#: whose sources a scan stacks and slices back, a copy of each per step. Off: timed on an H100
#: (``mid`` decode after 4K, batch 1; docs/benchmarks.md, "Switches timed"), every group
#: unrolled cut the device time (6.91 -> 6.69 ms, 1,851 -> 1,732 launches) but not the step:
#: 6.60 -> 8.62 ms queued, the host launching the unrolled program slower than the GPU runs
#: it, and its first call 14 s longer to compile.
UNROLL_DECODE_UNITS = "never"
UNROLL_ALL_UNITS = False


def _decode_unrolled(ch: Chunk, name: str, setting: str) -> bool:
    if setting not in ("gpu", "always", "never"):
        raise ValueError(f"{name} must be 'gpu', 'always' or 'never', got {setting!r}")
    return ch.decode and (setting == "always" or setting == "gpu" and on_gpu())


def _unrolled_runs(ch: Chunk) -> bool:
    """Whether this chunk's inner scans are unrolled (:data:`UNROLL_DECODE_RUNS`)."""
    return _decode_unrolled(ch, "UNROLL_DECODE_RUNS", UNROLL_DECODE_RUNS)


def _unrolled_units(ch: Chunk, owns: bool) -> bool:
    """Whether this chunk's scan over a group's units is unrolled (:data:`UNROLL_DECODE_UNITS`;
    ``owns``: the group owns its KV sources)."""
    return ((owns or UNROLL_ALL_UNITS)
            and _decode_unrolled(ch, "UNROLL_DECODE_UNITS", UNROLL_DECODE_UNITS))


def _scan(body, carry, xs, length: int, unrolled: bool):
    """``lax.scan`` of ``body(carry, x, i)`` over ``xs`` (leading axis ``length``) and the
    index ``i`` (int32), or, ``unrolled``, a Python loop whose ``i`` is a Python int: static
    slices and constant layer indices, no index kernels between the layers. The outputs are
    stacked along a leading axis either way."""
    if not unrolled:
        return jax.lax.scan(lambda c, x: body(c, x[0], x[1]), carry,
                            (xs, jnp.arange(length, dtype=jnp.int32)))
    ys = []
    for i in range(length):
        carry, y = body(carry, jax.tree.map(lambda a, i=i: a[i], xs), i)
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def _pin_stacked(tree):
    """``(scanned, pinned)``: a stacked parameter tree split into what a scan slices per layer
    (the stored-form or bf16 routed experts of the dense and gathered MoE) and what stays
    whole, everything else: the body takes its layer's slice by index (:func:`_unpin`), so
    XLA reads a small parameter inside the kernel that uses it (a scan's sliced input is a
    copy per layer and loop), a decode step's GEMV and the grouped matmul read the FP8
    linears (``{"fp8": ...}``) and the kernel-form experts (``{"i4": ...}``) in place, and
    the Engram tables in host memory are never sliced on the device (the rows a step reads
    are gathered on the host: :func:`dsv41_jax.layers.engram.gather_rows`)."""
    if isinstance(tree, dict):
        if "fp8" in tree or grouped_matmul.is_kernel_form(tree) or _in_host_memory(tree):
            return None, tree
        pairs = {k: (v, None) if k == "experts" and "w1" in v
                 and not grouped_matmul.is_kernel_form(v["w1"])
                 else _pin_stacked(v) for k, v in tree.items()}
        return {k: a for k, (a, _) in pairs.items()}, {k: b for k, (_, b) in pairs.items()}
    return None, tree


def _unpin(scanned, pinned, at):
    """This layer's parameters: ``scanned`` (sliced by the scan) with the pinned ones put
    back: an array as its layer's slice of the stack, the FP8 linears, kernel-form experts,
    host tables and an attention's ``kv_norm`` as their whole stacks with ``at`` (int32: the
    layer's index in the flattened stack ``[units * layers, ...]``), and a block's mHC heads
    and sublayer norms
    (:data:`MHC_STACKED`, ``attn_norm``, ``ffn_norm``) as flattened stacks with that index as
    ``hc_at`` (:func:`dsv41_jax.layers.mhc.block_wiring`)."""
    if pinned is None:
        return scanned
    at = jnp.asarray(at, jnp.int32)     # an unrolled loop's Python int: a constant
    if not isinstance(pinned, dict):
        return jax.lax.dynamic_index_in_dim(_flat_stack(pinned), at, keepdims=False)
    if "fp8" in pinned or grouped_matmul.is_kernel_form(pinned) or _in_host_memory(pinned):
        return {**pinned, "at": at}
    # a block's mHC heads and sublayer norms as whole stacks with the layer's index: the glue
    # kernels read them in place (a slice would be a copy before each kernel)
    heads = (all(k in pinned for k in MHC_STACKED)
             and all("weight" in pinned.get(n, {}) for n in ("attn_norm", "ffn_norm")))
    out = {k: _unpin(None if scanned is None else scanned.get(k), pinned[k], at)
           for k in pinned if not (heads and k in MHC_STACKED)}
    if "kv_norm" in pinned and "wkv" in pinned:
        # an attention's window KV norm as its whole stack with the index: a decode step's
        # ring kernel reads it in place (layers.attention.layer_weight slices it elsewhere)
        out["kv_norm"] = {**out["kv_norm"], "weight": _flat_stack(pinned["kv_norm"]["weight"]),
                          "at": at}
    if heads:
        out.update({k: _flat_stack(pinned[k]) for k in MHC_STACKED}, hc_at=at)
        for n in ("attn_norm", "ffn_norm"):
            out[n] = {**out[n], "weight": _flat_stack(pinned[n]["weight"])}
    return out


#: A layer's mHC head parameters, kept as stacks by :func:`_unpin` (with ``hc_at``).
MHC_STACKED = ("hc_attn_fn", "hc_attn_scale", "hc_attn_base", "hc_ffn_fn", "hc_ffn_scale",
               "hc_ffn_base")


def _flat_stack(a: jax.Array) -> jax.Array:
    """A pinned ``[units, layers, ...]`` stack as ``[units * layers, ...]`` (``_unpin``'s
    flattened index)."""
    return a.reshape(-1, *a.shape[2:])


def _unstack(tree, n):
    return [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(n)]


def _topk_width(cfg: ModelConfig, source: st.KVSource) -> int:
    return min(cfg.index_topk, source.main.shape[1])


def _run_group(g: LayerGroup, runs_p, plan: LayerPlan, cfg: ModelConfig, X, pre_mix, ch: Chunk,
               state: st.InferenceState, bus: Bus, extras: dict, collect: bool,
               skip_kv_layer: int, pool: dict | None = None):
    """One :class:`LayerGroup`: a ``lax.scan`` over its units (parameters and state slices
    stacked along the units), each unit's runs of Reuse layers an inner ``lax.scan``
    (docs/architecture.md, "Scanned layer groups"). Returns ``(X, pre_mix, state, bus,
    records)`` with ``records`` ``{layer: dict}`` (empty unless ``collect``)."""
    U = len(g.units)
    head_role = plan[g.head]
    owns = head_role.owns_kv
    roles = [plan[g.units[0][start]] for start, _ in g.runs]
    # the KV source every layer of the unit reads: the head's own, or one before the group
    ext_src = None
    if head_role.ratio > 0 and not owns:
        ext_src = state.sources[head_role.kv_layer]
    stale = (None, None)
    if owns and head_role.ratio > 1:
        r1 = [i for i, s in state.sources.items() if s.tail is None]
        if r1:
            stale = (state.sources[r1[0]].index, state.sources[r1[0]].index_scale)
    unrolled_units = U == 1 or _unrolled_units(ch, owns)
    own_srcs = [state.sources[u[0]] for u in g.units] if owns else None
    skip = g.head == skip_kv_layer
    if head_role.owns_index:
        width = _topk_width(cfg, ext_src if ext_src is not None else state.sources[g.head])
        bus = dataclasses.replace(bus, topk=jnp.full((*ch.valid.shape, width), -1, jnp.int32))

    # DSpark target layers inside this group: their ids are traced in the scans
    capture = (bus.features is not None
               and any(L in cfg.dspark_target_layer_ids for u in g.units for L in u))
    unit_ids = jnp.asarray(np.array(g.units, np.int32))

    def layer(p, X, pre_mix, role, ls, bus, layer_id):
        rec = {} if collect else None
        p = _pooled(p, pool)
        X, pre_mix, ls, bus = block(
            p, X, pre_mix, role, cfg, ch, ls, bus,
            engram_ids=extras["engram_ids"].get(role.layer) if role.engram else None,
            token_mask=extras["token_mask"], image_mask=extras["image_mask"],
            skip_kv_update=skip and role.owns_kv, record=rec,
            layer_id=layer_id if capture else None)
        return X, pre_mix, ls, bus, rec

    scanned_p, pinned_p = zip(*[_pin_stacked(rp) for rp in runs_p])

    # every layer's window ring ([B, n_layers, W, ...]): carried through the scans and updated
    # in place at the layer's index (docs/architecture.md, "Scanned layer groups")
    rings = state.windows
    # unit u's layer k is g.head + u * per_unit + k (a group's units are consecutive layers of
    # one length): an index computed, not gathered from unit_ids, so no kernel of its own
    per_unit = len(g.units[0])
    assert g.units[-1][-1] == g.head + U * per_unit - 1, g.units

    def layer_index(u, k):
        return g.head + u * per_unit + k

    def unit(carry, xs, u):
        X, pre_mix, bus, rings = carry
        p_runs, src = xs
        src = ext_src if src is None else src
        recs = []
        for r, ((start, length), role) in enumerate(zip(g.runs, roles)):
            if length == 1:
                ls = st.LayerState(window=rings, window_layer=layer_index(u, start),
                                   source=src, stale_index=stale[0],
                                   stale_index_scale=stale[1])
                p = _unpin(jax.tree.map(lambda a: a[0], p_runs[r]), pinned_p[r], u)
                X, pre_mix, ls, bus, rec = layer(p, X, pre_mix, role, ls, bus,
                                                 unit_ids[u, start])
                if role.owns_kv:
                    src = ls.source
                rings = ls.window
                recs.append(jax.tree.map(lambda a: a[None], rec))
            else:
                def inner(c, p, j, role=role, src=src, r=r, length=length, start=start):
                    X, pre_mix, bus, rings = c
                    ls = st.LayerState(window=rings, window_layer=layer_index(u, start + j),
                                       source=src)
                    p = _unpin(p, pinned_p[r], u * length + j)
                    X, pre_mix, ls, bus, rec = layer(p, X, pre_mix, role, ls, bus,
                                                     unit_ids[u, start + j])
                    return (X, pre_mix, bus, ls.window), rec
                (X, pre_mix, bus, rings), rec = _scan(
                    inner, (X, pre_mix, bus, rings), p_runs[r], length, _unrolled_runs(ch))
                recs.append(rec)
        return (X, pre_mix, bus, rings), (src if owns else None, recs)

    carry = (X, pre_mix, bus, rings)
    if unrolled_units:
        # each unit reads and returns its own source (no stacking)
        outs = []
        for u in range(U):
            carry, out = unit(carry, (jax.tree.map(lambda a, u=u: a[u], tuple(scanned_p)),
                                      own_srcs[u] if owns else None), u)
            outs.append(out)
        new_srcs = [o[0] for o in outs]
        recs = jax.tree.map(lambda *a: jnp.stack(a), *[o[1] for o in outs])
    else:
        # a scan takes the sources stacked: a copy in and out of each
        own_src = _stack(own_srcs, (U,)) if owns else None
        carry, (new_src, recs) = _scan(unit, carry, (tuple(scanned_p), own_src), U, False)
        new_srcs = [jax.tree.map(lambda a, u=u: a[u], new_src) for u in range(U)] if owns else None
    X, pre_mix, bus, rings = carry
    records = {}
    for u, ids in enumerate(g.units):
        for r, (start, length) in enumerate(g.runs):
            for j in range(length):
                if collect:
                    records[ids[start + j]] = jax.tree.map(lambda a: a[u, j], recs[r])
    sources = dict(state.sources)
    if owns:
        for u, ids in enumerate(g.units):
            sources[ids[0]] = new_srcs[u]
    state = state.replace(windows=rings, sources=sources)
    return X, pre_mix, state, bus, records


def _run_blocks(params, cfg, plan, groups, X, pre_mix, ch, state, bus, extras, records,
                skip_kv_layer=-1):
    for gi in groups:
        g = plan.groups[gi]
        X, pre_mix, state, bus, rec = _run_group(g, params["layer_groups"][gi], plan, cfg, X,
                                                 pre_mix, ch, state, bus, extras,
                                                 records is not None, skip_kv_layer,
                                                 params.get(POOLED_EXPERTS))
        if records is not None:
            records.update(rec)
    return X, pre_mix, state, bus


def head_logits(params, cfg: ModelConfig, X, pre_mix) -> tuple[jax.Array, jax.Array]:
    """``(final_hidden bf16 [..., D], logits fp32 [..., V])``: collapse, norm, fp32 head (a
    head kept in bf16 by :func:`prepare_params` multiplies the bf16 hidden state directly:
    the products are exact either way, accumulated in fp32)."""
    h = rms_norm(mhc.hc_pre(X, pre_mix), params["norm"]["weight"], cfg.norm_eps)
    return h, lm_head(h, params["head"]["weight"])


def _logits_at(params, cfg, X, pre_mix, last):
    """fp32 logits [B, V] of position ``last[b]`` of each row."""
    X_last = jnp.take_along_axis(X, last[:, None, None, None], axis=1)[:, 0]
    pm_last = jnp.take_along_axis(pre_mix, last[:, None, None], axis=1)[:, 0]
    return head_logits(params, cfg, X_last, pm_last)[1]


def kernel_impls(cfg: ModelConfig, attn_impl: str, *, backend: str | None = None
                 ) -> tuple[str, str, str]:
    """``(sparse attention, indexer scores, indexer top-k)`` kernel families for the model's
    family ``attn_impl`` (:data:`pallas_kernels.impls.FAMILIES`) on ``backend`` (default:
    JAX's): the attention by its shapes (:func:`pallas_kernels.sparse_attention.resolve_impl`),
    the indexer's two from the family itself (:func:`pallas_kernels.indexer.impl_for_family`,
    :func:`~pallas_kernels.indexer.select_impl_for_family`). Raises ``ValueError`` for an
    unknown family or an old name."""
    check_family(attn_impl, "attn_impl")
    return (resolve_impl(attn_impl, backend, heads=cfg.n_heads, head_dim=cfg.head_dim),
            impl_for_family(attn_impl, cfg.index_n_heads, cfg.index_head_dim, backend),
            select_impl_for_family(attn_impl, backend))


def _check_mesh(cfg: ModelConfig, mesh, batch: int | None):
    """``mesh`` (None stays None) after :func:`dsv41_jax.sharding.check_mesh` and
    :func:`~dsv41_jax.sharding.check_experts`; ``batch`` (when given) must divide by its
    ``data`` axis. Raises ``ValueError``."""
    if mesh is None:
        return None
    sharding.check_mesh(mesh)
    sharding.check_experts(cfg, mesh)
    if batch is not None:
        sharding.batch_spec(1, batch, mesh)
    return mesh


def _placed(params, cfg: ModelConfig, state, mesh):
    """``(params, state)`` prepared and, with a mesh, placed on it (arrays already in place
    stay)."""
    if mesh is None:
        return prepare_params(params, cfg), state
    return (sharding.shard_params(prepare_params(params, cfg), cfg, mesh),
            sharding.shard_state(state, mesh))


def _check_moe_impl(moe_impl: str) -> str:
    if moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
    return moe_impl


def make_chunk(cfg: ModelConfig, *, positions, valid, p0, n, win_lo, decode: bool, compat,
               attn_impl: str = "xla", win_width: int = 0, index_impl: str = "xla",
               select_impl: str = "xla", moe_impl: str = "auto", mesh=None,
               journal: bool = False) -> Chunk:
    """The :class:`~dsv41_jax.layers.attention.Chunk` of a forward, with the config's RoPE
    frequency tables."""
    freqs = {"base": rope_frequencies(cfg, "base"), "compress": rope_frequencies(cfg, "compress")}
    return Chunk(positions=positions, valid=valid, p0=p0, n=n, win_lo=win_lo,
                 compat_stale_index_k=compat, freqs=freqs, decode=decode, attn_impl=attn_impl,
                 win_width=win_width, index_impl=index_impl, select_impl=select_impl,
                 moe_impl=moe_impl, mesh=mesh, journal=journal)


def _engram_extras(params, cfg, tokens, positions, n, state, token_mask):
    extras = {"engram_ids": {}, "token_mask": token_mask}
    if not cfg.engram_layer_ids:
        return extras, state
    cids = params["engram_token_map"][tokens]
    if token_mask is not None:
        cids = jnp.where(token_mask, cids, engram_layer.DEAD)
    consts = params["engram_consts"]
    ids = engram_layer.engram_hash_ids(cids, state.engram_history, positions, consts)
    for k, layer in enumerate(cfg.engram_layer_ids):
        extras["engram_ids"][layer] = ids[:, :, k]
    hist = engram_layer.engram_update_history(state.engram_history, cids, n)
    return extras, state.replace(engram_history=hist)


def _embed(params, cfg, tokens, embeds_override, image_mask):
    h = params["embed"]["weight"][tokens]
    if embeds_override is not None:
        h = jnp.where(image_mask[..., None], embeds_override.astype(BF16), h)
    return jnp.repeat(h[:, :, None, :], cfg.hc_mult, axis=2)


def _dspark_bus(cfg: ModelConfig, bus: Bus, n, S: int) -> Bus:
    """``bus`` with room for the DSpark target features of the last ``min(S, W)`` valid rows
    of a chunk of ``S`` rows (``n`` valid)."""
    rows = dspark.feature_rows(n, S, cfg.window_size)
    T = len(cfg.dspark_target_layer_ids)
    return dataclasses.replace(
        bus, features=jnp.zeros((n.shape[0], rows.shape[1], T, cfg.dim), BF16),
        feature_rows=rows)


def _dspark_write(params, cfg: ModelConfig, state: st.InferenceState, bus: Bus, p0, n
                  ) -> st.InferenceState:
    """The captured target features (chunk rows ``bus.feature_rows`` of a chunk at ``p0``
    with ``n`` valid rows) and every stage's window-ring entries of those positions written
    into the DSpark state (docs/architecture.md, "DSpark draft head")."""
    B, R = bus.feature_rows.shape
    feats = bus.features.reshape(B, R, -1)
    entries = dspark.stage_ring_entries(params["dspark"], feats, p0[:, None] + bus.feature_rows,
                                        cfg)
    q0, cnt = p0 + jnp.maximum(n - R, 0), jnp.minimum(n, R)
    ds = state.dspark
    ds = ds.replace(features=st.write_ring_values(ds.features, feats, q0, cnt),
                    windows=tuple(st.write_ring(r, c, sc, q0, cnt)
                                  for r, (c, sc) in zip(ds.windows, entries)))
    return state.replace(dspark=ds)


def _chunk_impl(params, tokens, n, state, embeds_override, image_mask, compat, *,
                static: Static,
                mode: str, replay_len: int, all_logits: bool, journal: bool = False):
    """One prefill chunk or decode step (S = 1). See :func:`prefill`. ``journal``: the
    compressor tails also carry the tail after every count of the chunk (:func:`verify`)."""
    cfg = static.cfg
    plan = LayerPlan.from_config(cfg)
    B, S = tokens.shape
    W = cfg.window_size
    p0 = state.pos
    ar = jnp.arange(S, dtype=jnp.int32)
    positions = p0[:, None] + ar[None, :]
    valid = ar[None, :] < n[:, None]
    decode = S == 1
    token_mask = None if image_mask is None else ~image_mask
    extras, state = _engram_extras(params, cfg, tokens, positions, n, state, token_mask)
    extras["image_mask"] = image_mask
    kinds = dict(attn_impl=static.attn_impl, index_impl=static.index_impl,
                 select_impl=static.select_impl, moe_impl=static.moe_impl, mesh=static.mesh)
    # replay_len is min(W, S) on a fresh prefill, else W: the reference's window-list width
    ch = make_chunk(cfg, positions=positions, valid=valid, p0=p0, n=n,
                    win_lo=jnp.zeros_like(p0), decode=decode, compat=compat,
                    win_width=0 if decode else replay_len, journal=journal, **kinds)
    records = {} if static.collect else None
    X = _embed(params, cfg, tokens, embeds_override, image_mask)
    pre_mix = mhc.identity_pre_mix((B, S), cfg.hc_mult)
    bus = Bus(topk=jnp.full((B, S, 1), -1, jnp.int32))
    dec = plan.decoder_start
    has_decoder = dec < cfg.n_layers
    enc_groups = [k for k, g in enumerate(plan.groups) if g.head < dec]
    dec_groups = [k for k, g in enumerate(plan.groups) if g.head >= dec]

    # DSpark target features (docs/architecture.md, "DSpark draft head"): captured on the
    # bus of the chunk that runs the target layers (the bounded replay in CED prefill)
    targets = cfg.dspark_target_layer_ids if state.dspark is not None else ()
    if targets and "dspark" not in params:
        raise ValueError("the state has DSpark state (the config has DSpark on) but params "
                         "carry no DSpark head: load a checkpoint that ships mtp.*")
    replay = has_decoder and mode == "ced" and not decode
    in_replay = replay and bool(targets) and all(t >= dec for t in targets)
    if replay and not in_replay and any(t >= dec for t in targets):
        raise ValueError(f"dspark_target_layer_ids {targets} lie on both sides of the CED "
                         f"split (decoder from layer {dec})")
    if targets and not in_replay:
        bus = _dspark_bus(cfg, bus, n, S)
    X, pre_mix, state, bus = _run_blocks(params, cfg, plan, enc_groups, X, pre_mix, ch, state,
                                         bus, extras, records)
    if has_decoder:
        ring = state.enc_ring
        enc_all_x = jnp.concatenate([ring.x, X], axis=1)           # [B, W+S, C, D]
        enc_all_pm = jnp.concatenate([ring.pre_mix, pre_mix], axis=1)
        state = state.replace(enc_ring=st.EncoderRing(
            x=st.write_ring_values(ring.x, X, p0, n),
            pre_mix=st.write_ring_values(ring.pre_mix, pre_mix, p0, n)))

    out = {}
    if replay:
        # Decoder global KV for every position, from the encoder output
        # (docs/architecture.md, "CED prefill and bounded replay").
        role = plan[dec]
        lp = layer_params(params, cfg, dec)
        x_dec = rms_norm(mhc.hc_pre(X, pre_mix), lp["attn_norm"]["weight"], cfg.norm_eps)
        sources = dict(state.sources)
        sources[role.kv_layer] = kv_source_update(lp["attn"], x_dec, role, cfg, ch,
                                                  sources[role.kv_layer])
        state = state.replace(sources=sources)
        # Bounded replay: the decoder over the last min(N, W) positions only.
        N = p0 + n
        R = jnp.where(n > 0, jnp.minimum(N, replay_len), 0)
        start = N - R
        ar_r = jnp.arange(replay_len, dtype=jnp.int32)
        rpos = start[:, None] + ar_r[None, :]
        rvalid = ar_r[None, :] < R[:, None]
        src = jnp.where(rpos >= p0[:, None], W + rpos - p0[:, None], jnp.mod(rpos, W))
        src = jnp.clip(src, 0, W + S - 1)
        Xr = jnp.take_along_axis(enc_all_x, src[:, :, None, None], axis=1)
        pmr = jnp.take_along_axis(enc_all_pm, src[:, :, None], axis=1)
        ch_r = make_chunk(cfg, positions=rpos, valid=rvalid, p0=start, n=R, win_lo=start,
                          decode=False, compat=compat, win_width=replay_len, **kinds)
        extras_r = dict(extras, engram_ids={}, token_mask=None,
                        image_mask=None if image_mask is None else jnp.take_along_axis(
                            jnp.concatenate([jnp.zeros((B, W), bool), image_mask], 1),
                            jnp.where(rpos >= p0[:, None], W + rpos - p0[:, None], 0), axis=1))
        bus_r = Bus(topk=jnp.full((B, replay_len, 1), -1, jnp.int32))
        if in_replay:
            bus_r = _dspark_bus(cfg, bus_r, R, replay_len)
        Xr, pmr, state, bus_r = _run_blocks(params, cfg, plan, dec_groups, Xr, pmr, ch_r, state,
                                            bus_r, extras_r, records, skip_kv_layer=dec)
        if in_replay:
            state = _dspark_write(params, cfg, state, bus_r, start, R)
        out["logits"] = _logits_at(params, cfg, Xr, pmr, jnp.clip(R - 1, 0, replay_len - 1))
        if all_logits:
            out["replay_logits"] = head_logits(params, cfg, Xr, pmr)[1]
    else:
        X, pre_mix, state, bus = _run_blocks(params, cfg, plan, dec_groups, X, pre_mix, ch,
                                             state, bus, extras, records)
        out["logits"] = _logits_at(params, cfg, X, pre_mix, jnp.clip(n - 1, 0, S - 1))
        if all_logits:
            hid, lg = head_logits(params, cfg, X, pre_mix)
            out["all_logits"], out["final_hidden"] = lg, hid
    if targets and not in_replay:
        state = _dspark_write(params, cfg, state, bus, p0, n)
    state = state.replace(pos=p0 + n)
    return StepOutput(records=records, **out), state


def _chunk_rows(params, tokens, n, state, embeds_override, image_mask, compat, *,
                static: Static,
                mode: str, replay_len: int, all_logits: bool):
    """:func:`_chunk_impl`, either on the whole batch or (``static.batch_invariant``) one row
    at a time with ``lax.map``, so that every row runs the very computation of a batch of one:
    results are then bitwise independent of the batch size (XLA's CPU GEMMs otherwise re-block
    their sums with the number of rows)."""
    kw = dict(static=static, mode=mode, replay_len=replay_len, all_logits=all_logits)
    if not static.batch_invariant or tokens.shape[0] == 1:
        out, state = _chunk_impl(params, tokens, n, state, embeds_override, image_mask, compat,
                                 **kw)
        return out, sharding.constrain_state(state, static.mesh)

    def one(row):
        tok, nn, s, emb, im = row
        add = lambda x: None if x is None else x[None]  # noqa: E731
        out, s = _chunk_impl(params, tok[None], nn[None], jax.tree.map(add, s), add(emb),
                             add(im), compat, **kw)
        return jax.tree.map(lambda x: x[0], (out, s))

    out, state = jax.lax.map(one, (tokens, n, state, embeds_override, image_mask))
    return out, sharding.constrain_state(state, static.mesh)


_chunk_jit = saved_steps.SavedJit(_chunk_rows,
                                  static_argnames=("static", "mode", "replay_len", "all_logits"),
                                  donate_argnames=("state",))


# ----------------------------------------------------------------------------- validation


def _check_tokens(cfg: ModelConfig, tokens: np.ndarray, name: str = "tokens"):
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)][0]
        raise ValueError(f"{name}: token id {int(bad)} is outside [0, vocab_size="
                         f"{cfg.vocab_size})")


def _check_image_inputs(cfg: ModelConfig, shape: tuple[int, int], embeds_override, image_mask):
    """Host-side checks of the image-span inputs before anything is traced: ``image_mask`` a
    bool [B, S] array and ``embeds_override`` a bf16 [B, S, dim] array (``shape`` = (B, S) of
    the tokens), given together or not at all. Raises ``ValueError`` naming the argument."""
    if (embeds_override is None) != (image_mask is None):
        given, missing = (("embeds_override", "image_mask") if image_mask is None
                          else ("image_mask", "embeds_override"))
        raise ValueError(f"{given} was given without {missing}: image spans need both (the "
                         f"mask selects the positions whose embeddings are replaced)")
    if image_mask is None:
        return
    B, S = shape
    def dtype(x):
        return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype

    m_shape, m_dtype = tuple(np.shape(image_mask)), dtype(image_mask)
    if m_dtype != np.bool_:
        raise ValueError(f"image_mask must be a bool array [B, S] (True on image-span "
                         f"positions), got dtype {m_dtype}; convert a 0/1 mask with mask != 0")
    if m_shape != (B, S):
        raise ValueError(f"image_mask must have shape [B, S] = {[B, S]} like tokens, got "
                         f"{list(m_shape)}")
    e_shape = tuple(np.shape(embeds_override))
    e_dtype = dtype(embeds_override)
    if e_shape != (B, S, cfg.dim):
        raise ValueError(f"embeds_override must have shape [B, S, dim] = {[B, S, cfg.dim]}, got "
                         f"{list(e_shape)}")
    if e_dtype != jnp.bfloat16:
        raise ValueError(f"embeds_override must be bfloat16 (the embedding dtype), got "
                         f"{e_dtype}; cast it with .astype(jnp.bfloat16)")


def host_positions(state: st.InferenceState) -> np.ndarray:
    """``state.pos`` as a host array, without a device-to-host read when the state came from
    :func:`prefill`, :func:`decode_step` or :func:`dsv41_jax.generation.generate` (they attach
    the positions they know on the host to the state object they return, outside the pytree)."""
    known = getattr(state, "_host_pos", None)
    return known if known is not None else np.asarray(state.pos)


def _with_host_positions(state: st.InferenceState, pos: np.ndarray) -> st.InferenceState:
    object.__setattr__(state, "_host_pos", np.asarray(pos, np.int32))
    return state


def _check_capacity(cfg, state, new: np.ndarray):
    pos = host_positions(state)
    cap = st.capacity_of(state, cfg)
    over = pos + new
    if (over > cap).any():
        b = int(np.argmax(over > cap))
        raise ValueError(f"row {b}: {int(pos[b])} tokens in the state + {int(new[b])} new "
                         f"exceeds the state capacity of {cap} tokens")


# ----------------------------------------------------------------------------- public API


def prefill(params, cfg: ModelConfig, tokens, state, lengths=None, *, mode: str = "ced",
            compat_stale_index_k: bool = False, embeds_override=None, image_mask=None,
            collect: bool = False, all_logits: bool = False, batch_invariant: bool = False,
            attn_impl: str = "auto", moe_impl: str = "auto", mesh=None):
    """Prefill a chunk of tokens per row, continuing from ``state``.

    Args:
      tokens: int [B, S] (right-padded); ``lengths`` int [B] valid tokens per row (default S).
      state: from :func:`dsv41_jax.state.init_state` or a previous call (it is donated).
      mode: ``"ced"`` (bounded replay of the decoder) or ``"exact"`` (all layers, all positions).
      compat_stale_index_k: reproduce the reference's decode ``index_k`` quirk
        (docs/architecture.md, "Stale indexer K in decode (compatibility switch)").
      embeds_override, image_mask: bf16 [B, S, dim] rows replacing the token embeddings where
        the bool [B, S] ``image_mask`` is set (docs/architecture.md, "Image spans"); both or
        neither.
      batch_invariant: run the rows one at a time (``lax.map``) so each row's result is
        bitwise that of a batch of one (slower for large batches).
      attn_impl: kernel family (:data:`pallas_kernels.impls.FAMILIES`) for the sparse
        attention and the FP4 state writes: ``"auto"`` picks the GPU kernels on a GPU (for
        the shapes they tile) and the XLA path otherwise (CPU, TPU); ``"xla"``, ``"gpu"``,
        ``"tpu"`` (and their ``*_interpret`` variants) force one. The indexer scores
        and top-k follow the family too (:func:`pallas_kernels.indexer.impl_for_family`,
        :func:`~pallas_kernels.indexer.select_impl_for_family`).
      moe_impl: how a call with at least as many (token, expert) pairs as experts runs the
        routed experts: ``"dense"`` (a scan over every expert, the reference's order bit for
        bit) or ``"routed"`` (grouped matmuls over the routed pairs only: the FP4 grouped
        matmul kernel for kernel-form experts on a GPU, ``lax.ragged_dot`` elsewhere;
        docs/architecture.md, "Mixture of experts"); ``"auto"`` (the default): ``"routed"``
        where the kernel runs, ``"dense"`` elsewhere (CPU, TPU). Smaller calls gather their
        experts either way.
      mesh: a device mesh (:func:`dsv41_jax.sharding.make_mesh`) to run on, or None (one
        device). The parameters and the state are placed on it by
        :func:`~dsv41_jax.sharding.shard_params` / :func:`~dsv41_jax.sharding.shard_state`
        when they are not already (place them once beforehand to avoid the per-call
        transfers), the tokens split by rows over ``data``; the routed experts run expert
        parallel (docs/architecture.md, "Sharding"). The returned state stays on the mesh.

    Returns ``(out, state)``: a :class:`StepOutput` (``out.logits`` fp32 [B, V] at each row's
    last token) and the new :class:`~dsv41_jax.state.InferenceState`.

    Raises:
      ValueError: empty prompt, token id outside [0, vocab), lengths not matching the batch or
        outside [1, S], state capacity exceeded, unknown mode, attn_impl or moe_impl,
        ``image_mask`` not
        bool [B, S], ``embeds_override`` not bf16 [B, S, dim], or only one of the two given.
        The state is then untouched.
    """
    if mode not in ("ced", "exact"):
        raise ValueError(f"mode must be 'ced' or 'exact', got {mode!r}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be a non-empty [B, S] array, got shape {tokens.shape}")
    B, S = tokens.shape
    if B != state.batch:
        raise ValueError(f"tokens has batch {B} but the state holds {state.batch} rows")
    lengths = np.full((B,), S, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if lengths.shape != (B,):
        raise ValueError(f"lengths must have shape [{B}] (one per row), got {lengths.shape}")
    if (lengths < 1).any() or (lengths > S).any():
        raise ValueError(f"lengths must be in [1, {S}] (an empty prompt is not allowed), got "
                         f"{lengths.tolist()}")
    _check_tokens(cfg, np.where(np.arange(S)[None] < lengths[:, None], tokens, 0))
    _check_image_inputs(cfg, (B, S), embeds_override, image_mask)
    _check_capacity(cfg, state, lengths)
    pos = host_positions(state)
    fresh = not pos.any()
    replay_len = min(cfg.window_size, S) if fresh else cfg.window_size
    static = Static(cfg, collect, batch_invariant, *kernel_impls(cfg, attn_impl),
                    moe_impl=_check_moe_impl(moe_impl), mesh=_check_mesh(cfg, mesh, B))
    params, state = _placed(params, cfg, state, mesh)
    tokens = jnp.asarray(np.where(np.arange(S)[None] < lengths[:, None], tokens, 0), jnp.int32)
    n = jnp.asarray(lengths)
    if mesh is not None:
        tokens, n = sharding.batch_sharded(tokens, mesh), sharding.batch_sharded(n, mesh)
        if image_mask is not None:
            image_mask = sharding.batch_sharded(jnp.asarray(image_mask), mesh)
            embeds_override = sharding.batch_sharded(jnp.asarray(embeds_override), mesh)
    out, state = _chunk_jit(params, tokens, n, state, embeds_override,
                            image_mask, jnp.asarray(compat_stale_index_k), static=static,
                            mode=mode, replay_len=replay_len, all_logits=all_logits)
    return out, sharding.mark_placed(_with_host_positions(state, pos + lengths), mesh)


def decode_step(params, cfg: ModelConfig, state, tokens, *, compat_stale_index_k: bool = False,
                collect: bool = False, batch_invariant: bool = False, attn_impl: str = "auto",
                moe_impl: str = "auto", mesh=None):
    """One token per row through all layers.

    Args: ``tokens`` int [B]; ``attn_impl``, ``moe_impl``, ``mesh`` as in :func:`prefill`. Returns
    ``(logits fp32 [B, V], state)`` (the state is donated). Raises ``ValueError`` for a token
    outside [0, vocab), a batch mismatch, a full state or an unknown attn_impl.

    The checks read nothing back from the device when the tokens are host data and the state
    came from this module (:func:`host_positions`), so consecutive steps queue on the device;
    token ids given as device arrays are read back for their range check. A loop of steps that
    stays on the device: :func:`dsv41_jax.generation.generate`.
    """
    impls = kernel_impls(cfg, attn_impl)
    tokens = np.asarray(tokens).reshape(-1)
    B = state.batch
    if tokens.shape != (B,):
        raise ValueError(f"tokens must have shape [{B}] (one per row), got {tokens.shape}")
    _check_tokens(cfg, tokens)
    _check_capacity(cfg, state, np.ones((B,), np.int32))
    static = Static(cfg, collect, batch_invariant, *impls, moe_impl=_check_moe_impl(moe_impl),
                    mesh=_check_mesh(cfg, mesh, B))
    params, state = _placed(params, cfg, state, mesh)
    pos = host_positions(state)
    # the token ids and lengths stay host arrays: the compiled step places them (an explicit
    # device_put of each on the mesh cost a one-device mesh 0.3 ms of host time per step)
    out, state = _chunk_jit(params, tokens.astype(np.int32)[:, None], np.ones((B,), np.int32),
                            state, None, None, jnp.asarray(compat_stale_index_k),
                            static=static, mode="exact", replay_len=1, all_logits=False)
    state = sharding.mark_placed(_with_host_positions(state, pos + 1), mesh)
    if collect:
        return out, state
    return out.logits, state


def forward(params, cfg: ModelConfig, tokens, *, collect: bool = False,
            compat_stale_index_k: bool = False, embeds_override=None, image_mask=None,
            return_state: bool = False, attn_impl: str = "auto", moe_impl: str = "auto",
            mesh=None):
    """Every position through every layer (the reference's semantics; the oracle).

    Returns a :class:`StepOutput` with ``all_logits`` fp32 [B, S, V] and ``final_hidden``
    (and the exact-prefill state when ``return_state``). ``mesh`` as in :func:`prefill`.
    Raises ``ValueError`` as :func:`prefill`.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, S], got shape {tokens.shape}")
    _check_image_inputs(cfg, tokens.shape, embeds_override, image_mask)
    state = st.init_state(cfg, tokens.shape[0], max(tokens.shape[1], 2))
    params = prepare_params(params, cfg)
    out, state = prefill(params, cfg, tokens, state, mode="exact", collect=collect,
                         compat_stale_index_k=compat_stale_index_k,
                         embeds_override=embeds_override, image_mask=image_mask, all_logits=True,
                         attn_impl=attn_impl, moe_impl=moe_impl, mesh=mesh)
    return (out, state) if return_state else out


def decode_fn(cfg: ModelConfig, *, attn_impl: str = "auto", compat_stale_index_k: bool = False,
              backend: str | None = None, moe_impl: str = "auto", mesh=None,
              batch_invariant: bool = False):
    """A pure, traceable decode step ``step(params, state, tokens int32 [B]) -> (logits fp32
    [B, V], state)`` for use inside ``jax.jit`` / ``lax.while_loop`` (no host checks: the caller
    checks the state capacity and the token ids). ``batch_invariant``: as in :func:`prefill`.
    ``mesh``: as in :func:`prefill`, except that
    nothing is placed (place the parameters and the state with
    :func:`dsv41_jax.sharding.shard_params` / :func:`~dsv41_jax.sharding.shard_state`); the
    returned state is constrained to the state's shardings. Raises ``ValueError`` for an
    unknown ``attn_impl`` or ``moe_impl``, or a mesh not of
    :func:`~dsv41_jax.sharding.make_mesh`, or whose ``expert`` axis does not divide the routed
    experts."""
    static = Static(cfg, False, bool(batch_invariant),
                    *kernel_impls(cfg, attn_impl, backend=backend),
                    moe_impl=_check_moe_impl(moe_impl), mesh=_check_mesh(cfg, mesh, None))
    compat = jnp.asarray(compat_stale_index_k)

    def step(params, state, tokens):
        params = prepare_params(params, cfg)
        B = tokens.shape[0]
        out, state = _chunk_rows(params, tokens.astype(jnp.int32)[:, None],
                                 jnp.ones((B,), jnp.int32), state, None, None, compat,
                                 static=static, mode="exact", replay_len=1, all_logits=False)
        return out.logits, state

    return step


# ----------------------------------------------------------------------------- DSpark


def _draft_impl(params, state, t_next, key, *, cfg: ModelConfig, sampling, moe_impl: str,
                forced=None):
    pd = params["dspark"]
    Y, base = dspark.draft_block(pd, params["embed"]["weight"], params["head"]["weight"],
                                 state.dspark.windows, t_next, state.pos - 1, cfg, moe_impl)
    return dspark.markov_draft(pd, Y, base, t_next, sampling, key, forced)


_draft_jit = jax.jit(_draft_impl, static_argnames=("cfg", "sampling", "moe_impl"))


def draft_fn(cfg: ModelConfig, *, sampling=None, moe_impl: str = "auto"):
    """A pure, traceable DSpark draft ``draft(params, state, t_next int32 [B], key) -> (ids,
    logits, confidence)`` as :func:`draft` returns them, for loops that stay on the device (no
    host checks). On a mesh it takes no mesh argument: it runs on the placed parameters and
    state as the compiler partitions it, as :func:`draft` does. Raises ``ValueError`` for a
    config without DSpark or an unknown ``moe_impl``."""
    if not cfg.dspark_on:
        raise ValueError("the config has DSpark off (dspark_block_size 0 or no mtp stage)")
    sampling = sampling or SamplingParams()
    moe_impl = _check_moe_impl(moe_impl)

    def fn(params, state, t_next, key=None):
        return _draft_impl(prepare_params(params, cfg), state, t_next.astype(jnp.int32), key,
                           cfg=cfg, sampling=sampling, moe_impl=moe_impl)
    return fn


def draft(params, cfg: ModelConfig, state, t_next, *, sampling=None, key=None,
          forced=None, moe_impl: str = "auto"):
    """DSpark drafts after the positions the state holds (docs/architecture.md, "DSpark draft
    head"): the stages over ``[t_next, noise x (bs - 1)]`` at positions ``pos .. pos + bs - 1``
    (``bs = dspark_block_size``), every draft row attending to its stage's window ring and to
    all draft rows, then the Markov correction while sampling and the confidence head.

    Args:
      t_next: int [B], the token the main model produced at the last position (``pos - 1``).
      sampling: :class:`dsv41_jax.sampling.SamplingParams` of the draft tokens (default
        greedy); ``key`` a PRNG key when it is not greedy.
      forced: int [B, bs] (teacher forcing): the Markov embeddings read these tokens instead of
        the drafted ones (``forced[:, 0]`` is ``t_next``).

    Returns ``(ids int32 [B, bs + 1] = [t_next, drafts...], logits fp32 [B, bs, V] after the
    Markov bias, confidence fp32 [B, bs] raw logits)``. The state is read, not changed.

    On a mesh (docs/architecture.md, "Sharding"): there is no ``mesh`` argument; given the
    parameters and the state placed (:func:`dsv41_jax.sharding.shard_params` /
    :func:`~dsv41_jax.sharding.shard_state`, as :func:`verify` leaves them) the draft runs
    where they lie, as the compiler partitions it: the DSpark head's parameters are replicated
    by the table (``mtp.*`` match no rule), so its own MoE runs on every device (never split
    over ``expert``), the rows follow the state's split over ``data``.

    Raises ``ValueError`` for a config or state without DSpark, params without the DSpark
    head (``mtp.*``), ``t_next`` not [B] or outside the vocabulary, a state with no position
    yet, ``forced`` not [B, bs], or a missing key for non-greedy sampling.
    """
    if not cfg.dspark_on or state.dspark is None:
        raise ValueError("draft needs a config with DSpark on and a state that has its DSpark "
                         "state (init_state with that config)")
    if "dspark" not in params:
        raise ValueError("params carry no DSpark head: load a checkpoint that ships mtp.*")
    sampling = sampling or SamplingParams()
    if not sampling.greedy and key is None:
        raise ValueError("key: sampling drafts with temperature > 0 needs a PRNG key")
    B = state.batch
    t_next = np.asarray(t_next).reshape(-1)
    if t_next.shape != (B,):
        raise ValueError(f"t_next must have shape [{B}] (one per row), got {t_next.shape}")
    _check_tokens(cfg, t_next, "t_next")
    if (host_positions(state) < 1).any():
        raise ValueError("draft needs at least one position in every row (prefill first)")
    bs = cfg.dspark_block_size
    if forced is not None:
        forced = np.asarray(forced)
        if forced.shape != (B, bs):
            raise ValueError(f"forced must have shape [{B}, {bs}], got {forced.shape}")
        _check_tokens(cfg, forced, "forced")
        forced = jnp.asarray(forced, jnp.int32)
    return _draft_jit(prepare_params(params, cfg), state, jnp.asarray(t_next, jnp.int32), key,
                      cfg=cfg, sampling=sampling, moe_impl=_check_moe_impl(moe_impl),
                      forced=forced)


# ----------------------------------------------------------------------------- verify


def greedy_acceptance(logits, tokens):
    """Acceptance lengths of a verified block at temperature 0: ``1 +`` the number of leading
    drafts equal to the main model's greedy token at the position before (int32 [B] in
    ``1 .. S``; ``tokens`` int [B, S] = [last token, drafts...], ``logits`` fp32 [B, S, V])."""
    match = jnp.argmax(logits[:, :-1], axis=-1).astype(jnp.int32) == tokens[:, 1:]
    return 1 + jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _rollback(params, cfg: ModelConfig, old: st.InferenceState, new: st.InferenceState, tokens,
              a) -> st.InferenceState:
    """The state after the first ``a[b]`` of the chunk's ``S`` positions (``S <= W``): ``new``
    (all S written) with everything the later positions wrote put back from ``old``
    (docs/architecture.md, "Verify and rollback"): their ring slots (every layer, the encoder
    ring, the DSpark features and stage rings), their global entries (a ratio-2 entry whose
    pair reaches a rejected position included), the compressor tails (after ``a`` positions,
    from the chunk's journal), the Engram history and ``pos``."""
    p0 = old.pos
    S = tokens.shape[1]

    def ring(o, nw):
        W = o.shape[1]
        d = jnp.mod(jnp.arange(W, dtype=jnp.int32)[None, :] - p0[:, None], W)   # chunk row
        rej = (d >= a[:, None]) & (d < S)
        return jnp.where(rej.reshape(*rej.shape, *([1] * (o.ndim - 2))), o, nw)

    def rings(o, nw):
        return jax.tree.map(ring, o, nw)

    layer_rings = jax.vmap(ring, in_axes=1, out_axes=1)   # the state's [B, n_layers, W, ...]

    sources = {}
    for i, src in new.sources.items():
        r = cfg.compress_ratios[i]
        lo, hi = (p0 + a) // r, (p0 + S) // r
        ids = lo[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
        keep_old = ids < hi[:, None]

        def restore(o_arr, n_arr):
            rows = jnp.take_along_axis(
                o_arr, jnp.clip(ids, 0, o_arr.shape[1] - 1).reshape(
                    *ids.shape, *([1] * (o_arr.ndim - 2))), axis=1)
            return st.append_entries(n_arr, rows, ids, keep_old)

        o = old.sources[i]
        tail = src.tail
        if tail is not None:
            pick = jnp.clip(a - 1, 0, S - 1)[:, None, None]
            tail = st.CompressorTail(
                kv=jnp.take_along_axis(tail.kv_by_count, pick, 1)[:, 0],
                score=jnp.take_along_axis(tail.score_by_count, pick, 1)[:, 0])
        sources[i] = st.KVSource(main=restore(o.main, src.main),
                                 main_scale=restore(o.main_scale, src.main_scale),
                                 index=restore(o.index, src.index),
                                 index_scale=restore(o.index_scale, src.index_scale), tail=tail)
    hist = old.engram_history
    if hist is not None:
        hist = engram_layer.engram_update_history(hist, params["engram_token_map"][tokens], a)
    return new.replace(
        pos=p0 + a, windows=jax.tree.map(layer_rings, old.windows, new.windows),
        sources=sources,
        engram_history=hist,
        enc_ring=None if new.enc_ring is None else rings(old.enc_ring, new.enc_ring),
        dspark=None if new.dspark is None else rings(old.dspark, new.dspark))


def _verify_impl(params, tokens, state, accept, compat, *, static: Static, max_accept=None):
    B, S = tokens.shape
    out, new = _chunk_impl(params, tokens, jnp.full((B,), S, jnp.int32), state, None, None,
                           compat, static=static, mode="exact",
                           replay_len=static.cfg.window_size, all_logits=True, journal=True)
    if accept is None:
        a = greedy_acceptance(out.all_logits, tokens)
    elif callable(accept):
        a = accept(out.all_logits).astype(jnp.int32)
    else:
        a = accept
    if max_accept is not None:
        a = jnp.clip(jnp.minimum(a, max_accept), 1, S)
    state = _rollback(params, static.cfg, state, new, tokens, a)
    return out.all_logits, a, sharding.constrain_state(state, static.mesh)


_verify_jit = saved_steps.SavedJit(_verify_impl, static_argnames=("static",),
                                   donate_argnames=("state",))


def verify_fn(cfg: ModelConfig, *, attn_impl: str = "auto", compat_stale_index_k: bool = False,
              moe_impl: str = "auto", mesh=None):
    """A pure, traceable :func:`verify` ``fn(params, state, tokens int32 [B, k + 1], accept
    int32 [B] or None, max_accept int32 [B] or None) -> (logits fp32 [B, k + 1, V], accept
    int32 [B], state)`` for loops that stay on the device (no host checks); ``max_accept``
    caps the acceptance (e.g. 1 for rows that are done). ``accept`` may also be a traceable
    rule ``(logits fp32 [B, k + 1, V]) -> int32 [B]`` in ``1 .. k + 1``, applied to this
    call's logits before the rollback (the sampled acceptance of
    :func:`dsv41_jax.generation.generate_speculative`). ``mesh``: as in :func:`decode_fn`
    (nothing is placed; the returned state is constrained to the state's shardings;
    docs/architecture.md, "Sharding"). Raises ``ValueError`` for an unknown ``attn_impl`` or
    ``moe_impl``, or a mesh not of :func:`~dsv41_jax.sharding.make_mesh`, or whose
    ``expert`` axis does not divide the routed experts."""
    static = Static(cfg, False, False, *kernel_impls(cfg, attn_impl),
                    moe_impl=_check_moe_impl(moe_impl), mesh=_check_mesh(cfg, mesh, None))
    compat = jnp.asarray(compat_stale_index_k)

    def fn(params, state, tokens, accept=None, max_accept=None):
        return _verify_impl(prepare_params(params, cfg), tokens.astype(jnp.int32), state,
                            accept, compat, static=static, max_accept=max_accept)
    return fn


def max_drafts(cfg: ModelConfig) -> int:
    """The most drafts :func:`verify` takes: ``dspark_block_size`` (DSpark on), else
    ``window_size - 1``; never more than ``window_size - 1`` (the k + 1 positions of one call
    must fall on distinct ring slots)."""
    w = cfg.window_size - 1
    return min(cfg.dspark_block_size, w) if cfg.dspark_on else w


def verify(params, cfg: ModelConfig, state, tokens, accept=None, *,
           compat_stale_index_k: bool = False, attn_impl: str = "auto", moe_impl: str = "auto",
           mesh=None):
    """The main model over ``k + 1`` positions per row in one call (the last accepted token
    and ``k`` drafts), committing only an accepted prefix (docs/architecture.md, "Verify and
    rollback").

    Args:
      tokens: int [B, k + 1], ``1 <= k <= max_drafts(cfg)``; position ``pos + s`` gets
        ``tokens[:, s]``.
      accept: int [B] in ``1 .. k + 1``, the positions to commit per row; ``None``: the greedy
        rule (:func:`greedy_acceptance`) on this call's logits, on the device.
      compat_stale_index_k, attn_impl, moe_impl: as in :func:`prefill`.
      mesh: a device mesh (:func:`dsv41_jax.sharding.make_mesh`) to run on, or None (one
        device), as in :func:`prefill`: the parameters placed by
        :func:`~dsv41_jax.sharding.shard_params` (the DSpark head's replicated), the state by
        :func:`~dsv41_jax.sharding.shard_state` (arrays already in place stay), the tokens and
        ``accept`` split by rows over ``data``; the main model's routed experts run expert
        parallel (docs/architecture.md, "Sharding"). The returned state stays on the mesh.

    Returns ``(logits fp32 [B, k + 1, V], accept int32 [B], state)``: the logits of every
    position, and the state (donated) as if only the first ``accept[b]`` tokens of each row
    had run: nothing a rejected position wrote survives (window rings of every layer and of
    the DSpark stages, global entries, compressor tails, Engram history, DSpark features,
    ``pos``), and no unverified row is ever in a returned state.

    Raises ``ValueError`` (the state untouched) for tokens not [B, k + 1] with the state's
    batch, ``k`` of 0 or above :func:`max_drafts`, a token outside the vocabulary, a verify
    past the state's capacity (``pos + k + 1``), ``accept`` not [B] or outside ``1 .. k + 1``,
    a ``mesh`` not of :func:`~dsv41_jax.sharding.make_mesh`, whose ``data`` axis does not
    divide the batch or whose ``expert`` axis does not divide the routed experts.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, k + 1], got shape {tokens.shape}")
    B, S = tokens.shape
    if B != state.batch:
        raise ValueError(f"tokens has batch {B} but the state holds {state.batch} rows")
    k, kmax = S - 1, max_drafts(cfg)
    if not 1 <= k <= kmax:
        raise ValueError(f"tokens holds k = {k} drafts per row; verify takes 1 <= k <= "
                         f"{kmax} (the draft block size, and k + 1 <= window_size)")
    _check_tokens(cfg, tokens)
    _check_capacity(cfg, state, np.full((B,), S, np.int32))
    if accept is not None:
        accept = np.asarray(accept)
        if accept.shape != (B,) or not np.issubdtype(accept.dtype, np.integer):
            raise ValueError(f"accept must be an int array of shape [{B}], got {accept.dtype} "
                             f"{accept.shape}")
        if (accept < 1).any() or (accept > S).any():
            raise ValueError(f"accept must be in [1, {S}] (k + 1 = {S}), got "
                             f"{accept.tolist()}")
    static = Static(cfg, False, False, *kernel_impls(cfg, attn_impl),
                    moe_impl=_check_moe_impl(moe_impl), mesh=_check_mesh(cfg, mesh, B))
    pos = host_positions(state)
    params, state = _placed(params, cfg, state, mesh)
    # host arrays, placed by the compiled step (as in decode_step)
    logits, a, state = _verify_jit(params, tokens.astype(np.int32), state,
                                   None if accept is None else accept.astype(np.int32),
                                   jnp.asarray(compat_stale_index_k), static=static)
    if accept is not None:
        state = _with_host_positions(state, pos + accept)
    return logits, a, sharding.mark_placed(state, mesh)
