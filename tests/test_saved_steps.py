"""Saved steps (:mod:`dsv41_jax.saved_steps`): a process saves its traced programs beside the
persistent compilation cache and a later process runs them without tracing, with the same
results. Each run is a subprocess, so this test process's JAX configuration is left alone; in
the loading runs ``jax.export.export`` raises, so a result there can only come from a file."""

import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOY = """
import json, sys
from unittest import mock
import jax, jax.numpy as jnp, numpy as np
from dsv41_jax import compile_cache, saved_steps

class Placed:                      # a static argument that names a mesh: never saved
    mesh = "a mesh"
    def __hash__(self): return 1
    def __eq__(self, o): return isinstance(o, Placed)
    def __repr__(self): return "Placed()"

def step(x, s, *, k, tag=None):
    return {"y": x * k + s.sum()}, s + 1

compile_cache.enable(sys.argv[1])
f = saved_steps.SavedJit(step, static_argnames=("k", "tag"), donate_argnames=("s",))
res = {}
with mock.patch.object(jax.export, "export", side_effect=RuntimeError("no export")) \\
        if sys.argv[2] == "load" else mock.patch.object(np, "e", np.e):
    for name, n, tag in (("a", 3, None), ("b", 5, None), ("obj", 3, object()),
                         ("mesh", 3, Placed())):
        s = jnp.arange(4.0) + n
        out, s2 = f(jnp.arange(float(n)), s, k=2.0, tag=tag)
        res[name] = {"y": np.asarray(out["y"]).tolist(), "s": np.asarray(s2).tolist(),
                     "donated": s.is_deleted()}
    # arrays a call returned (placed on the device) and fresh ones share one compiled program
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name.endswith("backend_compile_duration")
        else None)
    out, s2 = f(jnp.arange(3.0), jnp.arange(4.0), k=2.0, tag=None)
    out, s3 = f(jax.device_put(jnp.arange(3.0), jax.devices()[0]), s2, k=2.0, tag=None)
    compiled = len(compiles)
print(json.dumps({"res": res, "files": sorted(os.listdir(saved_steps.directory())),
                  "programs": sorted(p is not False for p in f._programs.values()),
                  "compiled": compiled}))
"""

MODEL = """
import hashlib, json, sys
from unittest import mock
import jax, numpy as np
from benchmarks.config import e2e_config
from dsv41_jax import compile_cache, generation, model, saved_steps, state as st
from dsv41_jax.random_weights import random_params_device

if sys.argv[1] != "off":
    compile_cache.enable(sys.argv[1])
cfg, _ = e2e_config("tiny")
params = model.prepare_params(random_params_device(cfg, 0), cfg)
ids = (np.arange(40, dtype=np.int32)[None] * 7) % 200 + 3
with mock.patch.object(jax.export, "export", side_effect=RuntimeError("no export")) \\
        if sys.argv[2] == "load" else mock.patch.object(np, "e", np.e):
    out, s = model.prefill(params, cfg, ids, st.init_state(cfg, 1, 96))
    lg, s = model.decode_step(params, cfg, s, np.array([5], np.int32))
    res = generation.generate(params, cfg, s, lg, max_new_tokens=4, eos_ids=[])
h = hashlib.sha256()
for a in (out.logits, lg, res.tokens, res.state.pos):
    h.update(np.asarray(a).tobytes())
d = saved_steps.directory()
programs = [p is not False for j in (model._chunk_jit, generation._loop_jit)
            for p in j._programs.values()]
print(json.dumps({"hash": h.hexdigest(), "files": sorted(os.listdir(d)) if d else None,
                  "programs": programs}))
"""


def _run(script: str, *argv) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", "import os\n" + script, *map(str, argv)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_saved_programs_are_loaded_by_the_next_process(tmp_path):
    first = _run(TOY, tmp_path, "save")
    # two shapes, two files; the object address and the mesh keep theirs off the disk
    assert len(first["files"]) == 2 and all(f.startswith("step-") and f.endswith(".jaxexport")
                                            for f in first["files"])
    res = first["res"]
    assert res["a"] == {"y": [18.0, 20.0, 22.0], "s": [4.0, 5.0, 6.0, 7.0], "donated": True}
    assert res["b"]["y"] == [26.0 + 2 * i for i in range(5)] and res["b"]["donated"]
    assert res["obj"] == res["a"] and res["mesh"] == res["a"]
    assert first["programs"] == [False, True, True]     # the object's call took plain jit
    assert first["compiled"] == 0     # both calls ran the program compiled for the first

    d = tmp_path / "dsv41-steps"
    before = {f: _digest(d / f) for f in first["files"]}
    second = _run(TOY, tmp_path, "load")          # jax.export.export raises in there
    assert second == first
    assert {f: _digest(d / f) for f in second["files"]} == before

    (d / first["files"][0]).write_bytes(b"truncated")   # unreadable: exported and written again
    third = _run(TOY, tmp_path, "save")
    assert third == first
    assert {f: _digest(d / f) for f in third["files"]} == before


