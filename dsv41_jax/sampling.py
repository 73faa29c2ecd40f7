"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), in pure ``jnp``.

:func:`sample` is traceable (use it inside ``jax.jit`` / ``lax.while_loop``); its
:class:`SamplingParams` are static Python values, so a jitted caller compiles once per setting.
The order of the filters: the logits are divided by the temperature, the top-k filter keeps the
``top_k`` largest, the top-p filter keeps the smallest prefix of the remaining tokens sorted by
probability whose probability (renormalised over the remaining tokens) reaches ``top_p``, and one
token is drawn with ``jax.random.categorical``. Temperature 0 is ``argmax`` (no key used).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dsv41_jax.dtypes import F32


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How :func:`sample` picks a token (static: hashable, a pytree without leaves).

    Fields:
      temperature: float >= 0, finite. 0: greedy (``argmax``; ``top_k`` and ``top_p`` are then
        irrelevant). Default 0.
      top_k: int >= 0. Keep the ``top_k`` most likely tokens (0: off; 1: greedy at any
        temperature; a value >= the vocabulary is off). Default 0.
      top_p: float in (0, 1]. Keep the most likely tokens until their probability reaches
        ``top_p`` (at least one token; 1: off). Default 1.

    Raises ``ValueError`` naming the field for a value of the wrong type or out of range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1: off), got {p!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        """True when :func:`sample` is ``argmax`` (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1


#: Top-p without top-k looks first among each row's largest logits (``lax.top_k``), at each
#: platform's candidate counts in turn: when the candidates hold ``top_p`` of the probability in
#: every row, no kept token lies beyond them; otherwise the next count, and the whole row sorted
#: last. The same tokens are kept either way. XLA's CPU backend sorts 129,280 logits in 25 ms
#: and takes the 256 (4,096) largest in 0.5 (2.5) ms; its GPU backend has a top-k kernel up to
#: 16 and sorts the row for more (a radix sort, fast there).
TOP_P_CANDIDATES = {"gpu": (16,), "default": (256, 4096)}
#: The fewest rows for which a platform looks among the candidates first (fewer rows: the rows
#: are sorted at once). Timed on an H100 (``sample`` at top-p 0.95 over 129,280 logits whose
#: nucleus lies in the 16 largest, ms per call queued back to back; candidates / sort): 1 row
#: 0.38 / 0.13, 4 rows 0.29 / 0.19, 8 rows 0.29 / 0.30, 16 rows 0.29 / 0.55, 64 rows 0.43 /
#: 1.73 (docs/results/h100_sampling_top_p.json). On a CPU the candidates win from one row.
TOP_P_CANDIDATE_ROWS = {"gpu": 8, "default": 1}


def _sorted_desc(x: Float[Array, "B V"], k: int) -> tuple[Float[Array, "B K"], Int[Array, "B K"]]:
    """The ``k`` largest values of each row, largest first, and their indices (ties: lower index
    first)."""
    if k < x.shape[-1]:
        vals, idx = jax.lax.top_k(x, k)
        return vals, idx.astype(jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    neg, idx = jax.lax.sort((-x, idx), dimension=-1, num_keys=1, is_stable=True)
    return -neg, idx


def _top_p_keep(vals: Float[Array, "B K"], lse: Float[Array, "B 1"], top_p: float
                ) -> tuple[Float[Array, "B K"], Float[Array, "B"]]:
    """``vals`` (sorted, largest first) with the tokens the top-p filter drops set to ``-inf``
    (a token stays when the probability ``exp(v - lse)`` of the tokens before it is below
    ``top_p``), and the probability of all of ``vals``."""
    probs = jnp.exp(vals - lse)
    total = jnp.cumsum(probs, axis=-1)
    kept = jnp.where(total - probs < jnp.float32(top_p), vals, -jnp.inf)
    return kept, total[:, -1]


def _over_kept(x: Float[Array, "B V"], params: SamplingParams, finish):
    """``finish(vals, idx)`` over the tokens the top-k and top-p filters keep: ``vals`` fp32
    [B, K] the kept logits largest first (``-inf`` for the dropped ones among them), ``idx``
    int32 [B, K] their token ids; ``K`` is ``top_k``, one of ``TOP_P_CANDIDATES`` or the
    vocabulary (see :data:`TOP_P_CANDIDATES`)."""
    V = x.shape[-1]
    k = params.top_k if 0 < params.top_k < V else V
    if params.top_p == 1.0:
        return finish(*_sorted_desc(x, k))
    if k < V:
        vals, idx = _sorted_desc(x, k)
        lse = jax.nn.logsumexp(vals, axis=-1, keepdims=True)
        return finish(_top_p_keep(vals, lse, params.top_p)[0], idx)
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)

    def over(counts: tuple[int, ...]):
        vals, idx = _sorted_desc(x, counts[0] if counts else V)
        kept, mass = _top_p_keep(vals, lse, params.top_p)
        if not counts:
            return finish(kept, idx)
        return jax.lax.cond(jnp.all(mass >= jnp.float32(params.top_p)),
                            lambda: finish(kept, idx), lambda: over(counts[1:]))

    platform = jax.default_backend()
    counts = TOP_P_CANDIDATES.get(platform, TOP_P_CANDIDATES["default"])
    if x.shape[0] < TOP_P_CANDIDATE_ROWS.get(platform, TOP_P_CANDIDATE_ROWS["default"]):
        counts = ()
    return over(tuple(sorted(n for n in set(counts) if 0 < n < V)))


def _categorical(key: jax.Array, x: Float[Array, "B K"]) -> Int[Array, "B"]:
    """``jax.random.categorical(key, x, axis=-1)``, the same draw, with the Gumbel noise
    written out before the ``argmax`` (fused into the reduction, XLA's CPU backend draws it
    3x slower)."""
    g = jax.lax.optimization_barrier(jax.random.gumbel(key, x.shape, x.dtype))
    return jnp.argmax(g + x, axis=-1)


def sample(logits: Float[Array, "B V"], key: jax.Array | None,
           params: SamplingParams = SamplingParams()) -> Int[Array, "B"]:
    """One token per row from ``logits`` (fp32 [B, V]; other float dtypes are cast to fp32).

    Greedy (``params.greedy``): ``argmax`` (the lowest index among equal maxima), ``key``
    unused and may be ``None``. Otherwise, in fp32: ``x = logits / temperature``; with
    ``top_k`` (``0 < top_k < V``) all but the ``top_k`` largest of ``x`` are dropped; with
    ``top_p < 1`` the remaining tokens are sorted by probability (``softmax`` over them; ties:
    lower id first) and a token is kept when the probability of the tokens before it is below
    ``top_p`` (so the most likely token always stays); then ``jax.random.categorical(key, x)``
    over the kept tokens.

    Returns int32 [B]. Raises ``ValueError`` when ``key`` is ``None`` and the sampling is not
    greedy.
    """
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError("key: sampling with temperature > 0 (and top_k != 1) needs a PRNG key")
    x = logits.astype(F32) / jnp.float32(params.temperature)
    V = x.shape[-1]
    if not 0 < params.top_k < V and params.top_p == 1.0:
        return _categorical(key, x).astype(jnp.int32)

    def draw(vals, idx):
        choice = _categorical(key, vals)
        return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

    return _over_kept(x, params, draw)


def probabilities(logits: Float[Array, "*B V"], params: SamplingParams = SamplingParams()
                  ) -> Float[Array, "*B V"]:
    """The distribution :func:`sample` draws from, fp32 ``[..., V]`` (any leading dims):
    ``softmax`` of ``logits / temperature`` over the tokens the top-k and top-p filters keep,
    exactly 0 elsewhere; greedy: one-hot at the ``argmax`` (the lowest index among ties)."""
    V = logits.shape[-1]
    flat = logits.reshape(-1, V).astype(F32)
    if params.greedy:
        out = jax.nn.one_hot(jnp.argmax(flat, axis=-1), V, dtype=F32)
        return out.reshape(logits.shape)
    x = flat / jnp.float32(params.temperature)
    if not 0 < params.top_k < V and params.top_p == 1.0:
        return jax.nn.softmax(x, axis=-1).reshape(logits.shape)
    rows = jnp.arange(flat.shape[0])[:, None]

    def spread(vals, idx):
        return jnp.zeros_like(x).at[rows, idx].set(jax.nn.softmax(vals, axis=-1))

    return _over_kept(x, params, spread).reshape(logits.shape)


def speculative_accept(logits: Float[Array, "B S V"], drafts: Int[Array, "B K"],
                       draft_probs: Float[Array, "B K V"] | None, count: Int[Array, "B"],
                       key: jax.Array, params: SamplingParams = SamplingParams()
                       ) -> tuple[Int[Array, "B"], Int[Array, "B"]]:
    """Speculative sampling (rejection sampling against the draft distribution;
    docs/architecture.md, "Speculative generation"): which drafts a row accepts and the token
    after them, so that the emitted tokens follow :func:`probabilities` of the main model's
    logits exactly, whatever the drafts.

    Args:
      logits: fp32 [B, S, V], the main model's logits at the verified positions: position i
        predicts the token after ``[last, drafts[:, :i]]``; ``S >= K + 1``.
      drafts: int [B, K], the drafted tokens.
      draft_probs: fp32 [B, K, V], the distribution each draft was drawn from (``q_i``, given
        the drafts before it), or None for drafts that are deterministic (``q_i`` one-hot).
      count: int [B] in 0 .. K, the drafts considered per row (the rest are ignored).
      key: PRNG key (unused when ``params.greedy``).
      params: the sampling of the main model (:class:`SamplingParams`), ``p_i =
        probabilities(logits[:, i], params)``.

    Rule: draft i (in order, i < count) is accepted with probability ``min(1, p_i(x) /
    q_i(x))``; at the first rejection the token is drawn from ``normalize(max(p_i - q_i,
    0))`` (``p_i`` where that is all 0 in floating point); when all ``count`` drafts are
    accepted it is drawn from ``p_count``. Greedy: a draft is accepted when it equals the
    argmax and the token is the argmax after the accepted drafts.

    Returns ``(accepted int32 [B] in 0 .. count, token int32 [B])``.
    """
    B, K = drafts.shape
    drafts = drafts.astype(jnp.int32)
    count = count.astype(jnp.int32)
    p = probabilities(logits[:, :K + 1], params)                          # [B, K + 1, V]
    p_d = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]   # [B, K]
    if draft_probs is None:
        q = jax.nn.one_hot(drafts, p.shape[-1], dtype=F32)
        q_d = jnp.ones((B, K), F32)
    else:
        q = draft_probs.astype(F32)
        q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    k_u, k_tok = jax.random.split(key)
    u = jax.random.uniform(k_u, (B, K), F32)                               # [0, 1)
    ok = (u * q_d < p_d) if not params.greedy else (p_d > 0.5)
    ok = ok & (jnp.arange(K)[None, :] < count[:, None])
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]           # [B, V]
    if params.greedy:
        return n, jnp.argmax(p_n, axis=-1).astype(jnp.int32)
    q_n = jnp.take_along_axis(q, jnp.minimum(n, K - 1)[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(p_n - q_n, 0.0)
    rejected = n < count
    use = jnp.where((rejected & (resid.sum(-1) > 0))[:, None], resid, p_n)
    tok = _categorical(k_tok, jnp.log(use)).astype(jnp.int32)
    return n, tok
