"""FP4 grouped matmul: rows grouped by expert times their expert's FP4 weight, the routed
experts' GEMM (docs/architecture.md, "Mixture of experts"; docs/kernels.md, "FP4 grouped
matmul").

``grouped_matmul(x [P, K] bf16, w, group_sizes [E] int32) -> bf16 [P, N]``: rows grouped by
expert in increasing id (``group_sizes[e]`` rows each; rows past the total give 0) times
``W[e]^T``, fp32 accumulation, bf16 out. ``w`` holds the stacked experts ``[E, N, K]`` in the
stored form ``{"fp4": uint8 [E, N, K/2], "scale": uint8 [E, N, K/32]}`` (packed e2m1, E8M0 per
32 inputs) or the GPU kernel's form ``{"i4", "scale_t"}`` (:func:`prepare_experts`, made once
at load time). The products are exact in fp32 (the input an FP8 QDQ activation or bf16, the
weight e2m1 times a power of two), so implementations differ only in summation order.

Implementations (``impl``, :mod:`pallas_kernels.impls`): ``"xla"`` (:mod:`.reference`:
dequantise, ``lax.ragged_dot``), ``"gpu"`` (:mod:`.mosaic_gpu`, Hopper wgmma with the weights
dequantised in registers; needs the kernel form), ``"tpu"`` (:mod:`.tpu`, a megablox-style
Pallas TPU kernel on the stored form, dequantising in VMEM; interpret-tested only),
``"gpu_interpret"`` / ``"tpu_interpret"``, ``"auto"`` (``"gpu"`` on an NVIDIA GPU for the kernel
form, ``"xla"`` otherwise).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, BFloat16, Int

from pallas_kernels import impls
from pallas_kernels.fp4.reference import BF16, F32
from pallas_kernels.grouped_matmul import mosaic_gpu, reference, tpu

__all__ = ["ROWS_OUT", "grouped_matmul", "prepare_experts", "kernel_fits", "is_kernel_form",
           "dequant", "kernel_form_values", "in_layer", "Padding", "padding", "row_padding",
           "pair_padding",
           "padded_matmul", "uses_kernel"]

prepare_experts = mosaic_gpu.prepare_experts

#: Whether the GPU kernel writes its output as rows ``Y [R, N]``
#: (``mosaic_gpu.grouped_matmul_t(rows_out=True)``; with split K, a decode step's calls, its
#: fp32 partial sums as rows ``[k_splits, R, N]``), so that the MoE's combine gathers each
#: token's outputs as rows. ``False``: the kernel writes ``Y^T`` and XLA transposes it (the
#: layout before). On an H100 at the mid shapes, one K split (a prefill), the rows are the same
#: bits and the kernel plus combine take 0.19 ms instead of 0.54 (docs/benchmarks.md).
ROWS_OUT = True


def kernel_fits(n: int, k: int) -> bool:
    """Whether the GPU kernel tiles experts of ``n`` outputs and ``k`` inputs."""
    return n % mosaic_gpu.BLOCK_N == 0 and k % mosaic_gpu.BLOCK_K == 0


def is_kernel_form(w: dict) -> bool:
    return "i4" in w


def in_layer(w: dict) -> dict:
    """Experts handed on whole out of a scanned stack (``"at"``: the layer's index in the
    flattened stack, :func:`dsv41_jax.model._run_group`) -> that layer's ``[E, N, K]``."""
    if "at" not in w:
        return w
    return {k: jax.lax.dynamic_index_in_dim(v.reshape(-1, *v.shape[-3:]), w["at"], 0,
                                            keepdims=False)
            for k, v in w.items() if k != "at"}


def kernel_form_values(w: dict) -> tuple[jax.Array, jax.Array]:
    """Experts in the kernel form (one layer's, no ``"at"``) as fp32 values ``[..., N, K]``
    and their fp32 scales ``[..., N, K / 32]`` (exact)."""
    return (mosaic_gpu.e2m1_from_i4(w["i4"].astype(F32)),
            jnp.swapaxes(w["scale_t"], -1, -2).astype(F32))


