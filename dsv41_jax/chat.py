"""The DeepSeek chat format (V3.1 / V4) and stop strings.

One user turn, ready for the assistant's answer::

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜><think>     (thinking)
    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>    (non-thinking)

The text starts with the BOS token, so it is encoded without another BOS
(:func:`chat_ids`). The assistant's answer ends with ``<｜end▁of▁sentence｜>`` (id 1), the
default stop of ``dsv41-generate``.
"""

from __future__ import annotations

import tokenizers

from dsv41_jax import tokenizer

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
#: The special tokens of the format; each is one id of the tokenizer.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, THINK_START, THINK_END)


def _check_text(name: str, text: str) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a str, got {type(text).__name__}")
    for t in (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN):
        if t in text:
            raise ValueError(f"{name} contains the special token {t!r}, which would change the "
                             f"turn structure")


def format_chat(user_text: str, *, thinking: bool, system: str | None = None) -> str:
    """One user turn in the DeepSeek chat format, ending where the assistant's answer starts:
    ``BOS + system + <｜User｜> + user_text + <｜Assistant｜>`` then ``<think>`` (``thinking``)
    or ``</think>`` (not thinking). ``system`` ``None`` or ``""``: no system prompt.

    Raises ``ValueError`` when ``user_text`` or ``system`` is not a str or contains the BOS,
    EOS, User or Assistant token.
    """
    _check_text("user_text", user_text)
    if system is not None:
        _check_text("system", system)
    return (f"{BOS_TOKEN}{system or ''}{USER_TOKEN}{user_text}{ASSISTANT_TOKEN}"
            f"{THINK_START if thinking else THINK_END}")


def check_special_tokens(tok: tokenizers.Tokenizer) -> dict[str, int]:
    """Id of each of :data:`SPECIAL_TOKENS` in ``tok``; raises ``ValueError`` when one is not a
    single token, or when BOS / EOS are not ids :data:`dsv41_jax.tokenizer.BOS_ID` /
    :data:`~dsv41_jax.tokenizer.EOS_ID`."""
    ids = {}
    for t in SPECIAL_TOKENS:
        enc = tok.encode(t, add_special_tokens=False).ids
        if len(enc) != 1 or tok.token_to_id(t) != enc[0]:
            raise ValueError(f"the tokenizer encodes {t!r} as {enc}, not as one special token")
        ids[t] = enc[0]
    for t, want in ((BOS_TOKEN, tokenizer.BOS_ID), (EOS_TOKEN, tokenizer.EOS_ID)):
        if ids[t] != want:
            raise ValueError(f"the tokenizer's {t!r} is id {ids[t]}, expected {want}")
    return ids


def chat_ids(tok: tokenizers.Tokenizer, user_text: str, *, thinking: bool,
             system: str | None = None) -> list[int]:
    """Token ids of :func:`format_chat`: BOS (id 0) once, at the front (the tokenizer adds no
    BOS of its own; the text carries it). Raises ``ValueError`` as :func:`format_chat`."""
    ids = tokenizer.encode(tok, format_chat(user_text, thinking=thinking, system=system),
                           bos=False)
    if ids[0] != tokenizer.BOS_ID or ids.count(tokenizer.BOS_ID) != 1:
        raise ValueError(f"the chat text encodes with BOS (id {tokenizer.BOS_ID}) "
                         f"{ids.count(tokenizer.BOS_ID)} times, expected once at the front")
    return ids


def eos_id(tok: tokenizers.Tokenizer) -> int:
    """Id of ``<｜end▁of▁sentence｜>`` in ``tok`` (1 in the DeepSeek tokenizer); raises
    ``ValueError`` when ``tok`` lacks it."""
    i = tok.token_to_id(EOS_TOKEN)
    if i is None:
        raise ValueError(f"the tokenizer has no {EOS_TOKEN!r} token")
    return i


def truncate_at_stop(text: str, stops) -> tuple[str, bool]:
    """``(text before the earliest occurrence of any of stops, True)``, or ``(text, False)``
    when none occurs. The stop string itself is cut off. Raises ``ValueError`` for an empty stop
    string or one that is not a str."""
    cut = len(text)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stops: {s!r} is not a non-empty string")
        i = text.find(s)
        if 0 <= i < cut:
            cut = i
    return text[:cut], cut < len(text)
