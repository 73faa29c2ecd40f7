"""Memory plan of a config: weights by kind, the inference state, a prefill chunk's
activations, per device for N devices, and whether that fits a device's memory.

Nothing is allocated: the weights are the shapes of the parameter pytree the loader returns
(``jax.eval_shape`` of :func:`dsv41_jax.random_weights.random_params_device`, which builds that
very tree), plus the optional vision tensors of the checkpoint layout
(:func:`dsv41_jax.checkpoint.expected_vision_tensors`); the state is ``jax.eval_shape`` of
:func:`dsv41_jax.state.init_state`; the activations are a formula (:func:`activation_bytes`).
The split over devices: with a mesh (``mesh={"data": D, "tensor": T, "expert": E}``,
``--mesh``) each weight by the sharding table of :mod:`dsv41_jax.sharding` (``PARAM_RULES``
and ``LOGICAL_AXES``, the very specs ``shard_params`` places by: :func:`mesh_weight_bytes`)
and the state and activations by rows over ``data``; without one (``--devices N``) by one
simple rule, :func:`device_share` (experts split, the rest replicated, the batch split).

Command line: ``python scripts/plan_memory.py --config configs/flash.json --batch 8 --context
131072 --devices 8 --engram host --device-gb 141 [--json]`` (:func:`main`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import ml_dtypes
import numpy as np

GB = 1e9   # decimal gigabytes, as GPU memory is quoted (an H200: 141 GB)

#: Weight kinds, in table order, and what each holds.
WEIGHT_KINDS = {
    "attention": "attention & other: attention, indexer, compressors, norms, mHC, MoE gates, "
                 "Engram projections",
    "routed_experts": "routed experts (packed FP4 + E8M0 scales)",
    "shared_experts": "shared experts",
    "embed_head": "embedding + LM head (head in fp32)",
    "engram_tables": "Engram tables (FP8 rows + E8M0 scales)",
    "dspark": "DSpark draft head (mtp.*: 3 blocks of 128 experts, Markov and confidence heads)",
    "vision": "vision tower, aligner, image rows, bias_vl",
}
ENGRAM_PLACES = ("device", "sharded", "host")
DEFAULT_CHUNK = 256    # dsv41-generate's default --chunk


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(getattr(ml_dtypes, str(dtype), None) or dtype).itemsize


def weight_kind(path: str) -> str:
    """The :data:`WEIGHT_KINDS` key of a parameter, from its path in the loaded pytree
    (``"layers/3/ffn/experts/w1/weight"``, ``"embed/weight"``, ...)."""
    parts = path.split("/")
    if parts[0] in ("embed", "head"):
        return "embed_head"
    if parts[0] == "dspark":
        return "dspark"
    if parts[0] in ("vision", "aligner") or parts[0].startswith("image_") or "bias_vl" in parts:
        return "vision"
    if parts[0] == "layers" and len(parts) > 3:
        if parts[2:4] == ["ffn", "experts"]:
            return "routed_experts"
        if parts[2:4] == ["ffn", "shared_experts"]:
            return "shared_experts"
        if parts[2:4] == ["engram", "embed"]:
            return "engram_tables"
    return "attention"


def param_shapes(cfg):
    """``jax.ShapeDtypeStruct`` pytree of the loaded parameters (text model), no allocation."""
    from dsv41_jax import random_weights
    tmap = None
    if cfg.engram_layer_ids:   # any map with the right number of ids: only shapes are used
        tmap = np.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    return jax.eval_shape(lambda: random_weights.random_params_device(cfg, 0, tmap))


def weight_bytes(cfg, shapes=None) -> dict[str, int]:
    """Bytes of the loaded weights (as :func:`dsv41_jax.checkpoint.load_params` places them:
    stored forms, ``wo_a`` in bf16, the head and ratio-2 compressors in fp32) per
    :data:`WEIGHT_KINDS` key; DSpark (``mtp.*``) counted when the config has it on (the
    loader reads it when the checkpoint ships it). ``shapes``: :func:`param_shapes` of
    ``cfg`` when already made."""
    from dsv41_jax import checkpoint
    out = dict.fromkeys(WEIGHT_KINDS, 0)
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes or param_shapes(cfg)):
        out[weight_kind(jax.tree_util.keystr(path, simple=True, separator="/"))] += \
            _nbytes(leaf.shape, leaf.dtype)
    for shape, dtypes in checkpoint.expected_vision_tensors(cfg).values():
        out["vision"] += _nbytes(shape, dtypes[0])
    return out


def largest_placed_tensor(cfg) -> tuple[str, int]:
    """The largest array the streamed loader places (name, bytes): a routed-expert projection
    of one layer stacked over the experts, or the largest other tensor (the loader places those
    above 1 GiB in blocks of rows: :func:`dsv41_jax.checkpoint.stream_params`)."""
    from dsv41_jax import checkpoint
    best = ("", 0)
    for name, (shape, dtypes) in checkpoint.expected_tensors(cfg).items():
        n = _nbytes(shape, dtypes[0])
        parts = name.split(".")
        if ".ffn.experts." in name:
            if parts[4] != "0":
                continue
            n *= cfg.n_routed_experts
            name = ".".join(parts[:4] + parts[5:])
        if n > best[1]:
            best = (name, n)
    return best


def state_bytes(cfg, batch: int, context: int) -> dict[str, int]:
    """Bytes of the inference state (``init_state(cfg, batch, context)`` under
    ``jax.eval_shape``) by part: window rings, main KV, indexer K, compressor tails, encoder
    ring (CED replay), Engram history and positions, DSpark features and stage rings."""
    from dsv41_jax import state as st
    s = jax.eval_shape(lambda: st.init_state(cfg, batch, context))

    def size(*arrs):
        return sum(_nbytes(a.shape, a.dtype) for a in arrs if a is not None)
    srcs = s.sources.values()
    return {
        "window rings": size(s.windows.kv, s.windows.scale),
        "main KV (FP4)": sum(size(x.main, x.main_scale) for x in srcs),
        "indexer K (MXFP4)": sum(size(x.index, x.index_scale) for x in srcs),
        "compressor tails": sum(size(x.tail.kv, x.tail.score) for x in srcs if x.tail),
        "encoder ring": size(s.enc_ring.x, s.enc_ring.pre_mix) if s.enc_ring else 0,
        "Engram history, positions": size(s.engram_history, s.pos),
        "DSpark features and rings": (size(s.dspark.features)
                                      + sum(size(w.kv, w.scale) for w in s.dspark.windows)
                                      if s.dspark else 0),
    }


def activation_bytes(cfg, rows: int, chunk: int, context: int) -> dict[str, int]:
    """A rough estimate of the largest live intermediates of a prefill chunk of ``rows`` x
    ``chunk`` tokens at ``context`` tokens of state, by term (a sum: conservative, since one
    sublayer's intermediates are mostly dead before the next one's):

    * residual streams: mHC ``X`` in and out, bf16 ``[n, C, D]``, and an fp32 temporary;
    * attention: query and output bf16 ``[n, H, K]``, the gathered list of ``index_topk +
      window`` KV rows per query in bf16 (the XLA path gathers them; the GPU kernels read the
      packed rows in place);
    * indexer: fp32 scores and the candidate mask over every entry of the largest source
      ``[n, T]`` (the XLA reference path also holds per-head bf16 dots ``[n, I, T]``: the
      ``indexer per-head dots (XLA path)`` term, not in the total);
    * routed MoE: per routed pair the w1 / w3 / gated outputs bf16 ``[F]`` and an fp32 output
      ``[D]``, and the gate's fp32 scores ``[n, E]``;
    * Engram: the gathered table rows (bf16) and the key/value projection;
    * logits: fp32 ``[rows, V]`` at the last position.

    Returns bytes per term; ``"total"`` sums all but the XLA-path term. ``n = rows * chunk``.
    """
    n = rows * chunk
    C, D, H, K = cfg.hc_mult, cfg.dim, cfg.n_heads, cfg.head_dim
    ratios = [cfg.compress_ratios[i] for i in cfg.kv_source_layers]
    T = max((context // r for r in ratios), default=0)
    k, F, E = cfg.n_activated_experts, cfg.moe_inter_dim, cfg.n_routed_experts
    out = {
        "residual streams": n * C * D * (2 + 2 + 4),
        "attention": n * (2 * H * K * 2 + (cfg.index_topk + cfg.window_size) * K * 2),
        "indexer": n * T * (4 + 1),
        "routed MoE": n * (k * (3 * F * 2 + D * 4) + E * 4),
        "Engram": (n * ((cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
                        * cfg.engram_head_dim * 2 + (C + 1) * D * 2)
                   if cfg.engram_layer_ids else 0),
        "logits": rows * cfg.vocab_size * 4,
    }
    out["total"] = sum(out.values())
    out["indexer per-head dots (XLA path)"] = n * cfg.index_n_heads * T * 2
    return out


# ----------------------------------------------------------------------------- the split rule


def mesh_weight_bytes(cfg, mesh: dict, engram: str, shapes=None) -> dict[str, int]:
    """Bytes per device of each :data:`WEIGHT_KINDS` kind on a mesh of axis sizes ``mesh``
    (``{"data": D, "tensor": T, "expert": E}``): each loaded parameter split as
    :func:`dsv41_jax.sharding.spec_for` splits it (the logical axes of ``PARAM_RULES`` for its
    path within a layer; no ``jax.Array`` made, an ``AbstractMesh``). Engram tables: ``engram``
    ``"device"`` replicated, ``"sharded"`` rows over every device (padded to a multiple of the
    device count, as ``shard_params(..., engram="sharded")`` does), ``"host"`` 0. Vision
    tensors are replicated. ``shapes``: :func:`param_shapes` of ``cfg`` when already made."""
    from dsv41_jax import checkpoint
    amesh, n_dev = _abstract_mesh(mesh)
    out = dict.fromkeys(WEIGHT_KINDS, 0)
    for p, kind, shape, dtype in _leaves(shapes or param_shapes(cfg)):
        out[kind] += _mesh_leaf_bytes(p, kind, shape, dtype, mesh, amesh, n_dev, engram)
    for shape, dtypes in checkpoint.expected_vision_tensors(cfg).values():
        out["vision"] += _nbytes(shape, dtypes[0])
    return out


def _abstract_mesh(mesh: dict):
    """``(AbstractMesh, device count)`` of axis sizes ``mesh``."""
    from dsv41_jax import sharding
    return (jax.sharding.AbstractMesh(tuple(mesh[a] for a in sharding.MESH_AXES),
                                      sharding.MESH_AXES), math.prod(mesh.values()))


def _leaves(shapes):
    """``(path, kind, shape, dtype)`` of every parameter of :func:`param_shapes`' tree."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        p = jax.tree_util.keystr(path, simple=True, separator="/")
        yield p, weight_kind(p), tuple(leaf.shape), leaf.dtype


