"""Tensor, expert and data parallelism over a device mesh (docs/architecture.md, "Sharding"):
the sharded prefill and decode, generation loop, speculative generation (DSpark drafts and
``verify``) and forward against the single-device ones, the MoE's expert parallelism on its
own, the placement table, and the ``ValueError`` s of bad meshes.

The sharded checks need 8 devices: on the CPU, ``--xla_force_host_platform_device_count=8``,
which must be in ``XLA_FLAGS`` before JAX starts its backend. When this module is run in a
process with fewer devices (the usual test run), :func:`test_sharded_in_subprocess` runs the
module again in a subprocess with the flag set, and the 8-device tests skip in the parent.
Slow: about 5-6 minutes on 2 idle CPU cores (up to 19 beside another test worker), nearly all
of it compiling (the single-device
reference and four meshes, a prefill and a decode step each, on the smallest config with every
layer role; the generation loop on the four meshes, ~15 s each; ``forward`` on one mesh and one
device, ~20 s; the speculative loop on two meshes and one device, with a ``verify`` each
side, ~70 s; the MoE checks take 15 s; the orbax round trip 7 s; the sliced loading 12 s).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dsv41_jax  # noqa: F401  (XLA numerics flags before JAX starts)
from dsv41_jax import converted, generation, model, sharding, state as st
from dsv41_jax.layers import moe as moe_layer

from benchmarks.config import identity_token_map, tiny_config

N_DEV = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_8 = jax.device_count() >= N_DEV
needs_8 = pytest.mark.skipif(not HAVE_8, reason="needs 8 devices: run by "
                             "test_sharded_in_subprocess")

#: (data, tensor, expert) meshes of the model checks.
MESHES = [(1, 8, 1), (1, 2, 4), (2, 2, 2), (8, 1, 1)]
#: where the model checks put the Engram tables' rows per mesh (shard_params' engram=): split
#: over all 8 devices on (2, 2, 2), split the same way in host memory on (1, 2, 4) (the rows a
#: step reads gathered on the host), replicated on the others
ENGRAM = {(2, 2, 2): "sharded", (1, 2, 4): "host"}


def _shard_params(params, cfg, shape):
    mesh = sharding.make_mesh(*shape)
    return mesh, sharding.shard_params(params, cfg, mesh,
                                       engram=ENGRAM.get(shape, "replicated"))


@pytest.mark.skipif(HAVE_8, reason="8 devices here: the sharded tests run in this process")
def test_sharded_in_subprocess():
    """This module's 8-device tests, in a subprocess with 8 host CPU devices."""
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEV}")
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(
                   os.pathsep))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider",
                        "-q", "-W", "ignore::DeprecationWarning", os.path.abspath(__file__)],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       # 5-6 minutes alone; up to 19 beside another test worker on 2 cores
                       timeout=2400)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    # the progress line: every 8-device test passed (".") and only this one skipped ("s")
    progress = r.stdout.strip().splitlines()[0].split()[0]
    assert set(progress) == {".", "s"} and progress.count("s") == 1, r.stdout[-2000:]


# ----------------------------------------------------------------------------- bad meshes


def test_make_mesh_value_errors():
    one = jax.devices()[:1]
    with pytest.raises(ValueError, match="needs 2 devices but 1") as e:
        sharding.make_mesh(data=2, devices=one)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=2 set before JAX" in str(e.value)
    with pytest.raises(ValueError, match="needs 1 devices but 2"):
        sharding.make_mesh(devices=jax.devices()[:1] * 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            sharding.make_mesh(tensor=bad, devices=one)
    mesh = sharding.make_mesh(devices=one)
    assert mesh.axis_names == sharding.MESH_AXES and dict(mesh.shape) == {
        "data": 1, "tensor": 1, "expert": 1}
    other = jax.make_mesh((1,), ("x",), devices=one)
    with pytest.raises(ValueError, match="mesh axes must be"):
        sharding.check_mesh(other)


def test_parse_mesh_spec():
    """``--mesh`` of the command lines: ``axis=size`` items, an axis left out is 1; a bad spec
    is a ValueError naming the flag."""
    parse = sharding.parse_mesh_spec
    assert parse("data=1,tensor=2,expert=4") == {"data": 1, "tensor": 2, "expert": 4}
    assert parse(" expert = 8 ,") == {"data": 1, "tensor": 1, "expert": 8}
    assert parse("tensor=2,data=4") == {"data": 4, "tensor": 2, "expert": 1}
    for bad, match in [("", "empty mesh spec"), (" , ", "empty mesh spec"),
                       ("tensor", "'tensor' is not axis=size"),
                       ("model=2", "unknown mesh axis 'model'; the axes are data, tensor, "
                                   "expert"),
                       ("data=2,data=2", "mesh axis 'data' given twice"),
                       ("tensor=two", "the size of 'tensor' must be an integer >= 1, got 'two'"),
                       ("expert=0", "the size of 'expert' must be an integer >= 1, got 0"),
                       ("expert=-2", "the size of 'expert' must be an integer >= 1, got -2"),
                       ("data=1.5", "the size of 'data' must be an integer >= 1, got '1.5'")]:
        with pytest.raises(ValueError, match="^--mesh: " + re.escape(match)):
            parse(bad)
    with pytest.raises(ValueError, match="^--layout: unknown mesh axis"):
        parse("x=1", flag="--layout")
    one = sharding.make_mesh(**parse("data=1"), devices=jax.devices()[:1])
    assert dict(one.shape) == {"data": 1, "tensor": 1, "expert": 1}


@needs_8
def test_value_errors_on_8_devices():
    cfg, _ = tiny_config("drop")
    with pytest.raises(ValueError, match="needs 6 devices but 8"):
        sharding.make_mesh(data=3, tensor=2)
    mesh = sharding.make_mesh(tensor=2, expert=4)
    with pytest.raises(ValueError, match="n_routed_experts=6 does not divide"):
        sharding.shard_params({}, cfg.replace(n_routed_experts=6, n_activated_experts=2), mesh)
    with pytest.raises(ValueError, match="params must be prepared"):
        sharding.shard_params({"layers": []}, cfg, mesh)
    mesh = sharding.make_mesh(data=2, tensor=4)
    state = st.init_state(cfg, 3, 8)
    with pytest.raises(ValueError, match="batch 3 does not divide by the mesh's data axis"):
        sharding.shard_state(state, mesh)
    with pytest.raises(ValueError, match="batch 3 does not divide"):
        model.prefill({}, cfg, np.zeros((3, 4), np.int32), state, mesh=mesh)
    other = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match="mesh axes must be"):
        model.decode_step({}, cfg, state, np.zeros(3, np.int32), mesh=other)
    # speculative generation: verify, verify_fn, generate_speculative
    from dsv41_jax.draft_training import with_dspark
    spec = with_dspark(cfg, stages=1, block_size=2, markov_rank=16, noise_token_id=0)
    _refuse_speculative(spec, st.init_state(spec, 3, 8), mesh,
                        "batch 3 does not divide by the mesh's data axis")
    _refuse_speculative(spec.replace(n_routed_experts=6, n_activated_experts=2),
                        st.init_state(spec, 2, 8), sharding.make_mesh(tensor=2, expert=4),
                        "n_routed_experts=6 does not divide")
    _refuse_speculative(spec, st.init_state(spec, 2, 8), other, "mesh axes must be")


