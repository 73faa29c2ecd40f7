"""Token generation on the device: one jitted ``lax.while_loop`` of sample-then-decode steps.

:func:`generate` continues from a prefilled state: the first new token of each row is sampled
from the prefill's last logits, and every further token costs one model step
(:func:`dsv41_jax.model.decode_fn`) inside the same compiled loop, with no host round trip per
token. The loop is compiled once per (config, sampling, ``max_new_tokens``, kernel family,
batch, capacity, number of EOS ids) and reused across calls.

:func:`generate_speculative` does the same with DSpark speculation: per loop iteration, drafts,
one ``verify`` of them and the accepted ones emitted (greedy, or sampled with rejection
sampling so the tokens keep the model's distribution; docs/architecture.md, "Speculative
generation").

:func:`bucket_length` and :func:`length_buckets` pick padded prefill widths from a small set so
that prompts of any length compile a few prefill programs only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from dsv41_jax import model, saved_steps, sharding
from dsv41_jax import state as st
from dsv41_jax.config import ModelConfig
from dsv41_jax.dtypes import F32
from dsv41_jax.sampling import SamplingParams, probabilities, sample, speculative_accept


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "lengths", "state"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What :func:`generate` returns.

    Fields:
      tokens: int32 [B, max_new_tokens], the generated tokens of each row, -1 after its end. A
        row that stopped at an EOS id ends with that id.
      lengths: int32 [B], generated tokens per row (1 to max_new_tokens), EOS included.
      state: the inference state after the loop (see :func:`generate` for what it holds).
    """

    tokens: Any
    lengths: Any
    state: Any


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["state", "tokens", "lengths", "done", "step", "key", "last",
                                "logits"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class _Carry:
    """The loop's carry: state; tokens int32 [B, N] (-1 = not written); lengths int32 [B];
    done bool [B]; step int32 [] (tokens sampled so far); key (PRNG key); last int32 [B] (each
    row's latest token, the next model input); logits fp32 [B, V] (to sample the next token
    from)."""

    state: Any
    tokens: Any
    lengths: Any
    done: Any
    step: Any
    key: Any
    last: Any
    logits: Any


def _pick(c: _Carry, eos: Int[Array, "E"], sampling: SamplingParams, n: int) -> _Carry:
    """Sample token number ``c.step`` from ``c.logits``; write it for the rows not done; mark
    rows done at an EOS id or at the last slot."""
    key, sub = jax.random.split(c.key)
    tok = sample(c.logits, sub, sampling)
    live = ~c.done
    tokens = c.tokens.at[:, c.step].set(jnp.where(live, tok, c.tokens[:, c.step]))
    hit = (tok[:, None] == eos[None, :]).any(axis=1)
    done = c.done | (live & hit) | (c.step + 1 >= n)
    return dataclasses.replace(c, tokens=tokens, lengths=c.lengths + live.astype(jnp.int32),
                               done=done, step=c.step + 1, key=key,
                               last=jnp.where(live, tok, c.last))


def _loop(params, state, logits, key, eos, *, cfg: ModelConfig, sampling: SamplingParams,
          max_new_tokens: int, attn_impl: str, batch_invariant: bool = False,
          mesh=None) -> GenerationResult:
    """The whole generation as one traceable function (see :func:`generate`)."""
    step_fn = model.decode_fn(cfg, attn_impl=attn_impl, batch_invariant=batch_invariant,
                              mesh=mesh)
    params = model.prepare_params(params, cfg)   # once, not per step (prepared: unchanged)
    B = logits.shape[0]
    c = _Carry(state=state, tokens=jnp.full((B, max_new_tokens), -1, jnp.int32),
               lengths=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool),
               step=jnp.zeros((), jnp.int32), key=key, last=jnp.zeros((B,), jnp.int32),
               logits=logits.astype(F32))
    c = _pick(c, eos, sampling, max_new_tokens)

    def cond(c: _Carry):
        return (c.step < max_new_tokens) & ~c.done.all()

    def body(c: _Carry):
        logits, state = step_fn(params, c.state, c.last)
        return _pick(dataclasses.replace(c, state=state, logits=logits), eos, sampling,
                     max_new_tokens)

    c = jax.lax.while_loop(cond, body, c)
    return GenerationResult(tokens=c.tokens, lengths=c.lengths, state=c.state)


