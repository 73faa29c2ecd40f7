"""The GPU family of the CSA2 sparse attention: which kernel runs a call, and the call.

Two choices per call, each a keyword or, unset, a rule:

* ``kv``: ``"packed"`` (every listed row decoded from the state's FP8 / FP4 storage in the
  kernel) or ``"dense"`` (every window row and main-KV entry decoded once to one bf16 row
  array, then the listed rows gathered: worth it where each row is listed many times,
  :func:`.triton_dense.worth_it`: prefill chunks).
* ``kernel``: ``"triton"`` or ``"mosaic_gpu"`` (the warp-specialised Hopper kernels of
  :mod:`.mosaic_gpu_rows`). Unset: :func:`packed_kernel` / :func:`rows_kernel`, and Triton
  in interpret mode or whenever Triton tuning keywords are given.

So the four kernels are the packed Triton kernel (:mod:`.triton`), the Triton rows' kernel
(:mod:`.triton_dense`), and the Mosaic GPU kernel over bf16 rows or over the packed rows
(:func:`.mosaic_gpu_rows.sparse_attention_rows`, :func:`.mosaic_gpu_rows.sparse_attention_packed`).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.sparse_attention import mosaic_gpu_rows as mr
from pallas_kernels.sparse_attention import triton as tk
from pallas_kernels.sparse_attention import triton_dense as td
from pallas_kernels.sparse_attention.common import (MERGE, SOFTMAX, SOFTMAX_BLOCK, empty_result,
                                                    joint_list, nonempty_rows,
                                                    pad_heads)

KV = ("packed", "dense")
KERNELS = ("triton", "mosaic_gpu")
# keywords that tune a Triton kernel only (n_splits also applies to the Mosaic GPU kernels)
TRITON_ONLY = ("block_h", "n_splits", "num_warps", "num_stages", "n_chunks", "merge")
# query rows from which packed rows go to the Mosaic GPU kernel by default (one row keeps
# Triton's 32-head programs)
MGPU_MIN_ROWS = 8

__all__ = ["KERNELS", "KV", "MGPU_MIN_ROWS", "packed_kernel", "rows_kernel",
           "sparse_attention"]


def _mgpu_fits(heads: int, head_dim: int, n_blocks: int) -> bool:
    return ((heads, head_dim) == (mr.H_SUPPORTED, mr.K_SUPPORTED)
            and n_blocks * SOFTMAX_BLOCK <= mr.MAX_LIST and mr.on_hopper_or_unknown())


def packed_kernel(rows: int, heads: int, n_blocks: int, head_dim: int = 512) -> str:
    """The default kernel over packed rows for ``rows = B*S`` query rows, ``heads`` x
    ``head_dim`` and ``n_blocks`` 64-entry list blocks: ``"mosaic_gpu"`` (the decoding
    producer, with :func:`.triton.default_tuning`'s list splits) for 64 heads x 512 from
    :data:`MGPU_MIN_ROWS` query rows on, lists of at most ``mosaic_gpu_rows.MAX_LIST``
    entries, on Hopper (or without a GPU: lowering, tests); ``"triton"`` otherwise."""
    programs = rows * (heads // min(heads, 64))
    mgpu = programs >= MGPU_MIN_ROWS and _mgpu_fits(heads, head_dim, n_blocks)
    return "mosaic_gpu" if mgpu else "triton"


def rows_kernel(rows: int, heads: int, n_blocks: int, head_dim: int = 512) -> str:
    """The default kernel over dequantised bf16 rows: ``"mosaic_gpu"`` for 64 heads x 512 with
    at least 128 query rows (one CTA per query fills the GPU: no list splits), lists of at most
    ``mosaic_gpu_rows.MAX_LIST`` entries, on Hopper (or without a GPU); ``"triton"``
    otherwise."""
    programs = rows * (heads // min(heads, 64))
    return "mosaic_gpu" if programs >= 128 and _mgpu_fits(heads, head_dim, n_blocks) \
        else "triton"


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "n_splits",
                                             "num_warps", "num_stages", "n_chunks", "dequant",
                                             "prefetch", "softmax", "merge", "kv", "kernel"))
def sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale, *,
                     interpret: bool = False, block_h: int | None = None,
                     n_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, n_chunks: int | None = None,
                     dequant: str | None = None, prefetch: str | None = None,
                     softmax: str | None = None, merge: str | None = None,
                     kv: str | None = None, kernel: str | None = None):
    """:func:`pallas_kernels.sparse_attention.sparse_attention` by the GPU kernels (in Pallas
    interpret mode with ``interpret``); same arguments and results.

    ``kv`` (one of :data:`KV`) and ``kernel`` (one of :data:`KERNELS`) as in the module
    docstring; the other keywords tune the chosen kernel (:func:`.triton.sparse_attention`,
    :func:`.triton_dense.sparse_attention_rows`; the Mosaic GPU kernels take ``softmax`` and
    ``n_splits`` only). ``dequant`` / ``prefetch`` tune the packed Triton kernel only.

    Raises ``ValueError`` for an unknown ``kv`` / ``kernel`` / ``softmax`` / ``merge`` /
    ``dequant`` / ``prefetch``, Triton tunings with ``kernel="mosaic_gpu"`` (``n_splits``
    excepted), ``dequant`` / ``prefetch`` with ``kv="dense"``, ``kv="packed",
    kernel="mosaic_gpu"`` in interpret mode (its producer is PTX), or what the chosen kernel
    rejects.
    """
    B, S, H, K = q.shape
    tuning = dict(num_warps=num_warps, num_stages=num_stages, n_chunks=n_chunks,
                  dequant=dequant, prefetch=prefetch, softmax=softmax, merge=merge)
    for key, allowed, value in (("dequant", tk.DEQUANT, dequant),
                                ("prefetch", tk.PREFETCH, prefetch),
                                ("softmax", SOFTMAX, softmax), ("merge", MERGE, merge),
                                ("kv", KV, kv), ("kernel", KERNELS, kernel)):
        if value is not None and value not in allowed:   # checked first: also with no list
            raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
    n_list = win_idx.shape[-1] + (0 if topk is None else topk.shape[-1])
    n_kv_rows = win_kv.shape[1] + (0 if topk is None else main.shape[1])
    if kv is None:
        kv = "dense" if td.worth_it(B * S, n_list, B * n_kv_rows) else "packed"
    n_blocks = max(1, -(-n_list // SOFTMAX_BLOCK))
    if kv == "dense":
        if dequant is not None or prefetch is not None:
            raise ValueError("dequant / prefetch tune the packed rows' decode: not with "
                             "kv='dense'")
        given = dict(tuning, block_h=block_h, n_splits=n_splits)
        return _dense(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale,
                      interpret=interpret, kernel=kernel,
                      tuning={k: v for k, v in given.items() if v is not None})
    triton_tuned = any(v is not None for v in (block_h, n_splits, num_warps, num_stages,
                                               n_chunks, dequant, prefetch, merge))
    if kernel is None and not interpret and not triton_tuned:
        kernel = packed_kernel(B * S, H, n_blocks, K)
    if kernel == "mosaic_gpu":
        given = [k for k, v in dict(tuning, block_h=block_h).items()
                 if v is not None and k != "softmax"]
        if interpret:
            raise ValueError("kv='packed', kernel='mosaic_gpu' (the warp-specialised kernel "
                             "decoding in its producer: PTX) runs on the GPU only, not in "
                             "interpret mode")
        if given:
            raise ValueError(f"kv='packed', kernel='mosaic_gpu' takes softmax and n_splits "
                             f"only, got {sorted(given)}")
        return mr.sparse_attention_packed(
            q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale,
            softmax=softmax or "exp2",
            n_splits=(tk.default_tuning(B * S, H, n_blocks, K)["n_splits"] if n_splits is None
                      else n_splits))
    return tk.sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink,
                               scale, interpret=interpret, block_h=block_h, n_splits=n_splits,
                               **tuning)


def _dense(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale, *,
           interpret: bool, kernel: str | None, tuning: dict):
    """The op by :func:`.triton_dense.dense_rows` + :func:`.common.joint_list` + the rows'
    kernel ``kernel`` (``"triton"``: :func:`.triton_dense.sparse_attention_rows`, which takes
    ``tuning``; ``"mosaic_gpu"``: :func:`.mosaic_gpu_rows.sparse_attention_rows`, ``softmax``
    and ``n_splits`` only; None: :func:`rows_kernel`, Triton in interpret mode or when Triton
    tuning keywords are given)."""
    B, S, H, K = q.shape
    n_list = win_idx.shape[-1] + (0 if topk is None else topk.shape[-1])
    triton_only = set(tuning) & set(TRITON_ONLY) - {"n_splits"}
    if kernel == "mosaic_gpu" and triton_only:
        raise ValueError(f"{sorted(triton_only)} tune the Triton rows' kernel: not with "
                         f"kernel='mosaic_gpu'")
    if n_list == 0:   # nothing listed at all
        return empty_result(q, sink)
    if H < 16 and not interpret:    # fewer heads than the tensor-core tile: zero heads pad it
        return pad_heads(q, sink, lambda q16, sink16: _dense(
            q16, win_kv, win_scale, win_idx, main, main_scale, topk, sink16, scale,
            interpret=interpret, kernel=kernel, tuning=tuning))
    n_blocks = -(-n_list // SOFTMAX_BLOCK)
    defaults = td.default_tuning(B * S, H, n_blocks, K)
    if kernel is None:   # Triton tuning keywords given: the Triton kernel they tune
        kernel = ("triton" if interpret or set(tuning) & set(TRITON_ONLY)
                  else rows_kernel(B * S, H, n_blocks, K))
    if topk is None:
        main = main_scale = None
    # an empty part gets one zero row (its listed entries read zeros, never the other part's)
    win_kv, win_scale, main, main_scale = nonempty_rows(win_kv, win_scale, main, main_scale)
    kv = td.dense_rows(win_kv, win_scale, main, main_scale)
    lst = joint_list(win_idx, topk, win_kv.shape[1], 0 if topk is None else main.shape[1])
    if kernel == "mosaic_gpu":
        return mr.sparse_attention_rows(q, kv, lst, sink, scale, interpret=interpret,
                                        softmax=tuning.get("softmax", defaults["softmax"]),
                                        n_splits=tuning.get("n_splits", 1))
    return td.sparse_attention_rows(q, kv, lst, sink, scale, interpret=interpret,
                                    **dict(defaults, **tuning))
