"""Helpers for tests/test_cases.py (the failure modes B01 ... B24).

Every model-level case runs through ONE compiled prefill per batch size: prompts are right-padded
to a fixed bucket of ``BUCKET`` tokens, the state has a fixed capacity ``CAP``, and every call
uses ``mode="exact", collect=True, all_logits=True`` (so the same executable is reused).
"""

from __future__ import annotations

import dsv41_jax as dsv  # noqa: F401  (import first: XLA numerics flag)
import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import quant
from dsv41_jax.layers import mhc
from dsv41_jax.layers.linear import linear, rms_norm
from dsv41_jax.layers.rope import apply_rope, rope_angles, rope_frequencies

CAP = 64        # state capacity (tokens per row)
BUCKET = 32     # prompt bucket (every prefill call is right-padded to this many tokens)

F32 = jnp.float32
BF16 = jnp.bfloat16


def to_np(tree):
    """Numpy COPIES of every leaf (a donated device buffer must never back a kept array)."""
    return jax.tree.map(lambda a: np.array(a, copy=True), tree)


def copy_state(s):
    return jax.tree.map(jnp.copy, s)


def to_dev(tree):
    """Fresh device buffers for a (numpy) state, safe to donate."""
    return jax.tree.map(lambda a: jnp.copy(jnp.asarray(a)), tree)


def seq(seed: int, n: int = BUCKET, vocab: int = 512) -> np.ndarray:
    """A deterministic token sequence (ids in [3, vocab))."""
    return np.random.default_rng(1000 + seed).integers(3, vocab, size=n).astype(np.int32)


def pad_rows(rows, S: int = BUCKET, fill=None):
    """Right-pad token rows to ``[B, S]``; ``fill`` None -> 0, an int, or an rng for garbage."""
    B = len(rows)
    toks = np.zeros((B, S), np.int32)
    if isinstance(fill, np.random.Generator):
        toks[:] = fill.integers(0, 512, size=(B, S))
    elif fill is not None:
        toks[:] = fill
    lens = np.array([len(r) for r in rows], np.int32)
    for b, r in enumerate(rows):
        toks[b, :len(r)] = r
    return toks, lens


def prefill(params, cfg, rows, state=None, fill=None):
    """Exact prefill of right-padded ``rows`` (list of 1-D token arrays), continuing ``state``.

    Runs with ``batch_invariant=True`` (rows one at a time inside the compiled function), the
    mode that guarantees bitwise batch-size invariance (B01 packed, B24); a batch of one is
    the same computation either way. Returns ``(out, state)``: the :class:`StepOutput` with
    numpy leaves and the new state; ``state`` (if given) is donated.
    """
    if state is None:
        state = dsv.init_state(cfg, len(rows), CAP)
    toks, lens = pad_rows(rows, fill=fill)
    out, state = dsv.prefill(params, cfg, toks, state, lens, mode="exact", collect=True,
                             all_logits=True, batch_invariant=True)
    return to_np(out), state


def decode(params, cfg, state, tokens):
    out, state = dsv.decode_step(params, cfg, state, np.asarray(tokens, np.int32), collect=True)
    return to_np(out), state


def row(tree, b):
    """Row ``b`` of every leaf of a (numpy) tree with a leading batch axis."""
    return jax.tree.map(lambda a: np.asarray(a)[b], tree)


# ----------------------------------------------------------------------------- oracles


def layer_input(params, cfg, records, i):
    """Attention input of layer ``i`` (``attn_norm(hc_pre(X_{i-1}, pre_mix_{i-1}))``) rebuilt
    from the collected records of layer ``i - 1`` (``i >= 1``). bf16 [B, S, D]."""
    X = jnp.asarray(records[i - 1]["block_out"])
    pm = jnp.asarray(records[i - 1]["block_pre_mix"])
    return rms_norm(mhc.hc_pre(X, pm), params["layers"][i]["attn_norm"]["weight"], cfg.norm_eps)


def layer0_input(params, cfg, tokens):
    """Attention input of layer 0: the streams are the repeated embedding, pre_mix one-hot."""
    h = params["embed"]["weight"][jnp.asarray(tokens)]
    return rms_norm(h, params["layers"][0]["attn_norm"]["weight"], cfg.norm_eps)


