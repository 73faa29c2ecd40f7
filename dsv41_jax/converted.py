"""Converted parameters saved and restored with orbax (docs/architecture.md, "Sharding").

A reference checkpoint is converted at load time (experts stacked, ``wo_a`` dequantised, the
layers stacked into scanned groups, the forms of :func:`dsv41_jax.model.prepare_params`).
:func:`save_converted` writes that prepared tree with ``orbax.checkpoint``
(``StandardCheckpointer``) beside a ``converted.json`` holding the config and where the
weights came from; :func:`restore_converted` reads it back straight into the shardings of a
mesh (each leaf a :class:`jax.ShapeDtypeStruct` carrying the
:class:`~jax.sharding.NamedSharding` of :func:`dsv41_jax.sharding.param_shardings`: every
device reads its own part), so a second start skips the reading and the conversion.

Layout of a directory: ``converted.json`` (``{"format": 1, "config": {...}, "source":
"..."}``) and ``params/`` (orbax's files). The leaves keep the forms they were prepared in
(e.g. bf16 ``dq`` linears on a CPU, stored FP8 / kernel-form experts on a GPU); every entry
point runs every form.
"""

from __future__ import annotations

import json
import os

import jax

from dsv41_jax import sharding
from dsv41_jax.config import ModelConfig

#: Version of the directory layout written by :func:`save_converted`.
FORMAT = 1
_INFO = "converted.json"
_PARAMS = "params"


def converted_info(directory: str | os.PathLike) -> dict | None:
    """The ``converted.json`` of a directory written by :func:`save_converted` (``format``,
    ``config``, ``source``), or None when ``directory`` holds no complete save (missing, or
    the orbax files not committed)."""
    info = os.path.join(directory, _INFO)
    params = os.path.join(directory, _PARAMS)
    if not (os.path.isfile(info) and os.path.isdir(params)):
        return None
    with open(info) as f:
        return json.load(f)


def save_converted(directory: str | os.PathLike, params, cfg: ModelConfig, *,
                   source: str = "", overwrite: bool = False) -> str:
    """Save the prepared ``params`` (:func:`dsv41_jax.model.prepare_params`; on one device or
    placed on a mesh) of ``cfg`` to ``directory`` with orbax, beside ``converted.json`` (the
    config and ``source``, a free text naming where the weights came from, checked again by
    :func:`restore_converted`). Returns the directory's absolute path.

    Raises ``ValueError`` for a tree not prepared (no ``layer_groups``) or a ``directory``
    that already holds a save (unless ``overwrite``) or is a file."""
    if not isinstance(params, dict) or "layer_groups" not in params:
        raise ValueError("params must be prepared (dsv41_jax.model.prepare_params(params, cfg)) "
                         "before save_converted: the save holds the converted tree")
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"directory: {directory} is a file")
    if converted_info(directory) is not None and not overwrite:
        raise ValueError(f"directory: {directory} already holds converted parameters (pass "
                         f"overwrite=True to replace them)")
    import orbax.checkpoint as ocp

    os.makedirs(directory, exist_ok=True)
    info = os.path.join(directory, _INFO)
    if os.path.exists(info):
        os.remove(info)   # an interrupted save leaves no converted.json: never half a save
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(directory, _PARAMS), params, force=True)
        ckpt.wait_until_finished()
    if jax.process_index() == 0:
        with open(info + ".tmp", "w") as f:
            json.dump({"format": FORMAT, "config": cfg.to_dict(), "source": source}, f,
                      indent=1)
        os.replace(info + ".tmp", info)
    return directory


def _config_diff(a: dict, b: dict) -> list[str]:
    return [f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def restore_converted(directory: str | os.PathLike, cfg: ModelConfig, *, mesh=None,
                      source: str | None = None, engram: str = "replicated"):
    """The prepared parameters saved by :func:`save_converted` in ``directory``, read straight
    into their places: on ``mesh`` (:func:`dsv41_jax.sharding.make_mesh`) each leaf in the
    :class:`~jax.sharding.NamedSharding` of :func:`dsv41_jax.sharding.param_shardings` (what
    :func:`~dsv41_jax.sharding.shard_params` would give), without a mesh on JAX's default
    device. Shapes and dtypes come from the save's metadata, so the leaves keep the forms they
    were saved in. ``engram``: as in :func:`~dsv41_jax.sharding.shard_params` (a table's rows
    split only where the saved rows divide by the device count: save a tree placed with
    ``engram="sharded"``, whose tables are padded, to restore it split).

    Raises ``ValueError`` when ``directory`` holds no save, its format is unknown, its config
    differs from ``cfg`` (naming the first fields), its source differs from ``source`` (when
    given), or the mesh is not of :func:`~dsv41_jax.sharding.make_mesh` or its ``expert`` axis
    does not divide the routed experts."""
    directory = os.path.abspath(directory)
    info = converted_info(directory)
    if info is None:
        raise ValueError(f"directory: {directory} holds no converted parameters (no "
                         f"{_INFO} and {_PARAMS}/; write them with save_converted)")
    if info.get("format") != FORMAT:
        raise ValueError(f"directory: {directory} has format {info.get('format')!r}; this "
                         f"version reads format {FORMAT}")
    diff = _config_diff(info["config"], cfg.to_dict())
    if diff:
        raise ValueError(f"directory: {directory} was converted for another config ("
                         + ", ".join(diff[:4]) + (", ..." if len(diff) > 4 else "") + ")")
    if source is not None and info.get("source") != source:
        raise ValueError(f"directory: {directory} was converted from {info.get('source')!r}, "
                         f"not {source!r}")
    if mesh is not None:
        sharding.check_mesh(mesh)
        sharding.check_experts(cfg, mesh)
        sharding.logical_axes_table(engram)   # ValueError for an unknown engram
    import orbax.checkpoint as ocp

    path = os.path.join(directory, _PARAMS)
    with ocp.StandardCheckpointer() as ckpt:
        tree = ckpt.metadata(path).item_metadata.tree
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)
        abstract["layer_groups"] = tuple(tuple(runs) for runs in abstract["layer_groups"])
        if mesh is None:
            one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            places = jax.tree.map(lambda _: one, abstract)
        else:
            places = sharding.param_shardings(abstract, mesh, engram=engram)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract, places)
        return ckpt.restore(path, target)

