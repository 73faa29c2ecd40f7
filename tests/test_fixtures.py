"""The in-repo reference fixtures (``dsv41_jax.testing.fixtures``) and the checked annotations."""

import hashlib
import io
import json
import multiprocessing
import os
import shutil
import tarfile

import jax.numpy as jnp
import jaxtyping
import pytest

from dsv41_jax.layers.linear import rms_norm
from dsv41_jax.testing import fixtures

NAMES = ("tiny-a", "tiny-a-bf16", "tiny-engram", "tiny-vl")


def _archive(tmp_path, name="tiny-x", files=None, sums=None):
    """A small ``<name>.tar.xz`` in ``tmp_path/archives`` with its SHA256SUMS line (or
    ``sums``' lines); returns the archive directory."""
    files = files if files is not None else {f"{name}/manifest.json": b'{"cases": []}',
                                             f"{name}/config.json": b"{}"}
    d = tmp_path / "archives"
    d.mkdir(exist_ok=True)
    path = d / f"{name}.tar.xz"
    with tarfile.open(path, "w:xz") as tar:
        for member, data in files.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    lines = sums if sums is not None else [f"{digest}  {name}.tar.xz"]
    (d / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return str(d)


def test_repository_archives_listed_and_verified():
    """Every fixture the suite uses has an archive in fixtures/reference and a checksum entry,
    and the archives match their checksums."""
    sums = fixtures.read_checksums(str(fixtures.ARCHIVE_DIR))
    assert sorted(sums) == sorted(f"{n}.tar.xz" for n in NAMES)
    for n in NAMES:
        assert fixtures.sha256(str(fixtures.ARCHIVE_DIR / f"{n}.tar.xz")) == sums[f"{n}.tar.xz"], n


def test_fixture_dir_extracts_repository_archive(monkeypatch):
    monkeypatch.delenv("DSV41_FIXTURES", raising=False)
    path = fixtures.fixture_dir("tiny-vl")
    assert os.path.basename(path).startswith("tiny-vl-")
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert {c["name"] for c in manifest["cases"]} >= {"vl_grad", "batch2_vl"}
    for f in ("config.json", "weights.safetensors", "grad_56x42.png", "vl_grad.npz"):
        assert os.path.isfile(os.path.join(path, f)), f


def test_extract_once(tmp_path):
    d = _archive(tmp_path)
    cache = str(tmp_path / "cache")
    path = fixtures.extract("tiny-x", d, cache)
    assert path == os.path.join(cache, os.path.basename(path))
    assert open(os.path.join(path, "manifest.json")).read() == '{"cases": []}'
    assert sorted(os.listdir(path)) == ["config.json", "manifest.json"]
    os.remove(os.path.join(path, "config.json"))      # a second call reuses the directory
    assert fixtures.extract("tiny-x", d, cache) == path
    assert sorted(os.listdir(path)) == ["manifest.json"]
    assert os.listdir(cache) == [os.path.basename(path)]   # no temporary directory left


def test_extract_lost_race(tmp_path, monkeypatch):
    """A process whose rename finds the directory already renamed into place by another uses
    that one and removes its own copy."""
    d = _archive(tmp_path)
    cache = tmp_path / "cache"
    real_rename = os.rename

    def rename_after_winner(src, dst):
        shutil.copytree(src, dst)                      # the other process got there first
        (cache / "winner").write_text("")
        real_rename(src, dst)                          # fails: dst exists and is not empty

    monkeypatch.setattr(fixtures.os, "rename", rename_after_winner)
    path = fixtures.extract("tiny-x", d, str(cache))
    assert sorted(os.listdir(path)) == ["config.json", "manifest.json"]
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(path), "winner"])


def test_extract_concurrent(tmp_path):
    """Processes extracting the same archive at once all get the same complete directory."""
    big = os.urandom(4 << 20)                          # incompressible: extraction takes a while
    d = _archive(tmp_path, files={"tiny-x/manifest.json": b"{}", "tiny-x/weights.bin": big})
    cache = str(tmp_path / "cache")
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        paths = pool.starmap(fixtures.extract, [("tiny-x", d, cache)] * 3)
    assert len(set(paths)) == 1
    assert open(os.path.join(paths[0], "weights.bin"), "rb").read() == big
    assert os.listdir(cache) == [os.path.basename(paths[0])]