def _mesh_leaf_bytes(p: str, kind: str, shape: tuple, dtype, mesh: dict, amesh, n_dev: int,
                     engram: str) -> int:
    """Bytes per device of one parameter on a mesh (:func:`mesh_weight_bytes`' rule)."""
    import re

    from dsv41_jax import sharding
    if kind == "engram_tables":
        row = _nbytes(shape[1:], dtype)
        return {"device": shape[0] * row, "sharded": -(-shape[0] // n_dev) * row,
                "host": 0}[engram]
    logical = sharding.param_logical_axes(re.sub(r"^layers/\d+/", "", p), len(shape))
    spec = sharding.spec_for(logical, shape, amesh)
    split = math.prod(math.prod(mesh[a] for a in (ax if isinstance(ax, tuple) else (ax,)))
                      for ax in spec if ax is not None)
    return _nbytes(shape, dtype) // split


def _largest_layer_tables(shapes) -> int:
    """Bytes of the largest layer's Engram tables (0 without Engram)."""
    per_layer: dict[str, int] = {}
    for p, kind, shape, dtype in _leaves(shapes):
        if kind == "engram_tables":
            layer = p.split("/")[1]
            per_layer[layer] = per_layer.get(layer, 0) + _nbytes(shape, dtype)
    return max(per_layer.values(), default=0)


def largest_layer_bytes(cfg, *, devices: int = 1, engram: str = "device",
                        mesh: dict | None = None, shapes=None) -> int:
    """Bytes per device of the largest layer's parameters, split as :func:`plan` splits the
    weights (``mesh``: by the sharding table, else :func:`device_share`): what
    ``prepare_params(..., donate=True)`` holds twice at most while it converts one layer."""
    per_layer: dict[int, int] = {}
    amesh, n_dev = _abstract_mesh(mesh) if mesh is not None else (None, None)
    for p, kind, shape, dtype in _leaves(shapes or param_shapes(cfg)):
        if not p.startswith("layers/"):
            continue
        if mesh is None:
            b = math.ceil(_nbytes(shape, dtype) * device_share(
                kind, devices=devices, engram=engram, n_routed_experts=cfg.n_routed_experts))
        else:
            b = _mesh_leaf_bytes(p, kind, shape, dtype, mesh, amesh, n_dev, engram)
        layer = int(p.split("/")[1])
        per_layer[layer] = per_layer.get(layer, 0) + b
    return max(per_layer.values(), default=0)


def rows_per_device(batch: int, devices: int) -> int:
    """Sequences of the batch one device holds: ``ceil(batch / devices)`` when ``batch >=
    devices`` (data parallel over the batch), else the whole batch (every device runs every
    row)."""
    return -(-batch // devices) if batch >= devices else batch


def device_share(kind: str, *, devices: int, n_routed_experts: int, engram: str) -> float:
    """The fraction of a weight kind's bytes that one device holds, the one split rule of
    the plan: routed experts split across the devices, whole experts each
    (``ceil(E / N) / E``: expert parallel); Engram tables replicated (``engram="device"``),
    split by rows (``"sharded"``) or in host memory (``"host"``: 0 on the device); every other
    weight replicated (1). The state and the activations are split by :func:`rows_per_device`.
    """
    if kind == "routed_experts":
        return -(-n_routed_experts // devices) / n_routed_experts
    if kind == "engram_tables":
        return {"device": 1.0, "sharded": 1.0 / devices, "host": 0.0}[engram]
    return 1.0


#: What ``engram="host"`` does (``shard_params(..., engram="host")``, the sliced loader), as
#: the plan prints it.
HOST_ENGRAM = ("in the devices' pinned host memory, rows split over every device (one host "
               "holds the whole tables once, each of n hosts 1/n: counted here as one host); "
               "loaded, stacked and kept there, never in the devices' memory; each step "
               "gathers the rows it reads on the host and moves only those to the device")


def assumptions(cfg, devices: int, engram: str) -> list[str]:
    """The plan's assumptions, as printed."""
    e_dev = -(-cfg.n_routed_experts // devices)
    where = {"device": "on every device (replicated)",
             "sharded": f"on the devices, rows split {devices} ways",
             "host": HOST_ENGRAM}[engram]
    return [
        f"routed experts split across the {devices} device(s): {e_dev} of "
        f"{cfg.n_routed_experts} per device (expert parallel); every other weight replicated",
        f"Engram tables {where}",
        "state and activations split by data parallelism over the batch when batch >= "
        "devices (ceil(batch / devices) rows per device), else the whole batch on every device",
        "weights as the loader places them (stored FP8 / FP4 forms, wo_a in bf16, head and "
        "ratio-2 compressors in fp32): prepare_params(linears='stored'), the GPU default, keeps "
        "them; on a CPU ('bf16') the FP8 linears are dequantised, about twice their bytes",
        "load peak: the loaders' prepare_params(..., donate=True) converts one layer and stacks "
        "the scanned groups while deleting what it has used, so the weights plus the largest "
        "layer once more",
        "activations: a rough estimate of one prefill chunk's largest intermediates "
        "(activation_bytes); XLA's workspace, fragmentation and compiled-program buffers are not "
        "counted: keep headroom",
        "mtp.* (DSpark) counted when the config has it on; GB = 1e9 bytes",
    ]


def mesh_assumptions(cfg, mesh: dict, engram: str) -> list[str]:
    """The plan's assumptions on a mesh, as printed."""
    n = math.prod(mesh.values())
    where = {"device": "on every device (replicated)",
             "sharded": f"on the devices, rows split {n} ways (padded to a multiple)",
             "host": HOST_ENGRAM}[engram]
    rest = assumptions(cfg, n, engram)[3:]
    return [f"mesh data={mesh['data']}, tensor={mesh['tensor']}, expert={mesh['expert']}: "
            f"weights split by dsv41_jax.sharding's table (query heads, output groups and "
            f"vocabulary over tensor, {cfg.n_routed_experts // mesh['expert']} of "
            f"{cfg.n_routed_experts} routed experts per device over expert, the rest "
            f"replicated); replicated over data",
            f"Engram tables {where}",
            f"state and activations split by rows over data: ceil(batch / {mesh['data']}) "
            f"rows per device"] + rest


def plan(cfg, *, batch: int, context: int, devices: int = 1, engram: str = "device",
         chunk: int = DEFAULT_CHUNK, device_gb: float = 141.0, config_name: str = "",
         mesh: dict | None = None) -> dict:
    """The memory plan of ``cfg`` as a dict (what ``--json`` prints): ``weights`` (total bytes
    per kind), ``state`` (total bytes per part, whole batch), ``per_device`` (bytes per kind,
    ``state``, ``activations``, ``total``, ``load_peak``), ``activations`` (per device, by
    term), ``host`` (bytes in host memory per process), ``fits`` / ``load_fits`` (against
    ``device_gb`` GB), ``assumptions``.

    ``mesh``: axis sizes ``{"data": D, "tensor": T, "expert": E}`` (``devices`` is then
    their product): the weights split by the sharding table (:func:`mesh_weight_bytes`), the
    state and activations by ``ceil(batch / D)`` rows per device.

    Raises ``ValueError`` naming the argument for a batch, context, devices or chunk below 1,
    a ``device_gb`` not above 0, an ``engram`` not in :data:`ENGRAM_PLACES`, a ``mesh`` whose
    product differs from a ``devices`` other than 1, or whose ``expert`` size does not divide
    the routed experts.
    """
    if mesh is not None:
        n = math.prod(mesh.values())
        if devices not in (1, n):
            raise ValueError(f"devices={devices} differs from the mesh's {n} devices")
        if cfg.n_routed_experts % mesh["expert"]:
            raise ValueError(f"mesh: n_routed_experts={cfg.n_routed_experts} does not divide "
                             f"by expert={mesh['expert']}")
        devices = n
    for name, v in (("batch", batch), ("context", context), ("devices", devices),
                    ("chunk", chunk)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if not device_gb > 0:
        raise ValueError(f"device_gb must be > 0, got {device_gb!r}")
    if engram not in ENGRAM_PLACES:
        raise ValueError(f"engram must be one of {ENGRAM_PLACES}, got {engram!r}")
    from dsv41_jax import checkpoint
    shapes = param_shapes(cfg)
    weights = weight_bytes(cfg, shapes)
    if mesh is None:
        rows = rows_per_device(batch, devices)
        per_dev = {k: math.ceil(v * device_share(k, devices=devices, engram=engram,
                                                 n_routed_experts=cfg.n_routed_experts))
                   for k, v in weights.items()}
    else:
        rows = -(-batch // mesh["data"])
        per_dev = mesh_weight_bytes(cfg, mesh, engram, shapes)
    state_total = state_bytes(cfg, batch, context)
    state_dev = sum(state_bytes(cfg, rows, context).values())
    acts = activation_bytes(cfg, rows, min(chunk, context), context)
    per_dev_weights = sum(per_dev.values())
    per_dev.update(weights=per_dev_weights, state=state_dev, activations=acts["total"])
    per_dev["total"] = per_dev_weights + state_dev + acts["total"]
    # prepare_params(..., donate=True) holds the largest layer twice at most, before the state
    # exists
    per_dev["load_peak"] = per_dev_weights + largest_layer_bytes(
        cfg, devices=devices, engram=engram, mesh=mesh, shapes=shapes)
    limit = device_gb * GB
    name, largest = largest_placed_tensor(cfg)
    block = min(largest, checkpoint.BLOCK_BYTES)
    host = {"Engram tables": weights["engram_tables"] if engram == "host" else 0,
            "load: one layer's Engram tables again while prepare_params stacks them": (
                _largest_layer_tables(shapes) if engram == "host" else 0),
            "streamed load: one block (min(largest tensor, 1 GiB)) x 3": 3 * block,
            "load on one GPU: the routed experts in pinned host memory while prepare_params "
            "pools them": weights["routed_experts"] if devices == 1 else 0}
    return {
        "config": config_name, "batch": batch, "context": context, "chunk": min(chunk, context),
        "devices": devices, "mesh": mesh, "engram": engram, "device_gb": device_gb,
        "rows_per_device": rows,
        "experts_per_device": -(-cfg.n_routed_experts // (devices if mesh is None
                                                           else mesh["expert"])),
        "weights": weights, "weights_total": sum(weights.values()),
        "state": state_total, "state_total": sum(state_total.values()),
        "activations": acts, "per_device": per_dev,
        "largest_placed_tensor": {"name": name, "bytes": largest,
                                  "blocks": -(-largest // block)},
        "host": host,
        "fits": per_dev["total"] <= limit, "load_fits": per_dev["load_peak"] <= limit,
        "free_per_device": limit - per_dev["total"],
        "assumptions": assumptions(cfg, devices, engram) if mesh is None
        else mesh_assumptions(cfg, mesh, engram),
    }


def format_plan(p: dict) -> str:
    """The plan as a table (what the command prints without ``--json``)."""
    def gb(b):
        return f"{b / GB:10.2f} GB"
    pd = p["per_device"]
    lines = [f"memory plan: {p['config'] or 'config'}, batch {p['batch']}, context "
             f"{p['context']} tokens, prefill chunk {p['chunk']}, {p['devices']} device(s) of "
             f"{p['device_gb']:g} GB"
             + ("" if not p.get("mesh") else " (mesh " + ",".join(
                 f"{k}={v}" for k, v in p["mesh"].items()) + ")")
             + f", Engram tables: {p['engram']}",
             "", f"{'':44s}{'total':>13s}{'per device':>15s}", "weights"]
    for k, label in WEIGHT_KINDS.items():
        name = label.split(" (")[0].split(":")[0]       # the label's name, without its details
        lines.append(f"  {name:42s}{gb(p['weights'][k])}  {gb(pd[k])}")
    lines.append(f"  {'all weights':42s}{gb(p['weights_total'])}  {gb(pd['weights'])}")
    lines.append(f"inference state (batch {p['batch']}; {p['rows_per_device']} row(s) per "
                 f"device)")
    for k, v in p["state"].items():
        lines.append(f"  {k:42s}{gb(v)}")
    lines.append(f"  {'all state':42s}{gb(p['state_total'])}  {gb(pd['state'])}")
    a = p["activations"]
    lines.append(f"activations, one prefill chunk of {p['rows_per_device']} x {p['chunk']} "
                 f"tokens per device (rough)")
    for k, v in a.items():
        if k != "total":
            lines.append(f"  {k:42s}{'':13s}  {gb(v)}")
    lines.append(f"  {'total (without the XLA-path term)':42s}{'':13s}  {gb(a['total'])}")
    lines.append("")
    verdict = "fits" if p["fits"] else "does NOT fit"
    lines.append(f"{'per device: weights + state + activations':44s}{'':13s}  {gb(pd['total'])}"
                 f"  {verdict} in {p['device_gb']:g} GB ({p['free_per_device'] / GB:+.2f} GB "
                 "free)")
    verdict = "fits" if p["load_fits"] else "does NOT fit"
    lines.append(f"{'per device at load (prepare_params stacking)':44s}{'':13s}  "
                 f"{gb(pd['load_peak'])}  {verdict}")
    lines.append("host memory per process")
    for k, v in p["host"].items():
        lines.append(f"  {k:64s}{gb(v)}")
    big = p["largest_placed_tensor"]
    lines.append(f"  (largest placed tensor: {big['name']}, {big['bytes'] / GB:.2f} GB, placed "
                 f"in {big['blocks']} block{'s' * (big['blocks'] > 1)})")
    lines.append("assumptions:")
    lines += [f"  - {s}" for s in p["assumptions"]]
    return "\n".join(lines)


def build_parser():
    from dsv41_jax.cli.args import Parser, mesh_spec, positive_int

    def positive_float(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {v:g}")
        return v

    default = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                            "configs", "flash.json"))
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=default, help="config.json (default: the release "
                    "config, configs/flash.json)")
    ap.add_argument("--batch", type=positive_int, required=True, help="sequences, >= 1")
    ap.add_argument("--context", type=positive_int, required=True,
                    help="tokens of state per sequence, >= 1")
    ap.add_argument("--devices", type=positive_int, default=1, help="devices, >= 1 (default 1)")
    ap.add_argument("--mesh", type=mesh_spec, default=None, metavar="data=D,tensor=T,expert=E",
                    help="split the weights by the sharding table over this mesh (instead of "
                         "--devices' simple rule; its product is the device count)")
    ap.add_argument("--engram", choices=ENGRAM_PLACES + ("replicated",), default="device",
                    help="Engram tables: replicated on every device (device, or replicated as "
                    "dsv41-generate calls it), split by rows across the devices (sharded), or "
                    "in host memory (host); default device")
    ap.add_argument("--chunk", type=positive_int, default=DEFAULT_CHUNK,
                    help=f"prefill chunk in tokens for the activations (default {DEFAULT_CHUNK})")
    ap.add_argument("--device-gb", type=positive_float, default=141.0,
                    help="memory of one device in GB (1e9 bytes; default 141, an H200)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv=None) -> int:
    """``plan_memory.py``: print the plan of ``--config`` (a table, or ``--json``). Returns
    0, or 1 with a one-line error for a config that does not load."""
    from dsv41_jax.config import ModelConfig

    args = build_parser().parse_args(argv)
    try:
        cfg = ModelConfig.from_json(args.config)
        p = plan(cfg, batch=args.batch, context=args.context, devices=args.devices,
                 engram="device" if args.engram == "replicated" else args.engram,
                 chunk=args.chunk, device_gb=args.device_gb,
                 config_name=args.config, mesh=args.mesh)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(p, indent=1) if args.json else format_plan(p))
    return 0
