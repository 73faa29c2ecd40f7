"""Seeded random weights in the reference checkpoint format (names, dtypes, FP8/FP4 packing).

For demos and tests without a real checkpoint: the tensors go through the same loader
(:func:`dsv41_jax.checkpoint.params_from_tensors`) as a real checkpoint. Scales follow the
fixtures' recipe (linear weights N(0, 1/fan_in), norms 1 + N(0, 0.1), ...), so activations stay
O(1) through the stack. They are not trained: generated text is noise.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from dsv41_jax import checkpoint
from dsv41_jax.checkpoint import expected_dspark_tensors, expected_tensors
from dsv41_jax.config import ModelConfig

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _pow2_ceil(x):
    return np.exp2(np.ceil(np.log2(np.maximum(x, 1e-30)))).astype(np.float32)


def _fp8_blocks(w: np.ndarray):
    """[out, in] fp32 -> (e4m3 [out, in], e8m0 bytes [ceil(out/32), ceil(in/32)])."""
    o, i = w.shape
    go, gi = -(-o // 32), -(-i // 32)
    pad = np.zeros((go * 32, gi * 32), np.float32)
    pad[:o, :i] = w
    amax = np.abs(pad.reshape(go, 32, gi, 32)).max(axis=(1, 3))
    s = _pow2_ceil(np.maximum(amax, 1e-12) / 448.0)
    q = (pad.reshape(go, 32, gi, 32) / s[:, None, :, None]).reshape(go * 32, gi * 32)[:o, :i]
    e = (np.log2(s) + 127).astype(np.uint8)
    return np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn), e


def _fp4_rows(w: np.ndarray):
    """[out, in] fp32 -> (packed e2m1 uint8 [out, in/2], e8m0 bytes [out, in/32])."""
    o, i = w.shape
    b = w.reshape(o, i // 32, 32)
    s = _pow2_ceil(np.maximum(np.abs(b).max(-1), 1e-12) / 6.0)
    v = np.clip(b / s[..., None], -6, 6).reshape(o, i)
    idx = np.abs(np.abs(v)[..., None] - _E2M1).argmin(-1).astype(np.uint8)
    code = idx | ((v < 0).astype(np.uint8) << 3)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.astype(np.uint8), (np.log2(s) + 127).astype(np.uint8)


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor :func:`expected_tensors` lists, filled with seeded random values."""
    rng = np.random.default_rng(seed)
    exp = {**expected_tensors(cfg), **expected_dspark_tensors(cfg)}
    out: dict[str, np.ndarray] = {}
    done = set()
    for name, (shape, dtypes) in exp.items():
        if name in done:
            continue
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{base}.scale" in exp:
            sshape = exp[f"{base}.scale"][0]
            if name.endswith("engram.embed.weight"):   # fp8 rows, one scale per 32 of a row
                v = rng.standard_normal(shape).astype(np.float32)
                b = v.reshape(shape[0], -1, 32)
                sc = _pow2_ceil(np.maximum(np.abs(b).max(-1), 1e-12) / 448.0)
                out[name] = (b / sc[..., None]).reshape(shape).astype(ml_dtypes.float8_e4m3fn)
                out[f"{base}.scale"] = (np.log2(sc) + 127).astype(np.uint8)
            elif dtypes == ("uint8",):          # packed FP4 expert
                o, i = shape[0], shape[1] * 2
                gain = 1.0 if ".w2." not in name else 0.5
                w = rng.standard_normal((o, i)).astype(np.float32) * gain / np.sqrt(i)
                out[name], out[f"{base}.scale"] = _fp4_rows(w)
            else:
                o, i = shape
                gain = 2.5 if name.endswith("wo_b.weight") else 1.0
                w = rng.standard_normal((o, i)).astype(np.float32) * gain / np.sqrt(i)
                out[name], out[f"{base}.scale"] = _fp8_blocks(w)
                assert out[f"{base}.scale"].shape == tuple(sshape)
            done |= {name, f"{base}.scale"}
            continue
        if "norm" in name and name.endswith(".weight"):
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("attn_sink"):
            v = 0.5 * rng.standard_normal(shape)
        elif "hc_" in name and name.endswith("_fn"):
            v = rng.standard_normal(shape) / np.sqrt(4 * shape[1])
        elif "hc_" in name and name.endswith("_base"):
            v = 0.5 * rng.standard_normal(shape)
        elif "hc_" in name and name.endswith("_scale"):
            v = np.abs(1.0 + 0.25 * rng.standard_normal(shape))
        elif name.endswith("gate.bias"):
            v = 0.1 * rng.standard_normal(shape)
        elif name in ("embed.weight",) or name.endswith(("q_weight", "k_weight",
                                                         "markov_head.embed.weight")):
            v = rng.standard_normal(shape)
        else:  # plain linear weights [out, in] (head, gate, indexer, compressor)
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        dt = np.float32 if dtypes[0] == "float32" else ml_dtypes.bfloat16
        out[name] = np.asarray(v, np.float32).astype(dt)
        done.add(name)
    return out