_loop_jit = saved_steps.SavedJit(_loop, static_argnames=("cfg", "sampling", "max_new_tokens",
                                                         "attn_impl", "batch_invariant", "mesh"),
                                 donate_argnames=("state",))


def _checked_eos(eos_ids, cfg) -> list[int]:
    """``eos_ids`` as a list; ``ValueError`` naming the first that is not a token id."""
    eos = list(eos_ids)
    for e in eos:
        if isinstance(e, bool) or not isinstance(e, (int, np.integer)) \
                or not 0 <= e < cfg.vocab_size:
            raise ValueError(f"eos_ids: {e!r} is not a token id in [0, vocab_size="
                             f"{cfg.vocab_size})")
    return eos


def generate(params, cfg: ModelConfig, state, logits, *, max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), eos_ids=(), seed: int = 0,
             attn_impl: str = "auto", batch_invariant: bool = False,
             mesh=None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens per row after a prefill, on the device.

    Args:
      params: the model parameters, prepared (:func:`dsv41_jax.model.prepare_params`) or raw
        (then prepared inside each call, once before the loop).
      state: the inference state after :func:`dsv41_jax.model.prefill` (it is donated: use the
        returned one).
      logits: fp32 [B, V], the prefill's last logits (``out.logits``); the first new token
        of each row is sampled from them.
      max_new_tokens: tokens to generate per row, >= 1.
      sampling: :class:`~dsv41_jax.sampling.SamplingParams` (default greedy).
      eos_ids: token ids that end a row; the EOS token itself is the row's last token in
        ``tokens`` and counts in ``lengths``. Empty: every row runs to ``max_new_tokens``.
      seed: seed of the sampling's PRNG key (unused when greedy); the same seed gives the same
        tokens.
      attn_impl: kernel family, as in :func:`dsv41_jax.model.prefill`.
      batch_invariant: run each model step's rows one at a time, as in
        :func:`dsv41_jax.model.prefill` (each row's tokens then do not depend on the batch).
      mesh: a device mesh (:func:`dsv41_jax.sharding.make_mesh`) to run on, or None (one
        device), as in :func:`dsv41_jax.model.prefill`: the parameters are prepared and placed
        by :func:`~dsv41_jax.sharding.shard_params`, the state by
        :func:`~dsv41_jax.sharding.shard_state` and the logits split by rows over ``data``
        when they are not already there (docs/architecture.md, "Sharding"). The returned state
        stays on the mesh; the tokens are those of one device wherever the model steps' logits
        are (``batch_invariant`` on a mesh without ``data`` splitting; the sampling's random
        bits do not depend on the sharding).

    Each loop iteration samples one token per row, writes it for the rows not done yet, marks a
    row done at an EOS id or at ``max_new_tokens`` tokens, and (unless every row is done) runs
    the latest tokens through one model step. The loop stops when every row is done, so it runs
    ``max(lengths) - 1`` model steps. Rows that are done keep stepping with their last token
    (nothing more is written for them).

    The capacity check asks for room for all ``max_new_tokens`` tokens, so the last one can
    still be fed after the call.

    The returned state: every row advanced by ``max(lengths) - 1`` tokens. The last sampled
    token is not run through the model, so a row of the longest length holds all its generated
    tokens except the last; a shorter row holds all its tokens (its last one included) and then
    repeats of its last token up to that count. To continue a row of the longest length, feed
    its last token (``decode_step`` or a prefill). Without ``eos_ids`` the returned state also
    carries its positions on the host (:func:`dsv41_jax.model.host_positions`), so the next
    call's checks read nothing back from the device.

    Returns :class:`GenerationResult` (tokens int32 [B, max_new_tokens] padded with -1, lengths
    int32 [B], state).

    Raises:
      ValueError (before anything runs; the state is then untouched): ``max_new_tokens`` < 1
        or not an int; ``logits`` not [B, V] with V = ``cfg.vocab_size`` and B the state's
        rows; ``pos + max_new_tokens`` above the state's capacity for a row; an EOS id outside
        [0, vocab_size) or not an int; ``seed`` not an int; an unknown ``attn_impl``; a
        ``sampling`` that is not a ``SamplingParams``; a ``mesh`` not of
        :func:`~dsv41_jax.sharding.make_mesh`, whose ``data`` axis does not divide the batch
        or whose ``expert`` axis does not divide the routed experts.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    pos = model.host_positions(state)   # no device read after prefill / decode_step
    B = pos.shape[0]
    shape = tuple(np.shape(logits))
    if shape != (B, cfg.vocab_size):
        raise ValueError(f"logits must have shape [B, V] = {[B, cfg.vocab_size]} (the state "
                         f"holds {B} rows, vocab_size {cfg.vocab_size}), got {list(shape)}")
    cap = st.capacity_of(state, cfg)
    over = pos + max_new_tokens > cap
    if over.any():
        b = int(np.argmax(over))
        raise ValueError(f"max_new_tokens={max_new_tokens}: row {b} holds {int(pos[b])} tokens "
                         f"and the state's capacity is {cap}, so at most {cap - int(pos[b])} "
                         f"new tokens fit")
    eos = _checked_eos(eos_ids, cfg)
    # raises ValueError for an unknown attn_impl or a bad mesh
    model.decode_fn(cfg, attn_impl=attn_impl, mesh=mesh)
    if mesh is not None:
        model._check_mesh(cfg, mesh, B)
        params, state = model._placed(params, cfg, state, mesh)
        logits = sharding.batch_sharded(jnp.asarray(logits, F32), mesh)
    # padded with -1 (never sampled) to a multiple of 8: up to 8 EOS ids share one program
    eos_arr = np.full((max(8, -(-len(eos) // 8) * 8),), -1, np.int32)
    eos_arr[:len(eos)] = eos
    res = _loop_jit(params, state, jnp.asarray(logits, F32), jax.random.key(int(seed)),
                    jnp.asarray(eos_arr), cfg=cfg, sampling=sampling,
                    max_new_tokens=max_new_tokens, attn_impl=attn_impl,
                    batch_invariant=bool(batch_invariant), mesh=mesh)
    if not eos:   # every row takes max_new_tokens - 1 steps: known without a device read
        model._with_host_positions(res.state, pos + max_new_tokens - 1)
    sharding.mark_placed(res.state, mesh)
    return res


def length_buckets(limit: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded lengths up to ``limit``: the powers of two from ``smallest`` below ``limit``, then
    ``limit`` itself (``length_buckets(256) == (16, 32, 64, 128, 256)``, ``length_buckets(100)
    == (16, 32, 64, 100)``, ``length_buckets(8) == (8,)``).

    Raises ``ValueError`` when ``limit`` or ``smallest`` is below 1.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if smallest < 1:
        raise ValueError(f"smallest must be >= 1, got {smallest}")
    out = []
    b = 1 << max(smallest - 1, 0).bit_length()   # the first power of two >= smallest
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out) + (limit,)


def bucket_length(n: int, buckets) -> int:
    """The smallest of ``buckets`` (ints >= 1) that is >= ``n``: the padded width of a chunk of
    ``n`` tokens.

    Raises ``ValueError`` when ``n`` < 1, ``buckets`` is empty or holds a value < 1, or ``n`` is
    above the largest bucket.
    """
    bs = sorted(int(b) for b in buckets)
    if not bs or bs[0] < 1:
        raise ValueError(f"buckets must be a non-empty list of integers >= 1, got {list(buckets)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n > bs[-1]:
        raise ValueError(f"n={n} is above the largest bucket {bs[-1]}")
    return next(b for b in bs if b >= n)


# ----------------------------------------------------------------------------- speculative


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "lengths", "state", "calls", "accepted", "row_calls",
                                "drafted"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SpeculativeResult:
    """What :func:`generate_speculative` returns: ``tokens``, ``lengths`` and ``state`` as in
    :class:`GenerationResult`; ``calls`` int32 [] (main-model calls: verify steps);
    ``accepted`` int32 [B] (positions committed per row by the verify steps while the row was
    live: its accepted drafts plus one per call); ``row_calls`` int32 [B] (verify steps while
    the row was live); ``drafted`` int32 [B] (drafts verified while the row was live). Per row,
    the mean accepted drafts per verify (the acceptance length) is ``(accepted - row_calls) /
    row_calls``, the positions per main-model call ``accepted / row_calls``."""

    tokens: Any
    lengths: Any
    state: Any
    calls: Any
    accepted: Any
    row_calls: Any
    drafted: Any


def draft_count(confidence: Float[Array, "B K"], threshold: float, kmax: int
                ) -> Int[Array, "B"]:
    """The number of drafts to verify per row, chosen from the DSpark confidence head
    (docs/architecture.md, "Speculative generation"): the leading draft positions whose
    ``sigmoid(confidence)`` is at least ``threshold``, counted up to the first one below it,
    clipped to ``1 .. kmax`` (int32 [B]; ``confidence`` fp32 [B, >= kmax], raw logits)."""
    ok = jax.nn.sigmoid(confidence[:, :kmax].astype(F32)) >= jnp.float32(threshold)
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    return jnp.clip(n, 1, kmax).astype(jnp.int32)


def _spec_loop(params, state, logits, eos, key, *, cfg: ModelConfig, sampling: SamplingParams,
               max_new_tokens: int, k: int, auto: bool, threshold: float, attn_impl: str,
               draft=None, mesh=None) -> SpeculativeResult:
    """Speculative generation as one traceable function (see :func:`generate_speculative`)."""
    draft = draft or model.draft_fn(cfg, sampling=sampling)
    verify = model.verify_fn(cfg, attn_impl=attn_impl, mesh=mesh)
    params = model.prepare_params(params, cfg)
    B, N = logits.shape[0], max_new_tokens
    key, sub = jax.random.split(key)
    first = sample(logits, sub, sampling)
    tokens = jnp.full((B, N), -1, jnp.int32).at[:, 0].set(first)
    done = (first[:, None] == eos[None, :]).any(axis=1) | (N <= 1)
    lengths = jnp.ones((B,), jnp.int32)
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    zeros = jnp.zeros((B,), jnp.int32)

    def cond(c):
        return ~c[3].all()

    def body(c):
        state, tokens, lengths, done, last, calls, accepted, row_calls, drafted, key = c
        key, k_draft, k_acc = jax.random.split(key, 3)
        out = draft(params, state, last, k_draft)
        block = out[0][:, :k + 1].astype(jnp.int32)
        q = None
        if not sampling.greedy and len(out) > 1 and out[1] is not None:
            q = probabilities(out[1][:, :k], sampling)   # what the drafts were drawn from
        if auto:
            if len(out) < 3 or out[2] is None:
                raise ValueError("drafts='auto' needs a draft that returns the confidence "
                                 "logits (ids, logits, confidence)")
            count = draft_count(out[2], threshold, k)
        else:
            count = jnp.full((B,), k, jnp.int32)
        count = jnp.where(done, 0, count)

        def verify_width(w):
            """Verify ``w`` drafts per row (``w + 1`` positions)."""
            def run(state):
                blk, cnt = block[:, :w + 1], jnp.minimum(count, w)
                qw = None if q is None else q[:, :w]

                def rule(lg):
                    return speculative_accept(lg, blk[:, 1:], qw, cnt, k_acc, sampling)[0] + 1

                lg, _, state = verify(params, state, blk, rule)
                n, tok = speculative_accept(lg, blk[:, 1:], qw, cnt, k_acc, sampling)
                return n, tok, state
            return run

        if auto and k > 1:   # the narrowest verify that holds every live row's drafts
            n, tok, state = jax.lax.switch(jnp.maximum(jnp.max(count), 1) - 1,
                                           [verify_width(w) for w in range(1, k + 1)], state)
        else:
            n, tok, state = verify_width(k)(state)
        a = n + 1
        # emitted: the accepted drafts, then the token after them
        emit = jnp.where(j == n[:, None], tok[:, None],
                         jnp.concatenate([block[:, 1:], block[:, :1]], axis=1))
        is_eos = (emit[..., None] == eos[None, None, :]).any(-1) & (j < a[:, None])
        first_eos = jnp.min(jnp.where(is_eos, j, k + 1), axis=1)
        n_emit = jnp.minimum(jnp.minimum(a, first_eos + 1), N - lengths)
        live = ~done
        write = live[:, None] & (j < n_emit[:, None])
        idx = jnp.where(write, lengths[:, None] + j, N)
        tokens = tokens.at[jnp.arange(B)[:, None], idx].set(emit, mode="drop")
        new_len = lengths + jnp.where(live, n_emit, 0)
        done = done | (live & ((first_eos < a) | (new_len >= N)))
        return (state, tokens, new_len, done, jnp.where(live, tok, last), calls + 1,
                accepted + jnp.where(live, a, 0), row_calls + live.astype(jnp.int32),
                drafted + count, key)

    c = (state, tokens, lengths, done, first, jnp.zeros((), jnp.int32), zeros, zeros, zeros,
         key)
    state, tokens, lengths, done, last, calls, accepted, row_calls, drafted, key = \
        jax.lax.while_loop(cond, body, c)
    return SpeculativeResult(tokens=tokens, lengths=lengths, state=state, calls=calls,
                             accepted=accepted, row_calls=row_calls, drafted=drafted)


_spec_jit = saved_steps.SavedJit(_spec_loop,
                                 static_argnames=("cfg", "sampling", "max_new_tokens", "k", "auto",
                                                  "threshold", "attn_impl", "draft", "mesh"),
                                 donate_argnames=("state",))


def generate_speculative(params, cfg: ModelConfig, state, logits, *, max_new_tokens: int,
                         drafts: int | str | None = None,
                         sampling: SamplingParams = SamplingParams(), eos_ids=(), seed: int = 0,
                         confidence_threshold: float = 0.5, attn_impl: str = "auto",
                         draft=None, mesh=None) -> SpeculativeResult:
    """Generation with DSpark speculation, on the device (docs/architecture.md, "Speculative
    generation"): each loop iteration drafts tokens after each row's latest token
    (:func:`dsv41_jax.model.draft`, sampled with ``sampling``), verifies them in one
    main-model call (:func:`dsv41_jax.model.verify`) and emits the accepted drafts and the
    main model's token after them.

    Greedy (``sampling.greedy``): a draft is accepted when it is the main model's argmax, so
    the tokens are those of greedy :func:`generate` (up to the summation order of a ``k +
    1``-row call against a one-row decode step). Sampled: rejection sampling against the
    draft's distribution after the Markov correction
    (:func:`dsv41_jax.sampling.speculative_accept`), so every emitted token follows the main
    model's distribution under ``sampling`` (temperature, top-k, top-p), as in
    :func:`generate`; the random bits differ from :func:`generate`'s, so the tokens do too.

    Args: as :func:`generate`, and
      drafts: draft tokens per call, an int in 1 .. :func:`dsv41_jax.model.max_drafts` (None:
        the most), or ``"auto"``: per row and call, :func:`draft_count` of the confidence head
        with ``confidence_threshold`` (in [0, 1]), at most the most; the verify then runs the
        narrowest of the ``max_drafts`` compiled widths that holds every live row's count.
      draft: a traceable ``(params, state, last int32 [B], key) -> (ids int32 [B, >= k + 1],
        [logits fp32 [B, >= k, V], [confidence fp32 [B, >= k]]])`` in place of DSpark
        (:func:`dsv41_jax.model.draft_fn`), e.g. an oracle for an upper bound or a test;
        ``ids[:, 0]`` must be ``last``. With logits the drafts must be drawn from
        ``probabilities(logits, sampling)``; without, they count as deterministic.
        ``drafts="auto"`` needs the confidence (else ``ValueError`` when the loop is traced,
        before it runs).
      mesh: a device mesh (:func:`dsv41_jax.sharding.make_mesh`) to run on, or None (one
        device), as in :func:`generate`: the parameters placed by
        :func:`~dsv41_jax.sharding.shard_params`, the state by
        :func:`~dsv41_jax.sharding.shard_state`, the logits split by rows over ``data``
        (docs/architecture.md, "Sharding"). The verify steps run the main model as
        :func:`dsv41_jax.model.verify` does on the mesh (routed experts expert parallel); the
        DSpark head, whose parameters the table replicates, runs where the compiler puts it
        (its experts are never split over ``expert``). The returned state stays on the mesh.

    A row that is done keeps committing one position per call. Needs room for ``pos +
    max_new_tokens + k`` tokens (``k``: the most drafts).

    Returns :class:`SpeculativeResult` (tokens int32 [B, max_new_tokens] padded with -1,
    lengths, accepted, row_calls, drafted int32 [B], calls int32 []); its state holds, per
    row, every emitted token but the last (a row's last emitted token is the next input), plus
    one position per call after the row was done. Raises ``ValueError`` (nothing runs; the
    state untouched) for a config, state or params without DSpark, ``drafts`` out of range, a
    ``confidence_threshold`` outside [0, 1], or what :func:`generate` refuses (a ``mesh`` not
    of :func:`~dsv41_jax.sharding.make_mesh`, whose ``data`` axis does not divide the batch
    or whose ``expert`` axis does not divide the routed experts included).
    """
    if draft is None and (not cfg.dspark_on or state.dspark is None or "dspark" not in params):
        raise ValueError("speculative generation needs DSpark: a config with it on, its state "
                         "and params with the draft head (mtp.*)")
    kmax = model.max_drafts(cfg)
    auto = isinstance(drafts, str) and drafts == "auto"
    k = kmax if drafts is None or auto else drafts
    if isinstance(k, (bool, str)) or not isinstance(k, (int, np.integer)) \
            or not 1 <= k <= kmax:
        raise ValueError(f"drafts must be an integer in [1, {kmax}] or 'auto', got {drafts!r}")
    t = confidence_threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
        raise ValueError(f"confidence_threshold must be a number in [0, 1], got {t!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    pos = model.host_positions(state)
    B = pos.shape[0]
    if tuple(np.shape(logits)) != (B, cfg.vocab_size):
        raise ValueError(f"logits must have shape [B, V] = {[B, cfg.vocab_size]} (the state "
                         f"holds {B} rows, vocab_size {cfg.vocab_size}), got "
                         f"{list(np.shape(logits))}")
    cap = st.capacity_of(state, cfg)
    over = pos + max_new_tokens + k > cap
    if over.any():
        b = int(np.argmax(over))
        raise ValueError(f"max_new_tokens={max_new_tokens} with {k} drafts: row {b} holds "
                         f"{int(pos[b])} tokens and the state's capacity is {cap}, so at most "
                         f"{cap - int(pos[b]) - k} new tokens fit")
    eos = _checked_eos(eos_ids, cfg)
    # raises ValueError for an unknown attn_impl or a bad mesh
    model.verify_fn(cfg, attn_impl=attn_impl, mesh=mesh)
    model._check_mesh(cfg, mesh, B)
    params, state = model._placed(params, cfg, state, mesh)
    logits = sharding.batch_sharded(jnp.asarray(logits, F32), mesh)
    eos_arr = np.full((max(8, -(-len(eos) // 8) * 8),), -1, np.int32)
    eos_arr[:len(eos)] = eos
    res = _spec_jit(params, state, logits, jnp.asarray(eos_arr), jax.random.key(int(seed)),
                    cfg=cfg, sampling=sampling, max_new_tokens=int(max_new_tokens), k=int(k),
                    auto=auto, threshold=float(t), attn_impl=attn_impl, draft=draft, mesh=mesh)
    sharding.mark_placed(res.state, mesh)
    return res


def speculative_stats(res: SpeculativeResult) -> dict:
    """The measurements of a :class:`SpeculativeResult` over its rows (counted while
    each row was live): ``verify_calls`` (main-model calls of the loop),
    ``acceptance_length`` (mean drafts accepted per verify), ``draft_acceptance_rate``
    (accepted / verified drafts) and ``tokens_per_call`` (tokens the verify calls emitted per
    call: the acceptance length + 1, less what EOS or ``max_new_tokens`` cut)."""
    calls = np.asarray(res.row_calls).astype(np.int64)
    acc = np.asarray(res.accepted).astype(np.int64) - calls
    drafted = np.asarray(res.drafted).astype(np.int64)
    emitted = np.asarray(res.lengths).astype(np.int64) - 1
    n = max(int(calls.sum()), 1)
    return {"verify_calls": int(res.calls), "acceptance_length": float(acc.sum() / n),
            "draft_acceptance_rate": float(acc.sum() / max(int(drafted.sum()), 1)),
            "tokens_per_call": float(emitted.sum() / n), "drafts_verified": int(drafted.sum())}