def window_kv_codes(params, cfg, layer, x, positions, kind):
    """FP8 (codes, scale) of a layer's window KV for inputs ``x`` [B, S, D] at ``positions``
    with the RoPE table ``kind`` (docs/architecture.md, "Window KV")."""
    a = params["layers"][layer]["attn"]
    kv = rms_norm(linear(x, a["wkv"]), a["kv_norm"]["weight"], cfg.norm_eps)
    cos, sin = rope_angles(jnp.asarray(positions), rope_frequencies(cfg, kind))
    kv = apply_rope(kv, cos, sin)
    return quant.fp8_quantize(kv, 32)


def np_pool_pairs(x, wkv, wgate):
    """float64 gated per-channel softmax pool of token pairs (docs/architecture.md,
    "Compressors"): x [S, D] -> [S//2, K]."""
    x = np.asarray(x, np.float64)
    kv = x @ np.asarray(wkv, np.float64).T
    sc = x @ np.asarray(wgate, np.float64).T
    n = x.shape[0] // 2
    kv, sc = kv[:2 * n].reshape(n, 2, -1), sc[:2 * n].reshape(n, 2, -1)
    w = np.exp(sc - sc.max(1, keepdims=True))
    w = w / w.sum(1, keepdims=True)
    return (kv * w).sum(1)


def np_rms_norm(x, w, eps):
    x = np.asarray(x, np.float64)
    return np.asarray(w, np.float64) * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def np_candidate_pool(score, visible, n_blocks, block):
    """The candidate pool (docs/architecture.md, "Candidate pool") in numpy for one query row:
    bool mask [T]."""
    T = score.shape[0]
    nb = -(-T // block)
    sp = np.full(nb * block, -np.inf)
    sp[:T] = score
    bs = sp.reshape(nb, block).max(-1)
    last = (visible - 1) // block
    if visible > 0:
        bs[last] = np.inf
    order = sorted(range(nb), key=lambda j: (-bs[j], j))[:min(n_blocks, nb)]
    keep = np.zeros(nb, bool)
    for j in order:
        if bs[j] > -np.inf:
            keep[j] = True
    return np.repeat(keep, block)[:T]


def np_topk(score, k):
    """Top-k positions of one row, ties to the lower position, -inf/NaN unselectable, sorted
    ascending, -1 padded (docs/architecture.md, "Top-k selection")."""
    T = score.shape[0]
    ok = [t for t in range(T) if np.isfinite(score[t]) or score[t] == np.inf]
    ok.sort(key=lambda t: (-score[t], t))
    sel = sorted(ok[:min(k, T)])
    k = min(k, T)
    return np.array(sel + [-1] * (k - len(sel)), np.int32)


def np_sinkhorn(m, scale, base, hc, iters, eps):
    """hc_split_sinkhorn (docs/architecture.md, "mHC: hyper-connections") in float64."""
    m = np.asarray(m, np.float64)
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    pre = sig(m[:hc] * scale[0] + base[:hc]) + eps
    post = 2 * sig(m[hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (m[2 * hc:] * scale[2] + base[2 * hc:]).reshape(hc, hc)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(0, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(1, keepdims=True) + eps)
        c = c / (c.sum(0, keepdims=True) + eps)
    return pre, post, c


def make_chunk(cfg, offset, S: int, n: int | None = None, decode: bool = False, win_lo=None):
    """A one-row :class:`Chunk` for positions ``offset .. offset+S-1``; the window starts at
    ``win_lo`` (default ``offset``: nothing before the chunk exists)."""
    from dsv41_jax import model
    n = S if n is None else n
    off = jnp.asarray(offset, jnp.int32).reshape(1)
    lo = off if win_lo is None else jnp.asarray(win_lo, jnp.int32).reshape(1)
    pos = off[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
    valid = jnp.arange(S)[None, :] < n
    return model.make_chunk(cfg, positions=pos, valid=valid, p0=off,
                            n=jnp.full((1,), n, jnp.int32), win_lo=lo, decode=decode,
                            compat=False)


def poison_bytes(rng, a, e8m0: bool = False):
    """Random finite garbage with the dtype/shape of ``a``: packed e2m1 bytes (any byte),
    E8M0 scale bytes (``e8m0``: exponents near 1, never the NaN/inf byte), e4m3 or fp32 values."""
    a = np.asarray(a)
    if a.dtype == np.uint8:
        if e8m0:
            return rng.integers(121, 134, size=a.shape).astype(np.uint8)
        return rng.integers(0, 256, size=a.shape).astype(np.uint8)
    if a.dtype.itemsize == 1:   # float8_e4m3fn
        return rng.uniform(-3, 3, size=a.shape).astype(np.float32).astype(a.dtype)
    return rng.uniform(-3, 3, size=a.shape).astype(a.dtype)