# ----------------------------------------------------------------------------- on the device


#: The static arguments of each leaf generator of :func:`_device_gens`.
_GEN_STATIC = dict(normal=("shape", "mean", "std", "absolute", "dtype"),
                   fp8_block=("lead", "o", "i", "gain"), fp8_block_dequant=("o", "i", "gain"),
                   fp4_rows=("lead", "o", "i", "gain"), fp8_rows=("rows", "hd", "valid"))


def _device_gens() -> dict:
    """The leaf generators, plain functions of a key and their static arguments
    (:data:`_GEN_STATIC`), which :func:`random_params_device` jits with the shardings it
    needs. Built once (so that importing this module needs no JAX): the same functions each
    time, so JAX's caches reuse their compiled programs across calls."""
    global _GENS
    if _GENS is not None:
        return _GENS
    import jax
    import jax.numpy as jnp

    from dsv41_jax import quant

    f32 = jnp.float32

    def normal(key, shape, mean, std, absolute, dtype):
        v = mean + std * jax.random.normal(key, shape, f32)
        if absolute:
            v = jnp.abs(v)
        return v.astype(dtype)

    def fp8_block(key, lead, o, i, gain):
        # [.., o, i] fp32 N(0, gain^2 / i) -> e4m3 codes + E8M0 bytes per 32x32 tile
        w = jax.random.normal(key, (*lead, o, i), f32) * np.float32(gain / np.sqrt(i))
        go, gi = -(-o // 32), -(-i // 32)
        pad = [(0, 0)] * len(lead) + [(0, go * 32 - o), (0, gi * 32 - i)]
        b = jnp.pad(w, pad).reshape(*lead, go, 32, gi, 32)
        amax = jnp.max(jnp.abs(b), axis=(-3, -1))
        e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-12) / 448.0))
        s = jnp.exp2(e)
        q = jnp.clip(b / s[..., :, None, :, None], -448.0, 448.0).astype(quant.E4M3)
        q = q.reshape(*lead, go * 32, gi * 32)[..., :o, :i]
        return q, (e + 127).astype(jnp.uint8)

    def fp8_block_dequant(key, o, i, gain):
        q, s = fp8_block(key, (), o, i, gain)
        return quant.dequant_fp8_weight(q, s)

    def fp4_rows(key, lead, o, i, gain):
        # [.., o, i] fp32 N(0, gain^2 / i) -> packed e2m1 [.., o, i/2] + E8M0 [.., o, i/32]
        w = jax.random.normal(key, (*lead, o, i), f32) * np.float32(gain / np.sqrt(i))
        codes, scale = quant.fp4_quantize(w, 32, "e8m0")
        return quant.pack_nibbles(codes), scale

    def fp8_rows(key, rows, hd, valid):
        # Engram table: N(0, 1) rows, e4m3 with one E8M0 scale per 32 values of a row; the
        # rows from ``valid`` on (the padding of a table split over a mesh) zero
        v = jax.random.normal(key, (rows, hd // 32, 32), f32)
        amax = jnp.max(jnp.abs(v), axis=-1)
        e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-12) / 448.0))
        q = jnp.clip(v / jnp.exp2(e)[..., None], -448.0, 448.0).astype(quant.E4M3)
        q, s = q.reshape(rows, hd), (e + 127).astype(jnp.uint8)
        if valid < rows:
            real = jnp.arange(rows)[:, None] < valid
            q, s = jnp.where(real, q, jnp.zeros_like(q)), jnp.where(real, s, 0)
        return q, s

    _GENS = dict(normal=normal, fp8_block=fp8_block, fp8_block_dequant=fp8_block_dequant,
                 fp4_rows=fp4_rows, fp8_rows=fp8_rows)
    return _GENS


