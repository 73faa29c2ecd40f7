"""The reference fixtures of the repository, extracted on demand.

``fixtures/reference/`` at the repository root holds one ``<name>.tar.xz`` per fixture directory
(``tiny-a``, ``tiny-a-bf16``, ``tiny-engram``, ``tiny-vl``; layout and meaning in its
``README.md``) and ``SHA256SUMS`` (``sha256sum`` format) with each archive's checksum.
:func:`fixture_dir` verifies an archive against that checksum, extracts it once into a cache
directory and returns the extracted directory.

Environment:

* ``DSV41_FIXTURES``: a directory holding the fixture directories already extracted
  (``$DSV41_FIXTURES/tiny-a/manifest.json``, ...); when set, it is used instead of the archives.
* ``DSV41_FIXTURES_CACHE``: where archives are extracted (default ``<repo>/.fixtures-cache``,
  git-ignored). Each archive goes to ``<cache>/<name>-<first 16 hex digits of its sha256>/``,
  so a changed archive gets a new directory.

Extraction is safe with several processes at once (pytest-xdist workers): each extracts into its
own temporary directory inside the cache and renames it into place; the rename is atomic, and a
process that finds the directory already renamed by another uses that one.

``python -m dsv41_jax.testing.fixtures [NAME ...]`` extracts fixtures ahead of time (all by
default; ``scripts/setup.sh`` runs it) and prints where each one is.
"""

import argparse
import functools
import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ARCHIVE_DIR = REPO_ROOT / "fixtures" / "reference"
CHECKSUMS = "SHA256SUMS"
SUFFIX = ".tar.xz"


def fixture_dir(name: str) -> str:
    """The directory of reference fixture ``name`` (e.g. ``"tiny-a"``), extracted if needed.

    Returns the path of a directory holding ``config.json``, ``manifest.json``,
    ``weights.safetensors`` and the case files. With ``DSV41_FIXTURES`` set, returns
    ``$DSV41_FIXTURES/<name>``; otherwise extracts ``fixtures/reference/<name>.tar.xz`` into the
    cache (``DSV41_FIXTURES_CACHE``, default ``<repo>/.fixtures-cache``) once per archive.

    Raises ``FileNotFoundError`` naming the missing directory, archive or checksum file, and
    ``ValueError`` for an archive whose sha256 differs from ``SHA256SUMS`` or that holds anything
    but regular files under ``<name>/``.
    """
    override = os.environ.get("DSV41_FIXTURES")
    if override:
        path = Path(override) / name
        if not (path / "manifest.json").is_file():
            raise FileNotFoundError(
                f"fixture {name!r}: {path}/manifest.json not found (DSV41_FIXTURES={override} "
                f"must hold the extracted fixture directories; unset it to use the archives in "
                f"{ARCHIVE_DIR})")
        return str(path)
    cache = os.environ.get("DSV41_FIXTURES_CACHE") or str(REPO_ROOT / ".fixtures-cache")
    return _extracted(name, str(ARCHIVE_DIR), cache)


@functools.cache
def _extracted(name: str, archive_dir: str, cache_dir: str) -> str:
    """``extract(name, archive_dir, cache_dir)``, once per process."""
    return extract(name, archive_dir, cache_dir)


def read_checksums(archive_dir: str) -> dict[str, str]:
    """``{file name: sha256 hex}`` from ``<archive_dir>/SHA256SUMS`` (``sha256sum`` format)."""
    path = Path(archive_dir) / CHECKSUMS
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the reference fixtures' checksums are missing (the fixtures ship "
            f"with a checkout of the repository, not with an installed package; or set "
            f"DSV41_FIXTURES to a directory of extracted fixtures)")
    sums = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, file = line.split(maxsplit=1)
            sums[file.lstrip("*")] = digest.lower()
    return sums


def sha256(path: str) -> str:
    """The sha256 hex digest of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def extract(name: str, archive_dir: str, cache_dir: str) -> str:
    """Verify ``<archive_dir>/<name>.tar.xz`` against ``SHA256SUMS`` and extract it (once).

    Returns ``<cache_dir>/<name>-<sha256[:16]>``. The archive is checked on every call; an
    existing extracted directory is reused (it only ever appears complete, by an atomic rename).
    Errors as :func:`fixture_dir`.
    """
    file = name + SUFFIX
    archive = Path(archive_dir) / file
    sums = read_checksums(archive_dir)
    if file not in sums:
        known = sorted(f.removesuffix(SUFFIX) for f in sums)
        raise FileNotFoundError(
            f"fixture {name!r}: no entry {file} in {Path(archive_dir) / CHECKSUMS} "
            f"(known fixtures: {', '.join(known)})")
    if not archive.is_file():
        raise FileNotFoundError(f"fixture {name!r}: archive {archive} not found")
    digest = sha256(str(archive))
    if digest != sums[file]:
        raise ValueError(f"fixture {name!r}: {archive} has sha256 {digest}, {CHECKSUMS} says "
                         f"{sums[file]} (corrupt or partial file; restore it from git)")
    target = Path(cache_dir) / f"{name}-{digest[:16]}"
    if target.is_dir():
        return str(target)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir)
    try:
        with tarfile.open(archive, "r:xz") as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if parts[0] != name or ".." in parts or not (member.isfile() or member.isdir()):
                    raise ValueError(f"fixture {name!r}: {archive} holds {member.name!r}; "
                                     f"expected only regular files under {name}/")
            tar.extractall(tmp, filter="data")
        try:
            os.rename(os.path.join(tmp, name), target)
        except OSError:
            if not target.is_dir():   # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def main(argv: list[str] | None = None) -> int:
    """``python -m dsv41_jax.testing.fixtures [NAME ...]``: extract the named fixtures (default:
    every archive in ``fixtures/reference``) and print one ``name path`` line each."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("names", nargs="*", help="fixture names (default: all)")
    args = ap.parse_args(argv)
    try:
        names = args.names or sorted(f.removesuffix(SUFFIX)
                                     for f in read_checksums(str(ARCHIVE_DIR)))
        for name in names:
            print(name, fixture_dir(name))
    except (FileNotFoundError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