def _refuse_speculative(cfg, state, mesh, match):
    """``verify`` and ``generate_speculative`` (and ``verify_fn`` for a mesh that is bad
    whatever the batch) on ``mesh`` raise ``ValueError`` matching ``match`` before anything
    runs: the state neither changed nor donated."""
    from tree_checks import assert_trees_bitwise_equal
    B = state.batch
    before = jax.tree.map(np.asarray, state)
    with pytest.raises(ValueError, match=match):
        model.verify({}, cfg, state, np.zeros((B, 2), np.int32), mesh=mesh)
    with pytest.raises(ValueError, match=match):
        model.verify({}, cfg, state, np.zeros((B, 2), np.int32), np.ones(B, np.int32),
                     mesh=mesh)
    with pytest.raises(ValueError, match=match):
        generation.generate_speculative({"dspark": {}}, cfg, state,
                                        np.zeros((B, cfg.vocab_size), np.float32),
                                        max_new_tokens=1, drafts=1, mesh=mesh)
    if "batch" not in match:
        with pytest.raises(ValueError, match=match):
            model.verify_fn(cfg, mesh=mesh)
    assert not any(a.is_deleted() for a in jax.tree.leaves(state))
    assert_trees_bitwise_equal(jax.tree.map(np.asarray, state), before, "state after refusals")


def test_speculative_mesh_value_errors():
    """``verify``, ``verify_fn`` and ``generate_speculative`` refuse a mesh that is not a
    :class:`jax.sharding.Mesh` or has other axes than :func:`sharding.make_mesh`'s, before
    anything runs (the data and expert axes: :func:`test_value_errors_on_8_devices`)."""
    from dsv41_jax.draft_training import with_dspark
    cfg = with_dspark(tiny_config("drop")[0], stages=1, block_size=2, markov_rank=16,
                      noise_token_id=0)
    state = st.init_state(cfg, 2, 8)
    other = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                          devices=jax.devices()[:1])
    _refuse_speculative(cfg, state, other, "mesh axes must be")
    _refuse_speculative(cfg, state, "data=1", "mesh must be a jax.sharding.Mesh")


# ----------------------------------------------------------------------------- the table


def test_param_logical_axes():
    ax = sharding.param_logical_axes
    assert ax("layer_groups/1/0/attn/wq_b/dq", 4) == ("stack", "stack", "q_heads", None)
    assert ax("layer_groups/0/0/ffn/experts/w2/fp4", 5) == ("stack", "stack", "experts", None,
                                                            None)
    assert ax("head/weight", 2) == ("vocab", "embed")
    assert ax("layer_groups/0/0/attn/wkv/dq", 4) == ("stack", "stack", None, None)  # latent
    # the kernel-form experts pooled by prepare_params: [layers, E, ...], split over experts
    assert ax("routed_experts/w1/i4", 4) == ("stack", "experts", None, None)
    assert ax("routed_experts/w2/scale_t", 4) == ("stack", "experts", None, None)
    assert ax("layer_groups/0/1/ffn/experts/pool_at", 2) == ("stack", "stack")
    with pytest.raises(ValueError, match="rank"):
        ax("layer_groups/0/0/attn/attn_sink", 4)
    one = sharding.make_mesh(devices=jax.devices()[:1])
    assert sharding.spec_for(("q_heads", None), (8, 4), one) == P()