def dequant(w: dict, dtype=BF16) -> jax.Array:
    """The stacked experts of either form as ``dtype`` ``[..., N, K]`` (exact)."""
    w = in_layer(w)
    if not is_kernel_form(w):
        lead = w["fp4"].shape[:-2]
        out = reference.dequant_experts(w["fp4"].reshape(-1, *w["fp4"].shape[-2:]),
                                        w["scale"].reshape(-1, *w["scale"].shape[-2:]))
        return out.reshape(*lead, *out.shape[-2:]).astype(dtype)
    v, s = kernel_form_values(w)
    return (v * jnp.repeat(s, 32, axis=-1)).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Padding:
    """The GPU kernel's block-aligned row layout for one set of group sizes
    (:func:`mosaic_gpu.pad_groups`): grouped row ``p`` goes to padded row ``dest[p]`` (``R``:
    none), padded row ``r`` holds grouped row ``src[r]`` (``P``: a padding row), token tile
    ``t`` belongs to expert ``tile_expert[t]`` (-1: unused)."""
    dest: Int[Array, "P"]
    src: Int[Array, "R"]
    tile_expert: Int[Array, "T"]
    block_m: int = dataclasses.field(metadata=dict(static=True))

    @property
    def rows(self) -> int:
        return self.tile_expert.shape[0] * self.block_m

    def pad(self, x: jax.Array, index: jax.Array | None = None) -> jax.Array:
        """Grouped rows ``[P, K]`` -> padded ``[R, K]`` (padding rows 0), by a gather; with
        ``index`` [P], the grouped rows are ``x[index]`` (one gather from ``x``)."""
        P = self.dest.shape[0]
        keep = self.src < P
        src = jnp.minimum(self.src, P - 1)
        rows = src if index is None else index[src]
        return jnp.where(keep.reshape(-1, *[1] * (x.ndim - 1)), x[rows], 0).astype(x.dtype)

    def unpad(self, y: jax.Array) -> jax.Array:
        """Padded rows ``[R, N]`` (:func:`padded_matmul`'s ``Y``) -> grouped rows ``[P, N]``
        (rows past the groups' total: 0), by a gather of rows in increasing order."""
        keep = self.dest < self.rows
        y = y[jnp.minimum(self.dest, self.rows - 1)]
        return jnp.where(keep[:, None], y, 0).astype(y.dtype)


def padding(group_sizes: Int[Array, "E"], rows: int, block_m: int | None = None) -> Padding:
    """The padded layout of ``rows`` grouped rows (token tile: ``block_m`` or
    :func:`mosaic_gpu.pick_block_m`)."""
    bm = block_m or mosaic_gpu.pick_block_m(rows, group_sizes.shape[0])
    dest, tile_expert = mosaic_gpu.pad_groups(group_sizes, rows, bm)
    R = tile_expert.shape[0] * bm
    src = jnp.full((R,), rows, jnp.int32).at[dest].set(jnp.arange(rows, dtype=jnp.int32),
                                                         mode="drop")
    return Padding(dest, src, tile_expert, bm)


#: The most rows :func:`row_padding` takes: it compares every pair of rows (``P x P``), one
#: fused reduction for a decode step's few hundred (token, expert) pairs.
ROW_PADDING_MAX_ROWS = 2048


def row_padding(row_expert: Int[Array, "P"], experts: int, block_m: int | None = None
                ) -> Padding:
    """:func:`padding`'s layout for rows in any order, each naming its expert: the rows of an
    expert keep their order (a stable sort's), so the layout is ``padding``'s of the rows
    sorted by expert, its ``dest`` / ``src`` indexing the rows where they are. Nothing is
    sorted: each row's place among its expert's rows is a count of the earlier rows with the
    same expert (``P x P`` comparisons; at most :data:`ROW_PADDING_MAX_ROWS` rows, else
    ``ValueError``). Token tile: ``block_m`` or :func:`mosaic_gpu.pick_block_m`."""
    P = row_expert.shape[0]
    if P > ROW_PADDING_MAX_ROWS:
        raise ValueError(f"row_padding: {P} rows, at most {ROW_PADDING_MAX_ROWS}")
    bm = block_m or mosaic_gpu.pick_block_m(P, experts)
    e = row_expert.astype(jnp.int32)
    sizes = jnp.sum(e[:, None] == jnp.arange(experts, dtype=jnp.int32), axis=0,
                    dtype=jnp.int32)
    r = jnp.arange(P, dtype=jnp.int32)
    rank = jnp.sum((e[None, :] == e[:, None]) & (r[None, :] < r[:, None]), axis=1,
                   dtype=jnp.int32)                     # earlier rows of the same expert
    tile_start, tile_expert = mosaic_gpu.group_tiles(sizes, P, bm)
    dest = tile_start[e] * bm + rank
    src = jnp.full((tile_expert.shape[0] * bm,), P, jnp.int32).at[dest].set(r, mode="drop")
    return Padding(dest, src, tile_expert, bm)