def test_corrupt_archive_raises(tmp_path):
    d = _archive(tmp_path)
    path = os.path.join(d, "tiny-x.tar.xz")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"tiny-x.*has sha256 .*SHA256SUMS says"):
        fixtures.extract("tiny-x", d, str(tmp_path / "cache"))
    assert not os.path.exists(tmp_path / "cache")


def test_wrong_checksum_raises(tmp_path):
    d = _archive(tmp_path, sums=["0" * 64 + "  tiny-x.tar.xz"])
    with pytest.raises(ValueError, match="0000000000000000"):
        fixtures.extract("tiny-x", d, str(tmp_path / "cache"))


def test_missing_pieces_raise(tmp_path):
    d = _archive(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'tiny-y'.*known fixtures: tiny-x"):
        fixtures.extract("tiny-y", d, str(tmp_path / "cache"))
    os.remove(os.path.join(d, "tiny-x.tar.xz"))
    with pytest.raises(FileNotFoundError, match=r"archive .*tiny-x\.tar\.xz not found"):
        fixtures.extract("tiny-x", d, str(tmp_path / "cache"))
    os.remove(os.path.join(d, "SHA256SUMS"))
    with pytest.raises(FileNotFoundError, match="SHA256SUMS not found"):
        fixtures.extract("tiny-x", d, str(tmp_path / "cache"))


def test_archive_with_foreign_paths_raises(tmp_path):
    d = _archive(tmp_path, files={"tiny-x/manifest.json": b"{}", "elsewhere/x": b""})
    with pytest.raises(ValueError, match=r"holds 'elsewhere/x'"):
        fixtures.extract("tiny-x", d, str(tmp_path / "cache"))


def test_override_directory(tmp_path, monkeypatch):
    (tmp_path / "tiny-a").mkdir()
    (tmp_path / "tiny-a" / "manifest.json").write_text("{}")
    monkeypatch.setenv("DSV41_FIXTURES", str(tmp_path))
    assert fixtures.fixture_dir("tiny-a") == str(tmp_path / "tiny-a")
    with pytest.raises(FileNotFoundError, match=r"'tiny-vl'.*tiny-vl/manifest\.json not found"):
        fixtures.fixture_dir("tiny-vl")


def test_cache_directory_override(tmp_path, monkeypatch):
    monkeypatch.delenv("DSV41_FIXTURES", raising=False)
    monkeypatch.setenv("DSV41_FIXTURES_CACHE", str(tmp_path))
    path = fixtures.fixture_dir("tiny-vl")
    assert os.path.dirname(path) == str(tmp_path)
    assert os.path.isfile(os.path.join(path, "manifest.json"))
    shutil.rmtree(path)


def test_annotations_are_checked():
    """The test suite runs with jaxtyping's import hook (tests/conftest.py): a call whose shapes
    contradict the annotations fails, eagerly and under tracing."""
    x = jnp.ones((2, 8), jnp.bfloat16)
    assert rms_norm(x, jnp.ones((8,), jnp.float32), 1e-6).shape == (2, 8)
    with pytest.raises(jaxtyping.TypeCheckError):
        rms_norm(x, jnp.ones((4,), jnp.float32), 1e-6)
    with pytest.raises(jaxtyping.TypeCheckError):
        rms_norm(jnp.ones((2, 8), jnp.int32), jnp.ones((8,), jnp.float32), 1e-6)


def test_command_line(capsys, monkeypatch):
    monkeypatch.delenv("DSV41_FIXTURES", raising=False)
    assert fixtures.main(["tiny-vl"]) == 0
    name, path = capsys.readouterr().out.split()
    assert name == "tiny-vl" and os.path.isfile(os.path.join(path, "manifest.json"))
    assert fixtures.main(["tiny-b"]) == 1
    assert "known fixtures: tiny-a, tiny-a-bf16, tiny-engram, tiny-vl" in capsys.readouterr().err