def test_engram_places():
    """The Engram rows' entry of the table: replicated, or split over every mesh axis (on the
    devices or in their host memory); an unknown place is refused."""
    assert sharding.logical_axes_table()["engram_rows"] is None
    assert sharding.logical_axes_table("sharded")["engram_rows"] == sharding.MESH_AXES
    assert sharding.logical_axes_table("host")["engram_rows"] == sharding.MESH_AXES
    with pytest.raises(ValueError, match=r"engram must be one of \('replicated', 'sharded', "
                                         r"'host'\), got 'disk'"):
        sharding.logical_axes_table("disk")
    plan = jax.sharding.AbstractMesh((2, 2, 2), sharding.MESH_AXES)
    assert sharding.spec_for(("engram_rows", None), (16, 4), plan, engram="sharded") == P(
        sharding.MESH_AXES)
    assert sharding.spec_for(("engram_rows", None), (12, 4), plan, engram="sharded") == P()
    assert sharding.spec_for(("engram_rows", None), (16, 4), plan) == P()


def test_engram_host_memory_kind(monkeypatch):
    """``engram="host"``: the Engram tables (and nothing else) get the ``pinned_host`` memory
    kind in ``param_shardings``; on a backend whose devices have no such memory the placement
    is refused with a ValueError naming the backend and its memories (faked here: JAX 0.11's
    CPU devices have one)."""
    one = sharding.make_mesh(devices=jax.devices()[:1])
    assert sharding.host_memory_kind(jax.devices()[0]) == "pinned_host"   # JAX 0.11 CPU too
    tree = {"layer_groups": ({"engram": {"embed": {"weight": np.zeros((1, 1, 16, 32), np.uint8),
                                                   "scale": np.zeros((1, 1, 16, 1), np.uint8)},
                                         "q_weight": np.zeros((2, 8), np.float32)}},),
            "head": {"weight": np.zeros((8, 4), np.float32)}}
    kinds = {jax.tree_util.keystr(k): s.memory_kind for k, s in jax.tree_util.tree_leaves_with_path(
        sharding.param_shardings(tree, one, engram="host"))}
    assert {k for k, v in kinds.items() if v == "pinned_host"} == {
        "['layer_groups'][0]['engram']['embed']['scale']",
        "['layer_groups'][0]['engram']['embed']['weight']"}
    assert all(s.memory_kind in (None, "device")
               for s in jax.tree.leaves(sharding.param_shardings(tree, one)))

    class Memory:
        kind = "device"

    class Device:
        platform = "fakeaccel"

        def addressable_memories(self):
            return [Memory()]
    with pytest.raises(ValueError, match=r"engram='host' needs the memory kind 'pinned_host', "
                                         r"which the fakeaccel backend's devices do not have "
                                         r"\(they have \['device'\]\)"):
        sharding.host_memory_kind(Device())


# ----------------------------------------------------------------------------- the MoE alone


def _moe_params(rng, E, D, F):
    from dsv41_jax import quant

    def experts(o, i, gain):
        w = rng.normal(0, gain / np.sqrt(i), (E, o, i)).astype(np.float32)
        codes, scale = quant.fp4_quantize(jnp.asarray(w), 32, "e8m0")
        return {"weight": quant.pack_nibbles(codes), "scale": scale}
    shared = {k: {"weight": jnp.asarray(rng.normal(0, 1 / np.sqrt(D), (F, D) if k != "w2"
                                                       else (D, F)), jnp.bfloat16)}
              for k in ("w1", "w3", "w2")}
    return {"gate": {"weight": jnp.asarray(rng.normal(0, 1, (E, D)), jnp.bfloat16),
                     "bias": jnp.asarray(rng.normal(0, 0.1, (E,)), jnp.float32)},
            "experts": {"w1": experts(F, D, 2.0), "w3": experts(F, D, 2.0),
                        "w2": experts(D, F, 0.5)},
            "shared_experts": shared}


@needs_8
@pytest.mark.parametrize("impl", ["dense", "routed"])
@pytest.mark.parametrize("n_tokens", [24, 3])     # 3 x 2 pairs < 8 experts: the gathered path
def test_moe_expert_parallel_bitwise(impl, n_tokens):
    """Expert parallelism (each shard its experts, psum) gives the single-device MoE bit for
    bit on every path: a token's k = 2 bf16 expert outputs sum exactly in fp32, so the other
    association of the sum changes nothing."""
    cfg, _ = tiny_config("drop")
    E, D, F = 8, cfg.dim, cfg.moe_inter_dim
    cfg = cfg.replace(n_routed_experts=E, n_activated_experts=2)
    rng = np.random.default_rng(0)
    p = _moe_params(rng, E, D, F)
    x = jnp.asarray(rng.normal(0, 1, (n_tokens, D)), jnp.bfloat16)
    ref = jax.jit(lambda x, p: moe_layer.moe(x, p, cfg, None, impl=impl))(x, p)
    for shape in [(1, 2, 4), (2, 1, 4), (1, 1, 8), (4, 2, 1)]:
        mesh = sharding.make_mesh(*shape)
        got = jax.jit(lambda x, p: moe_layer.moe(x, p, cfg, None, impl=impl, mesh=mesh))(x, p)
        for a, b in zip(ref, got):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(shape))


# ----------------------------------------------------------------------------- the model

PROMPT_LEN, CAPACITY, DECODE_STEPS = 20, 40, 2


@pytest.fixture(scope="module")
def tiny():
    """The tiny config (every layer role, Engram) with 8 experts, its parameters, prompts."""
    from dsv41_jax.random_weights import random_params_device
    cfg, _ = tiny_config("shrink")
    cfg = cfg.replace(n_routed_experts=8, n_activated_experts=2)
    params = model.prepare_params(random_params_device(cfg, 0, identity_token_map(
        cfg.vocab_size)), cfg)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (N_DEV, PROMPT_LEN)).astype(np.int32)
    lengths = np.array([20, 13, 17, 20, 5, 20, 9, 16], np.int32)
    steps = rng.integers(0, cfg.vocab_size, (DECODE_STEPS, N_DEV)).astype(np.int32)
    return cfg, params, tokens, lengths, steps