_GENS = None


def _plain_init(name: str, shape: tuple) -> tuple[float, float, bool]:
    """``(mean, std, absolute)`` of an unquantised tensor, the rules of :func:`random_tensors`."""
    if "norm" in name and name.endswith(".weight"):
        return 1.0, 0.1, False
    if name.endswith("attn_sink"):
        return 0.0, 0.5, False
    if "hc_" in name and name.endswith("_fn"):
        return 0.0, float(1.0 / np.sqrt(4 * shape[1])), False
    if "hc_" in name and name.endswith("_base"):
        return 0.0, 0.5, False
    if "hc_" in name and name.endswith("_scale"):
        return 1.0, 0.25, True
    if name.endswith("gate.bias"):
        return 0.0, 0.1, False
    if name in ("embed.weight",) or name.endswith(("q_weight", "k_weight",
                                                   "markov_head.embed.weight")):
        return 0.0, 1.0, False
    return 0.0, float(1.0 / np.sqrt(shape[-1])), False


def random_params_device(cfg: ModelConfig, seed: int = 0, tokenizer_map=None, *, mesh=None,
                         engram: str = "replicated") -> dict:
    """Seeded random parameters built directly on the devices, leaf by leaf.

    Returns the pytree :func:`dsv41_jax.checkpoint.params_from_tensors` returns for
    ``random_tensors(cfg)`` (same structure, shapes and dtypes; the values come from
    ``jax.random`` instead of numpy but follow the same recipe: FP8 block-scaled linears and
    packed FP4 experts whose dequantised values have std ~ gain / sqrt(fan_in), norms
    1 + N(0, 0.1), mHC heads, sinks and biases as there). Nothing of the model's size is
    built on the host, so the release dimensions take seconds instead of minutes.

    ``tokenizer_map`` (int [vocab], Engram configs only) is the compressed token map; by
    default it is built from the tokenizer as :func:`params_from_tensors` does.

    ``mesh`` (:func:`dsv41_jax.sharding.make_mesh`; default: JAX's default device): each leaf
    is generated in the sharding the sliced loader gives the checkpoint tensor it stands for
    (:func:`dsv41_jax.sharding.checkpoint_sharding`, the Engram tables' rows as ``engram``
    says, ``"host"`` in the devices' host memory), every device computing only its part, so a
    model that fits the mesh but not one device can be built (the release on 8 GPUs,
    docs/architecture.md, "Sharding"). The values are those of the build without a mesh, bit
    for bit (JAX's partitionable random bits); an Engram table split over the mesh has its
    rows padded to a multiple of the device count with zeros, as the loader pads them. Place
    the prepared tree with ``shard_params(..., reshard=True)``. Raises ``ValueError`` as
    :func:`~dsv41_jax.sharding.shard_params` does for a bad mesh or ``engram``.
    """
    import jax
    import jax.numpy as jnp

    from dsv41_jax.checkpoint import nest
    from dsv41_jax.config import LayerPlan

    if mesh is not None:
        from dsv41_jax import sharding
        sharding.check_mesh(mesh)
        sharding.check_experts(cfg, mesh)
        sharding.logical_axes_table(engram)
    funcs = _device_gens()
    jitted: dict = {}

    def gen(kind: str, names: tuple[str, ...], *args):
        """Leaf generator ``kind`` on ``args``, its outputs (the tensors ``names``) in their
        mesh shardings (one jit per generator and shardings, in this call only)."""
        if mesh is None:
            out = None
        else:
            out = tuple(sharding.checkpoint_sharding(n, exp_shape(n), mesh, engram=engram)[1]
                        for n in names)
            out = out[0] if len(out) == 1 else out
        if (kind, out) not in jitted:
            jitted[kind, out] = jax.jit(funcs[kind], static_argnames=_GEN_STATIC[kind],
                                        out_shardings=out)
        return jitted[kind, out](key(), *args)

    exp = {**expected_tensors(cfg), **expected_dspark_tensors(cfg)}

    def exp_shape(name: str) -> tuple:
        """A tensor's shape; a stacked expert projection's ``[E, ...]``."""
        if name in exp:
            return tuple(exp[name][0])
        layer, w, leaf = re.fullmatch(r"(.*)\.ffn\.experts\.(\w+)\.(\w+)", name).groups()
        E = cfg.n_routed_experts if layer.startswith("layers") else cfg.dspark_experts[0]
        return (E, *exp[f"{layer}.ffn.experts.0.{w}.{leaf}"][0])

    plan = LayerPlan.from_config(cfg)
    root = jax.random.key(seed)
    counter = iter(range(1 << 30))

    def key():
        return jax.random.fold_in(root, next(counter))

    flat: dict = {}
    for name, (shape, dtypes) in exp.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith(".scale") and f"{base}.weight" in exp:
            continue                                        # made with its weight
        pair = (name, f"{base}.scale")
        parts = name.split(".")
        if len(parts) > 4 and parts[2] == "ffn" and parts[3] == "experts":
            if parts[4] != "0":
                continue                                    # all experts made with expert 0
            w = parts[5]
            gain = 0.5 if w == "w2" else 1.0
            stacked = f"{parts[0]}.{parts[1]}.ffn.experts.{w}"
            E = cfg.n_routed_experts if parts[0] == "layers" else cfg.dspark_experts[0]
            spair = (f"{stacked}.weight", f"{stacked}.scale")
            if dtypes == ("uint8",):                        # packed FP4 [o, i/2]
                o, i = shape[0], shape[1] * 2
                flat[spair[0]], flat[spair[1]] = gen("fp4_rows", spair, (E,), o, i, gain)
            elif f"{base}.scale" in exp:                    # FP8 block-scaled
                o, i = shape
                flat[spair[0]], flat[spair[1]] = gen("fp8_block", spair, (E,), o, i, 1.0)
            else:                                           # bf16 experts
                flat[spair[0]] = gen("normal", spair[:1], (E, *shape), 0.0,
                                     float(1.0 / np.sqrt(shape[-1])), False,
                                     jnp.dtype(dtypes[0]))
            continue
        if name.endswith(".weight") and f"{base}.scale" in exp:
            if name.endswith("engram.embed.weight"):
                rows = (sharding.checkpoint_sharding(name, shape, mesh, engram=engram)[0][0]
                        if mesh is not None else shape[0])
                flat[name], flat[pair[1]] = gen("fp8_rows", pair, rows, shape[1], shape[0])
            elif name.endswith("attn.wo_a.weight"):
                # dequantised at load (docs/architecture.md,
                # "Checkpoint format and load-time conversions")
                flat[name] = gen("fp8_block_dequant", pair[:1], shape[0], shape[1], 1.0)
            else:
                gain = 2.5 if name.endswith("wo_b.weight") else 1.0
                flat[name], flat[pair[1]] = gen("fp8_block", pair, (), shape[0], shape[1], gain)
            continue
        mean, std, absolute = _plain_init(name, shape)
        flat[name] = gen("normal", (name,), tuple(shape), mean, std, absolute,
                         jnp.dtype(dtypes[0]))

    tree = nest(flat)
    params: dict = {"embed": tree["embed"], "norm": tree["norm"],
                    "head": {"weight": tree["head"]["weight"].astype(jnp.float32)}}
    layers = []
    for role in plan.roles:
        lt = tree["layers"][role.layer]
        lp = {k: v for k, v in lt.items() if k != "ffn"}
        if role.owns_kv and role.ratio > 1:
            comp = lp["attn"]["compressor"]
            for w in ("wkv", "wgate"):
                comp[w] = {"weight": comp[w]["weight"].astype(jnp.float32)}
        ffn = lt["ffn"]
        lp["ffn"] = {"gate": ffn["gate"], "experts": ffn["experts"],
                     "shared_experts": ffn["shared_experts"]}
        layers.append(lp)
    params["layers"] = layers
    if cfg.dspark_on:
        mtp, n = tree["mtp"], cfg.n_mtp_layers
        last = mtp[n - 1]
        heads = ("main_proj", "main_norm", "norm", "markov_head", "confidence_head")
        params["dspark"] = {
            "stages": [{k: v for k, v in mtp[k].items() if k not in heads} for k in range(n)],
            "main_proj": mtp[0]["main_proj"], "main_norm": mtp[0]["main_norm"],
            "norm": last["norm"], "markov_embed": last["markov_head"]["embed"],
            "markov_head": {"weight": last["markov_head"]["head"]["weight"].astype(jnp.float32)},
            "confidence": {"weight": last["confidence_head"]["proj"]["weight"].astype(
                jnp.float32)}}
    if cfg.engram_layer_ids:
        params.update(checkpoint.engram_params(cfg, tokenizer_map))
    return params