def pair_padding(row_expert: Int[Array, "P"], block_m: int = mosaic_gpu.BLOCK_MS[0]
                 ) -> Padding:
    """The layout of a call with few rows (a decode step's (token, expert) pairs): each row
    alone in its own token tile, tile ``p`` belonging to expert ``row_expert[p]``, in the rows'
    order. Nothing is sorted, counted or scattered (the layout is static but for the tiles'
    experts), and every tile reads its expert's weights once, so a call of ``P`` rows reads
    ``P`` experts' FP4 bytes (pairs that share an expert read it again)."""
    P = row_expert.shape[0]
    r = jnp.arange(P * block_m, dtype=jnp.int32)
    return Padding(dest=jnp.arange(P, dtype=jnp.int32) * block_m,
                   src=jnp.where(r % block_m == 0, r // block_m, P),
                   tile_expert=row_expert.astype(jnp.int32), block_m=block_m)


def uses_kernel(w: dict, impl: str = "auto") -> bool:
    """Whether :func:`grouped_matmul` with ``impl`` runs the GPU kernel on ``w``."""
    impl = impls.check_family(impl)
    if impl == "auto":
        return impls.on_gpu() and is_kernel_form(w)
    return impls.platform(impl) == "gpu"


def padded_matmul(xp: BFloat16[Array, "R K"], w: dict, pad: Padding, *, interpret: bool = False,
                  k_splits: int | None = None, max_concurrent_steps: int = 4
                  ) -> BFloat16[Array, "R N"]:
    """The GPU kernel on rows already in the padded layout: ``Y`` ``[R, N]`` (bf16), rows of
    padding rows 0 or undefined (never read back by :meth:`Padding.unpad`). ``w`` in the
    kernel form, possibly a stack with ``"at"``. ``k_splits``: default
    :func:`mosaic_gpu.pick_k_splits`; the kernel writes ``Y``'s rows (with split K, its
    partial sums' rows, added by XLA) itself where :data:`ROWS_OUT`, else XLA transposes the
    kernel's ``Y^T``."""
    if not is_kernel_form(w):
        raise ValueError("grouped_matmul: the GPU kernel needs the kernel form of the experts "
                         "(prepare_experts)")
    E = w["i4"].shape[-3]
    tile_expert = pad.tile_expert
    if "at" in w:           # a stack of layers read in place: experts numbered across it
        tile_expert = jnp.where(tile_expert >= 0, tile_expert + w["at"] * E, -1)
        w = {k: w[k].reshape(-1, *w[k].shape[-2:]) for k in ("i4", "scale_t")}
    N, K = w["i4"].shape[-2:]
    splits = k_splits or mosaic_gpu.pick_k_splits(len(pad.dest), E, N, K)
    y = mosaic_gpu.grouped_matmul_t(xp, w, tile_expert, block_m=pad.block_m, k_splits=splits,
                                    max_concurrent_steps=max_concurrent_steps,
                                    rows_out=ROWS_OUT, interpret=interpret)
    if splits > 1:      # the K splits' fp32 partial sums added, rounded to bf16 once
        y = jnp.sum(y, axis=0).astype(BF16)
    return y if ROWS_OUT else y.T


def grouped_matmul(x: BFloat16[Array, "P K"], w: dict, group_sizes: Int[Array, "E"], *,
                   impl: str = "auto", block_m: int | None = None, k_splits: int | None = None,
                   max_concurrent_steps: int = 4) -> BFloat16[Array, "P N"]:
    """See the module docstring. GPU tuning: ``block_m`` (token tile, default
    :func:`mosaic_gpu.pick_block_m`), ``k_splits`` (default :func:`mosaic_gpu.pick_k_splits`),
    ``max_concurrent_steps``. Raises ``ValueError`` for an unknown ``impl``, or with
    ``impl="gpu"`` for the stored form or shapes the kernel does not tile (``impl="tpu"``:
    the kernel form)."""
    impl = impls.check_family(impl)
    kernel_form = is_kernel_form(w)
    if impl == "auto":
        impl = "gpu" if impls.on_gpu() and kernel_form else "xla"
    if impls.platform(impl) == "tpu":
        w = in_layer(w)
        if kernel_form:
            raise ValueError("grouped_matmul: the TPU kernel takes the stored form of the "
                             "experts, not the GPU kernel's")
        return tpu.fp4_grouped_matmul_tpu(x.astype(BF16), w["fp4"], w["scale"], group_sizes,
                                          interpret=impls.interpret(impl))
    if impls.platform(impl) != "gpu":
        w = in_layer(w)
        y = jax.lax.ragged_dot(x.astype(BF16), jnp.swapaxes(dequant(w), 1, 2),
                               group_sizes.astype(jnp.int32), preferred_element_type=F32)
        return y.astype(BF16)
    if not kernel_form:
        raise ValueError("grouped_matmul: the GPU kernel needs the kernel form of the experts "
                         "(prepare_experts)")
    pad = padding(group_sizes, x.shape[0], block_m)
    y = padded_matmul(pad.pad(x.astype(BF16)), w, pad, interpret=impls.interpret(impl),
                       k_splits=k_splits, max_concurrent_steps=max_concurrent_steps)
    return pad.unpad(y).astype(BF16)