def _run(cfg, params, tokens, lengths, steps, *, mesh=None, batch_invariant=False):
    state = st.init_state(cfg, tokens.shape[0], CAPACITY)
    out, state = model.prefill(params, cfg, tokens, state, lengths, mesh=mesh,
                               batch_invariant=batch_invariant)
    logits = [np.asarray(out.logits)]
    for t in steps:
        lg, state = model.decode_step(params, cfg, state, t[:tokens.shape[0]], mesh=mesh,
                                      batch_invariant=batch_invariant)
        logits.append(np.asarray(lg))
    return logits, state


@pytest.fixture(scope="module")
def single(tiny):
    """The single-device run, every row as a batch of one (``batch_invariant``): a sharded
    run's rows are compared with it whatever their number per device."""
    cfg, params, tokens, lengths, steps = tiny
    return _run(cfg, params, tokens, lengths, steps, batch_invariant=True)


def _state_leaves(state):
    return jax.tree_util.tree_leaves_with_path(state)


@needs_8
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_prefill_decode_bitwise(tiny, single, shape):
    """Prefill (CED, bounded replay: 20 tokens > window 16, ragged lengths) then decode steps
    on a mesh (:data:`ENGRAM`: where the Engram rows go): every logit and every state array equals the single-device run's bit for bit.

    Why bitwise: ``tensor`` splits only independent work (heads, output groups, vocabulary
    rows; no contraction), ``data`` splits rows (each device runs its rows; the reference runs
    each row as a batch of one, ``batch_invariant``: a data-1 mesh runs batch-invariant too),
    the expert psum adds two bf16 values per token, exact in fp32 (see
    :func:`dsv41_jax.layers.moe._expert_parallel` for when it may differ), and the Engram rows
    split over the devices (on (2, 2, 2)) are gathered by each device for its rows and added
    to exact zeros from the others."""
    cfg, params, tokens, lengths, steps = tiny
    data = shape[0]
    B = N_DEV if data == N_DEV else 2
    mesh, sp = _shard_params(params, cfg, shape)
    if ENGRAM.get(shape) in ("sharded", "host"):   # the rows really split over the 8 devices
        tables = [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(sp)
                  if "['engram']['embed']" in jax.tree_util.keystr(k)]
        assert len(tables) == 2   # the FP8 rows and their E8M0 scales
        for name, table in tables:
            assert table.sharding.spec[2] == sharding.ENGRAM_ROW_AXES   # [units, layers, rows, .]
            assert table.addressable_shards[0].data.shape[-2] == table.shape[-2] // N_DEV
            assert table.sharding.memory_kind == ("pinned_host" if ENGRAM[shape] == "host"
                                                  else "device"), name
        # nothing else in host memory
        assert sum(v.sharding.memory_kind == "pinned_host" for v in jax.tree.leaves(sp)) == (
            2 if ENGRAM[shape] == "host" else 0)
        # the entry points keep a tree already on the mesh: the run reads the split tables
        assert sharding.shard_params(sp, cfg, mesh) is sp
    logits, state = _run(cfg, sp, tokens[:B], lengths[:B], steps, mesh=mesh,
                         batch_invariant=data == 1)
    ref_logits, ref_state = single
    for i, (a, b) in enumerate(zip(ref_logits, logits)):
        np.testing.assert_array_equal(b, a[:B], err_msg=f"call {i}")
    for (path, a), (_, b) in zip(_state_leaves(ref_state), _state_leaves(state)):
        name = jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a)[:B], err_msg=name)
        if data > 1:   # the state stays split by rows
            assert b.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), b.ndim), (
                name, b.sharding)


GEN_TOKENS = 3
#: the generation loop's meshes: the four of the model checks (each costs a compilation of the
#: loop, ~15 s on 2 cores; the prefill and decode programs are those of
#: test_sharded_prefill_decode_bitwise): every axis split, and both paths of the model step
#: (rows one at a time on a data-1 mesh, one row per device on the data-2 and data-8 meshes)
GEN_MESHES = MESHES


def _generate(cfg, params, tokens, lengths, *, mesh=None, batch_invariant=False):
    state = st.init_state(cfg, tokens.shape[0], CAPACITY)
    out, state = model.prefill(params, cfg, tokens, state, lengths, mesh=mesh,
                               batch_invariant=batch_invariant)
    return generation.generate(params, cfg, state, out.logits, max_new_tokens=GEN_TOKENS,
                               mesh=mesh, batch_invariant=batch_invariant)


@pytest.fixture(scope="module")
def single_generated(tiny):
    """What greedy :func:`generation.generate` must give on one device: the prefill, then each
    token the argmax of the last logits, fed to :func:`model.decode_step` (the programs of
    :func:`single`, already compiled: every row as a batch of one). Returns ``(tokens [8,
    GEN_TOKENS], state)``."""
    cfg, params, tokens, lengths, _ = tiny
    state = st.init_state(cfg, tokens.shape[0], CAPACITY)
    out, state = model.prefill(params, cfg, tokens, state, lengths, batch_invariant=True)
    logits, picked = out.logits, []
    for i in range(GEN_TOKENS):
        picked.append(np.argmax(np.asarray(logits), axis=-1).astype(np.int32))
        if i + 1 < GEN_TOKENS:   # the loop does not run its last token through the model
            logits, state = model.decode_step(params, cfg, state, picked[-1],
                                              batch_invariant=True)
    return np.stack(picked, axis=1), state