def test_model_steps_saved_and_loaded_give_the_same_bits(tmp_path):
    plain = _run(MODEL, "off", "save")
    first = _run(MODEL, tmp_path, "save")
    assert plain["files"] is None and plain["programs"] == []
    assert first["hash"] == plain["hash"] and first["programs"] == [True, True, True]
    # the CED prefill chunk, the decode step and the generation loop
    assert [f.split("-")[0] for f in first["files"]] == ["_chunk_rows", "_chunk_rows", "_loop"]
    second = _run(MODEL, tmp_path, "load")
    assert second == first


SETTING = """
import json, sys
from unittest import mock
import jax, jax.numpy as jnp, numpy as np
from dsv41_jax import compile_cache, saved_steps
from dsv41_jax.layers import moe

def step(x):
    return x * moe.GATHERED_PAIRS          # a module setting the trace reads

compile_cache.enable(sys.argv[1])
f = saved_steps.SavedJit(step)
res = []
with mock.patch.object(jax.export, "export", side_effect=RuntimeError("no export")) \\
        if sys.argv[2] == "load" else mock.patch.object(np, "e", np.e):
    for value in sys.argv[3:]:
        moe.GATHERED_PAIRS = int(value)
        res.append(float(f(jnp.ones(()))))
print(json.dumps({"res": res, "changed": saved_steps.changed_settings(),
                  "files": sorted(os.listdir(saved_steps.directory()))}))
"""


def test_a_changed_setting_is_part_of_the_key(tmp_path):
    """A module setting set by the caller (``moe.GATHERED_PAIRS``, default 64) keys the
    programs: in one process the step is traced again after the change, and a later process
    loads the program saved for its own value, not the other."""
    first = _run(SETTING, tmp_path, "save", 64, 3)
    assert first["res"] == [64.0, 3.0]
    assert first["changed"] == [["dsv41_jax.layers.moe.GATHERED_PAIRS", "3"]]
    assert len(first["files"]) == 2
    for value in (3, 64):                          # export raises: each result is from a file
        again = _run(SETTING, tmp_path, "load", value)
        assert again["res"] == [float(value)] and again["files"] == first["files"]


def test_changed_settings(monkeypatch):
    from dsv41_jax import model, saved_steps
    import pallas_kernels.gemv as gemv
    import pallas_kernels.gemv.triton as gemv_triton

    names = lambda: dict(saved_steps.changed_settings())      # noqa: E731
    before = names()
    assert not {"dsv41_jax.model.UNROLL_DECODE_UNITS", "pallas_kernels.gemv.AUTO_MAX_ROWS",
                "pallas_kernels.gemv.triton.MAX_TILE_ROWS"} & set(before)
    monkeypatch.setattr(model, "UNROLL_DECODE_UNITS", "always")
    monkeypatch.setattr(gemv, "AUTO_MAX_ROWS", 16)          # source: triton.MAX_TILE_ROWS
    assert names() == {**before, "dsv41_jax.model.UNROLL_DECODE_UNITS": "'always'",
                       "pallas_kernels.gemv.AUTO_MAX_ROWS": "16"}
    # the alias follows the setting it names: MAX_ROWS (= triton.MAX_TILE_ROWS) now differs
    monkeypatch.setattr(gemv_triton, "MAX_TILE_ROWS", 32)
    assert {"pallas_kernels.gemv.triton.MAX_TILE_ROWS": "32",
            "pallas_kernels.gemv.MAX_ROWS": "64"}.items() <= names().items()
    monkeypatch.undo()
    monkeypatch.setattr(model, "UNROLL_DECODE_UNITS", "".join(model.UNROLL_DECODE_UNITS))
    assert names() == before        # an equal value (another object) is not a change
    monkeypatch.undo()
    assert names() == before
