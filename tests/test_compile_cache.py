"""The persistent compilation cache setup (:mod:`dsv41_jax.compile_cache`): where the directory
comes from, and that a second process loads what the first compiled (run in subprocesses, so
this test process's JAX configuration is left alone)."""

import json
import os
import subprocess
import sys

import pytest

from dsv41_jax import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from dsv41_jax import compile_cache
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
path = compile_cache.enable(sys.argv[1])
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(5.0)).block_until_ready()
print(json.dumps({"path": path, "hits": len(hits),
                  "dir": jax.config.jax_compilation_cache_dir,
                  "min_time": jax.config.jax_persistent_cache_min_compile_time_secs,
                  "min_size": jax.config.jax_persistent_cache_min_entry_size_bytes,
                  "xla": jax.config.jax_persistent_cache_enable_xla_caches}))
"""


def _run(cache_dir) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(cache_dir)], capture_output=True,
                       text=True, env=env, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_enable_caches_every_program_and_a_second_process_loads_it(tmp_path):
    d = tmp_path / "new" / "cache"
    first = _run(d)
    assert first == {"path": str(d), "hits": 0, "dir": str(d), "min_time": 0.0,
                     "min_size": -1, "xla": "xla_gpu_per_fusion_autotune_cache_dir"}
    entries = [f for f in os.listdir(d) if f.startswith("jit_")]
    assert entries, os.listdir(d)
    second = _run(d)
    assert second["hits"] >= 1
    assert sorted(f for f in os.listdir(d) if f.startswith("jit_")) == sorted(entries)


def test_resolve(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    assert compile_cache.resolve(None) == os.path.expanduser("~/.cache/dsv41-jax/jax-cache")
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.resolve(None) == str(tmp_path / "env")
    assert compile_cache.resolve(str(tmp_path / "arg")) == str(tmp_path / "arg")
    assert compile_cache.resolve("~/c") == os.path.expanduser("~/c")
    for off in ("none", "NONE", " None "):
        assert compile_cache.resolve(off) is None
    monkeypatch.setenv(compile_cache.ENV_VAR, "none")
    assert compile_cache.resolve(None) is None
    monkeypatch.setenv(compile_cache.ENV_VAR, "")
    assert compile_cache.resolve(None) == os.path.expanduser("~/.cache/dsv41-jax/jax-cache")
    with pytest.raises(ValueError, match="compile cache directory: empty"):
        compile_cache.resolve("  ")


def test_enable_refuses_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ValueError, match=f"directory: {f} exists and is not a directory"):
        compile_cache.enable(str(f))
    with pytest.raises(ValueError, match="directory: empty"):
        compile_cache.enable("")