@needs_8
@pytest.mark.parametrize("shape", GEN_MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_generate_bitwise(tiny, single_generated, shape):
    """Prefill then :func:`generation.generate` (the compiled loop of sample-then-decode
    steps, greedy) on a mesh: the generated tokens, their counts and every state array equal
    the single-device prefill and decode steps' (bitwise, for the reasons of
    :func:`test_sharded_prefill_decode_bitwise`)."""
    cfg, params, tokens, lengths, _ = tiny
    data = shape[0]
    B = N_DEV if data == N_DEV else 2
    mesh, sp = _shard_params(params, cfg, shape)
    res = _generate(cfg, sp, tokens[:B], lengths[:B], mesh=mesh, batch_invariant=data == 1)
    ref_tokens, ref_state = single_generated
    assert len(set(ref_tokens[:B].ravel().tolist())) > 1   # not a constant
    np.testing.assert_array_equal(np.asarray(res.tokens), ref_tokens[:B])
    np.testing.assert_array_equal(np.asarray(res.lengths), np.full(B, GEN_TOKENS))
    for (path, a), (_, b) in zip(_state_leaves(ref_state), _state_leaves(res.state)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a)[:B],
                                      err_msg=jax.tree_util.keystr(path))
        if data > 1:
            assert b.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), b.ndim)


FORWARD_MESH = (2, 2, 2)


@needs_8
def test_sharded_forward_bitwise(tiny):
    """:func:`model.forward` (the exact prefill of every position, all logits) on the (2, 2, 2)
    mesh, the Engram rows split over the 8 devices: ``all_logits`` [B, S, V], ``final_hidden``
    and every array of the returned state equal the single-device ``forward`` of each row
    alone bit for bit (each device holds one row, so the reference runs rows as batches of
    one; bitwise for the reasons of :func:`test_sharded_prefill_decode_bitwise`). One mesh,
    with every axis split: each mesh costs a compilation of the exact prefill with all logits
    (``forward`` is ``prefill(mode="exact", all_logits=True)``; the CED prefill and decode run
    on all four meshes in the prefill test)."""
    cfg, params, tokens, lengths, _ = tiny
    B = FORWARD_MESH[0]
    rows = tokens[:B]   # every row whole (20 tokens > window 16): forward has no lengths
    mesh, sp = _shard_params(params, cfg, FORWARD_MESH)
    out, state = model.forward(sp, cfg, rows, return_state=True, mesh=mesh)
    assert out.all_logits.shape == (B, rows.shape[1], cfg.vocab_size)
    for b in range(B):
        ref, ref_state = model.forward(params, cfg, rows[b:b + 1], return_state=True)
        assert jax.tree.structure(state) == jax.tree.structure(ref_state)
        np.testing.assert_array_equal(np.asarray(out.all_logits)[b:b + 1],
                                      np.asarray(ref.all_logits), err_msg=f"row {b}")
        np.testing.assert_array_equal(np.asarray(out.final_hidden)[b:b + 1],
                                      np.asarray(ref.final_hidden), err_msg=f"row {b}")
        for (path, a), (_, s) in zip(_state_leaves(ref_state), _state_leaves(state)):
            name = jax.tree_util.keystr(path)
            np.testing.assert_array_equal(np.asarray(s)[b:b + 1], np.asarray(a),
                                          err_msg=f"row {b} {name}")
            assert s.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), s.ndim), name


# ----------------------------------------------------------------------------- speculative

SPEC_TOKENS, SPEC_DRAFTS = 7, 3
#: the speculative loop's meshes (each costs a compilation of the loop, ~15 s on 2 cores):
#: the DSpark drafts on (1, 2, 4) (expert parallel, the head's 4 experts replicated although
#: the expert axis would divide them), an oracle draft on (2, 2, 2) (rows split over data,
#: accepting different numbers of drafts)
SPEC_MESHES = ((1, 2, 4), (2, 2, 2))


@pytest.fixture(scope="module")
def tiny_dspark(tiny):
    """The tiny config of :func:`tiny` with a DSpark head (one stage, blocks of
    ``SPEC_DRAFTS``, targets 3-5, the head's own 4 experts), its parameters, 2 prompts."""
    from dsv41_jax.draft_training import with_dspark
    from dsv41_jax.random_weights import random_params_device
    cfg, _, tokens, lengths, _ = tiny
    cfg = with_dspark(cfg, stages=1, block_size=SPEC_DRAFTS, markov_rank=16, experts=(4, 2),
                      noise_token_id=cfg.vocab_size - 1)
    params = model.prepare_params(random_params_device(cfg, 0, identity_token_map(
        cfg.vocab_size)), cfg)
    return cfg, params, tokens[:2], lengths[:2]


def _speculative(cfg, params, prefilled, *, mesh=None, draft=None):
    """Greedy speculative generation after the one-device prefill ``prefilled`` = ``(logits,
    state)`` (a copy of its state: the loop donates the state it is given; on a mesh
    ``generate_speculative`` places the copy)."""
    logits, state = prefilled
    return generation.generate_speculative(params, cfg, jax.tree.map(jnp.copy, state), logits,
                                           mesh=mesh, max_new_tokens=SPEC_TOKENS, draft=draft)


def _oracle_draft(cfg, plain, lengths):
    """A draft of the greedy continuation ``plain`` [B, N] (prompt lengths ``lengths``) with
    every third position of each row (shifted per row) the DSpark head's draft instead (almost
    surely wrong): calls accept 0 to ``SPEC_DRAFTS`` drafts, differently per row; the DSpark
    head runs in every call."""
    dspark = model.draft_fn(cfg)
    B, N = plain.shape
    table = jnp.asarray(np.concatenate([plain, np.zeros((B, N + SPEC_DRAFTS), np.int32)], 1))
    n0 = jnp.asarray(lengths, jnp.int32)

    def draft(params, state, last, key):
        ids, logits, confidence = dspark(params, state, last, key)
        # draft j: token 1 + j of the continuation after the row's last input
        at = jnp.clip(state.pos - n0 + 1, 0, N + 1)[:, None] + jnp.arange(SPEC_DRAFTS)[None, :]
        ours = (at + jnp.arange(B)[:, None]) % 3 == 2
        pick = jnp.where(ours, ids[:, 1:], jnp.take_along_axis(table, at, axis=1))
        return jnp.concatenate([last[:, None], pick], axis=1), logits, confidence
    return draft


@needs_8
def test_sharded_speculative_bitwise(tiny_dspark):
    """Greedy :func:`generation.generate_speculative` (the DSpark draft head, ``verify`` and
    the rollback in one compiled loop) on two meshes against one device: the tokens, the
    counts (calls, accepted, drafted) and every state array equal bit for bit, the state left
    split by rows; the DSpark head's parameters stay replicated (no rule names ``mtp.*``), so
    its MoE never takes the expert-parallel path. With the DSpark drafts (untrained: nothing
    accepted, every call rolls ``SPEC_DRAFTS`` positions back) on (1, 2, 4), the Engram rows
    in host memory; with an oracle draft (:func:`_oracle_draft`: the rows accept different
    numbers of drafts, partial blocks rolled back) on (2, 2, 2), the Engram rows split.
    Bitwise for the reasons of :func:`test_sharded_prefill_decode_bitwise`; the reference runs
    the same batch of 2 on one device (the loop's calls depend on the batch: a row that is
    done keeps committing), whose rows the data-2 mesh splits one per device: on the CPU the
    verify's ``2 x (k + 1)``-row and ``k + 1``-row GEMMs agree bitwise here, which this checks."""
    cfg, params, tokens, lengths = tiny_dspark
    out, state = model.prefill(params, cfg, tokens, st.init_state(cfg, 2, CAPACITY), lengths)
    prefilled = (out.logits, state)
    ref = _speculative(cfg, params, prefilled)
    plain = np.asarray(ref.tokens)
    assert (np.asarray(ref.lengths) == SPEC_TOKENS).all() and len(set(plain.ravel())) > 2
    oracle = _oracle_draft(cfg, plain, lengths)
    ref_oracle = _speculative(cfg, params, prefilled, draft=oracle)
    np.testing.assert_array_equal(np.asarray(ref_oracle.tokens), plain)   # greedy: the same
    accepted = np.asarray(ref_oracle.accepted) - np.asarray(ref_oracle.row_calls)
    assert int(ref_oracle.calls) < int(ref.calls) and (accepted > 0).all() and (
        accepted < np.asarray(ref_oracle.drafted)).all(), (int(ref_oracle.calls), accepted)
    for shape, draft, want in ((SPEC_MESHES[0], None, ref), (SPEC_MESHES[1], oracle, ref_oracle)):
        mesh, sp = _shard_params(params, cfg, shape)
        assert any(k.startswith("dspark/stages/0/ffn/experts") for k, _ in
                   ((jax.tree_util.keystr(p, simple=True, separator="/"), v)
                    for p, v in jax.tree_util.tree_leaves_with_path(sp)))
        assert not [k for k, _, _ in sharding.describe(sp, mesh) if k.startswith("dspark")]
        res = _speculative(cfg, sp, prefilled, mesh=mesh, draft=draft)
        for name in ("tokens", "lengths", "calls", "accepted", "row_calls", "drafted"):
            np.testing.assert_array_equal(np.asarray(getattr(res, name)),
                                          np.asarray(getattr(want, name)),
                                          err_msg=f"{shape} {name}")
        assert sharding.placed_on(res.state) is mesh
        for (path, a), (_, b) in zip(_state_leaves(want.state), _state_leaves(res.state)):
            name = jax.tree_util.keystr(path)
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{shape} {name}")
            spec = P("data") if shape[0] > 1 else P()
            assert b.sharding.is_equivalent_to(NamedSharding(mesh, spec), b.ndim), (name, shape)
    # model.verify itself on the last mesh, after the loop (its state already in place), a
    # given acceptance per row: the logits and the state of one device's verify
    block = np.asarray(plain[:, :SPEC_DRAFTS + 1])
    accept = np.array([2, 3], np.int32)
    want = model.verify(params, cfg, jax.tree.map(jnp.copy, ref_oracle.state), block, accept)
    got = model.verify(sp, cfg, res.state, block, accept, mesh=mesh)
    assert sharding.placed_on(got[2]) is mesh
    np.testing.assert_array_equal(model.host_positions(got[2]),
                                  np.asarray(ref_oracle.state.pos) + accept)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                            jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a),
                                      err_msg=f"verify {jax.tree_util.keystr(path)}")


@needs_8
def test_placement(tiny):
    """Where shard_params and shard_state put things on a (2, 2, 2) mesh."""
    cfg, params, *_ = tiny
    mesh = sharding.make_mesh(2, 2, 2)
    sp = sharding.shard_params(params, cfg, mesh)
    split = {path: spec for path, _, spec in sharding.describe(sp, mesh)}
    g = next(k for k in split if k.endswith("attn/wq_b/dq"))
    assert split[g] == P(None, None, "tensor")
    assert split["head/weight"] == P("tensor") and split["embed/weight"] == P("tensor")
    assert any(k.endswith("ffn/experts/w1/weight") and v == P(None, None, "expert")
               for k, v in split.items())
    assert not any("wkv" in k or "indexer" in k or "shared_experts" in k for k in split)
    w1 = next(v for k, v in jax.tree_util.tree_leaves_with_path(sp["layer_groups"][0][0])
              if jax.tree_util.keystr(k).endswith("['experts']['w1']['weight']"))
    assert w1.addressable_shards[0].data.shape[2] == cfg.n_routed_experts // 2
    state = sharding.shard_state(st.init_state(cfg, 4, 16), mesh)
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.spec == P("data")
        assert leaf.addressable_shards[0].data.shape[0] == 2


# ----------------------------------------------------------------------------- orbax


@needs_8
def test_converted_round_trip(tiny, tmp_path):
    """Prepared parameters saved with orbax (from a (2, 2, 2) mesh) and restored straight into
    the shardings of a mesh: the same tree, every leaf equal, every sharding that of
    shard_params; on (1, 8, 1) too, and on one device. Refusals: a tree not prepared, a second
    save, another config, another source, a directory without a save."""
    cfg, params, *_ = tiny
    mesh = sharding.make_mesh(2, 2, 2)
    sp = sharding.shard_params(params, cfg, mesh)
    d = converted.save_converted(tmp_path / "conv", sp, cfg, source="random seed 0")
    assert converted.converted_info(d)["source"] == "random seed 0"
    for shape in [(2, 2, 2), (1, 8, 1), None]:
        m = None if shape is None else sharding.make_mesh(*shape)
        got = converted.restore_converted(d, cfg, mesh=m, source="random seed 0")
        want = params if m is None else sharding.shard_params(params, cfg, m)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
            name = jax.tree_util.keystr(path)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
            if m is not None:
                assert b.sharding == a.sharding, (name, b.sharding, a.sharding)
            else:
                assert b.sharding.device_set == {jax.devices()[0]}, name
        if m is not None:   # really split, not replicated everywhere
            assert len(sharding.describe(got, m)) > 10
    with pytest.raises(ValueError, match="must be prepared"):
        converted.save_converted(tmp_path / "raw", {"layers": []}, cfg)
    with pytest.raises(ValueError, match="already holds converted parameters"):
        converted.save_converted(d, sp, cfg)
    with pytest.raises(ValueError, match=r"another config \(n_routed_experts 8 vs 4"):
        converted.restore_converted(d, cfg.replace(n_routed_experts=4))
    with pytest.raises(ValueError, match="converted from 'random seed 0', not 'ckpt'"):
        converted.restore_converted(d, cfg, source="ckpt")
    with pytest.raises(ValueError, match="holds no converted parameters"):
        converted.restore_converted(tmp_path, cfg)


# ----------------------------------------------------------------------------- sliced loading


@needs_8
def test_random_weights_built_on_the_mesh():
    """Random parameters generated on a mesh (``random_params_device(..., mesh=)``: each leaf
    made in the sharding the sliced loader gives its checkpoint tensor, each device computing
    its part) are the single-device build's, placed: after ``prepare_params`` and
    ``shard_params`` the trees are equal bit for bit, every leaf in the same sharding. On
    (1, 2, 4): ``wq_b``'s FP8 rows and their E8M0 scale rows split over ``tensor``, the
    experts over ``expert``, the Engram rows over all 8 devices in their host memory (made
    there, the padding zeros)."""
    from dsv41_jax import checkpoint
    from dsv41_jax.random_weights import random_params_device
    from tree_checks import assert_trees_bitwise_equal

    cfg, _ = tiny_config("shrink")
    # an Engram table of 420 rows (4 primes from 98 up): padded to 424 over the 8 devices
    cfg = cfg.replace(n_routed_experts=8, n_activated_experts=2, engram_vocab_size=98,
                      engram_num_embeddings=(420,))
    tmap = identity_token_map(cfg.vocab_size)
    one = random_params_device(cfg, 0, tmap)
    for shape, engram in [((1, 2, 4), "host")]:
        mesh = sharding.make_mesh(*shape)
        want = sharding.shard_params(model.prepare_params(one, cfg), cfg, mesh, engram=engram)
        raw = random_params_device(cfg, 0, tmap, mesh=mesh, engram=engram)
        layer = raw["layers"][1]
        made = {"layers.1.attn.wq_b.weight": layer["attn"]["wq_b"]["weight"],
                "layers.1.attn.wq_b.scale": layer["attn"]["wq_b"]["scale"],
                "layers.1.ffn.experts.w1.weight": layer["ffn"]["experts"]["w1"]["weight"],
                "layers.1.engram.embed.weight": layer["engram"]["embed"]["weight"]}
        for name, x in made.items():
            full, where = sharding.checkpoint_sharding(name, x.shape, mesh, engram=engram)
            assert x.shape == full and x.sharding == where, (name, x.sharding)
        assert made["layers.1.attn.wq_b.weight"].sharding.spec[0] == "tensor"
        spec = made["layers.1.ffn.experts.w1.weight"].sharding.spec   # [E, ...]: by expert
        assert (tuple(spec) + (None,))[0] == ("expert" if shape[2] > 1 else None)
        table = made["layers.1.engram.embed.weight"]
        rows = one["layers"][1]["engram"]["embed"]["weight"].shape[0]
        assert checkpoint.in_host_memory(table) == (engram == "host")
        if engram == "host":      # padded to a multiple of the 8 devices, with zero rows
            assert table.shape[0] == -(-rows // N_DEV) * N_DEV > rows
            assert not np.asarray(table)[rows:].astype(np.float32).any()
        got = sharding.shard_params(model.prepare_params(raw, cfg), cfg, mesh, engram=engram,
                                    reshard=True)
        assert_trees_bitwise_equal(want, got, f"random weights built on {shape}")
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
            assert b.sharding == a.sharding, (jax.tree_util.keystr(path), b.sharding)


@needs_8
def test_sliced_load_bitwise(tmp_path, monkeypatch):
    """Loading a checkpoint (two files) with a mesh reads each device's part of each tensor
    alone (every read of ``read_slice`` recorded: its bounds are a device's index of the
    tensor's sharding, and a split tensor is never read whole) and, prepared and placed, gives
    the tree of the unsharded load + ``prepare_params`` + ``shard_params`` bit for bit, every
    leaf in the same sharding: on (2, 2, 2) with the Engram rows split (padded) in host
    memory (read, stacked and placed there, never in the devices' memory), and on
    (1, 8, 1), where ``wq_b``'s FP8 rows split 8 ways with their E8M0 scale rows (32 rows per
    scale row)."""
    from dsv41_jax import checkpoint, random_weights
    from tree_checks import assert_trees_bitwise_equal

    cfg, _ = tiny_config("shrink")
    cfg = cfg.replace(n_routed_experts=8, n_activated_experts=2)
    flat = random_weights.random_tensors(cfg, 0)
    names = list(flat)
    d = tmp_path / "ck"
    d.mkdir()
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        checkpoint.write_safetensors(d / f"model-{i}.safetensors", {n: flat[n] for n in part})
    tmap = identity_token_map(cfg.vocab_size)
    reads = []
    real = checkpoint.read_slice

    def recorded(entry, bounds):
        out = real(entry, bounds)
        reads.append((entry.name, bounds, out.nbytes))
        return out
    monkeypatch.setattr(checkpoint, "read_slice", recorded)
    for shape, engram in [((2, 2, 2), "host"), ((1, 8, 1), "replicated")]:
        mesh = sharding.make_mesh(*shape)
        _, want = checkpoint.load_params(d, cfg, tokenizer_map=tmap)
        want = sharding.shard_params(model.prepare_params(want, cfg), cfg, mesh, engram=engram)
        reads.clear()
        _, raw = checkpoint.load_params(d, cfg, tokenizer_map=tmap, mesh=mesh, engram=engram)
        got = sharding.shard_params(model.prepare_params(raw, cfg), cfg, mesh, engram=engram,
                                    reshard=True)
        assert_trees_bitwise_equal(want, got, f"sliced load on {shape}")
        if engram == "host":   # loaded straight into host memory, before shard_params
            assert all(checkpoint.in_host_memory(raw["layers"][1]["engram"]["embed"][k])
                       for k in ("weight", "scale"))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
            assert b.sharding == a.sharding, (jax.tree_util.keystr(path), b.sharding)
        by_name = {}
        for name, bounds, nbytes in reads:
            by_name.setdefault(name, []).append((bounds, nbytes))
        wq_b = "layers.1.attn.wq_b"
        T = shape[1]
        for n in (f"{wq_b}.weight", f"{wq_b}.scale"):   # rows split over tensor, never whole
            full, where = sharding.checkpoint_sharding(n, flat[n].shape, mesh)
            parts = {checkpoint.slice_bounds(i, full)
                     for i in where.devices_indices_map(full).values()}
            assert {b for b, _ in by_name[n]} == parts and len(parts) == T
            assert max(nb for _, nb in by_name[n]) == flat[n].nbytes // T
        # each device reads its experts only: expert e of layer 1 once per device holding it
        counts = [len(by_name[f"layers.1.ffn.experts.{e}.w1.weight"]) for e in range(8)]
        assert counts == [N_DEV // shape[2]] * 8
        table = "layers.1.engram.embed.weight"
        rows = [b[0][1] - b[0][0] for b, _ in by_name[table]]
        if engram == "host":   # rows over all 8 devices, the padded ones never read
            assert len(rows) == N_DEV and max(rows) == -(-flat[table].shape[0] // N_DEV)
            assert sum(rows) == flat[table].shape[0]
        else:
            assert rows == [flat[table].shape[0]] * N_DEV
    # a host-memory part above block_bytes, padded with a row per device: built block by
    # block on the host, the padding zeros
    name = "layers.1.engram.embed.weight"
    e = checkpoint.checkpoint_index(d)[name]
    _, where = sharding.checkpoint_sharding(name, e.shape, mesh, engram="host")
    assert where.memory_kind == "pinned_host" and where.spec == P(sharding.ENGRAM_ROW_AXES)
    full = (e.shape[0] + N_DEV,) + e.shape[1:]
    table = checkpoint._place_parts(name, full, e.dtype, checkpoint._padded_reader(
        lambda b: real(e, b), e.shape), where, block_bytes=8 * e.shape[1])
    assert table.sharding == where and checkpoint.in_host_memory(table)
    np.testing.assert_array_equal(np.asarray(table)[:e.shape[0]].view(np.uint8),
                                  flat[name].view(np.uint8))
    assert not np.asarray(table)[e.shape[0]:].view(np.uint8).any()
    with pytest.raises(ValueError, match="place and mesh are exclusive"):
        checkpoint.load_params(d, cfg, tokenizer_map=tmap, mesh=mesh, place=lambda n, h: h)
