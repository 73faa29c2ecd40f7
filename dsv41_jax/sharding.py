"""Tensor, expert and data parallelism over a device mesh (docs/architecture.md, "Sharding").

The mesh has three axes, :data:`MESH_AXES` = ``("data", "tensor", "expert")``
(:func:`make_mesh`). Where every array goes is one table: each array axis has a *logical*
name, and :data:`LOGICAL_AXES` maps a logical name to the mesh axis it is split over (``None``:
replicated). Parameters get their logical axes by path (:data:`PARAM_RULES`, on the tree of
:func:`dsv41_jax.model.prepare_params`); every leaf of the inference state has the batch first
(:func:`state_shardings`).

* ``data``: the batch rows of the state and of the activations (data parallelism); the
  parameters are replicated over it.
* ``tensor``: the query heads (``wq_b``'s output rows, ``attn_sink``), the output projection's
  groups (``wo_a``'s rows) and the vocabulary (embedding and LM head rows). No contraction is
  split: the attention is per head, ``wo_a`` per group and the head per vocabulary row, so
  sharding over ``tensor`` changes no summation order. The single 512-wide KV latent, the
  indexer (its heads included), the compressors, ``wq_a``, ``wkv``, ``wo_b``, the shared expert
  and the gate are replicated.
* ``expert``: the routed experts (expert parallelism): each shard holds ``E / expert`` whole
  experts; the routing is replicated, each shard runs its own experts for all tokens and a
  ``psum`` over ``expert`` combines (:func:`dsv41_jax.layers.moe.moe`).

* Engram tables (``engram_rows``): replicated, or with ``shard_params(..., engram="sharded")``
  their rows split over every device, or with ``engram="host"`` split the same way in the
  devices' host memory (memory kind ``"pinned_host"``): the steps gather the rows they read on
  the host and move only those to the device (:data:`ENGRAM_PLACES`).

A dimension whose size the mesh axis does not divide is replicated instead (e.g. 4 heads on
``tensor = 8``), except the routed experts, whose count must divide by ``expert``
(``ValueError``), and the batch of the state, which must divide by ``data`` (``ValueError``).

Usage: ``mesh = make_mesh(data=2, tensor=2, expert=2)``; ``params = shard_params(prepare_params(
params, cfg), cfg, mesh)``; ``state = shard_state(init_state(cfg, B, L), mesh)``; then
``prefill(..., mesh=mesh)`` / ``decode_step(..., mesh=mesh)`` / ``generate(..., mesh=mesh)``
(the entry points take the mesh as a keyword, a static argument of the compiled step). The
command lines write a mesh ``--mesh data=1,tensor=2,expert=4`` (:func:`parse_mesh_spec`).
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from dsv41_jax.config import ModelConfig

#: The mesh axes, in the order of :func:`make_mesh`'s arguments.
MESH_AXES = ("data", "tensor", "expert")

#: Logical axis -> the mesh axis it is split over (``None``: replicated). The one table.
LOGICAL_AXES: dict[str, str | None] = {
    "batch": "data",          # rows of the state and of the activations
    "q_heads": "tensor",      # query heads: wq_b's output rows [H*K], attn_sink [H]
    "o_groups": "tensor",     # output projection groups: wo_a's rows [G*O]
    "vocab": "tensor",        # embedding and LM head rows [V]
    "experts": "expert",      # routed experts [E]
    "expert_hidden": None,    # a routed / shared expert's hidden [F] (kept whole: see module doc)
    "latent": None,           # the shared KV latent [K] (one KV head: never split)
    "index_heads": None,      # indexer heads: replicated, as engines do
    "embed": None,            # model width [D]
    "engram_rows": None,      # Engram table rows: replicated, or ENGRAM_ROW_AXES (shard_params)
    "stack": None,            # [units, layers] of a scanned layer group (no pipelining)
}

#: Where the Engram tables' rows go (``shard_params(..., engram=)``): ``"replicated"`` (the
#: table's entry, every device a whole table), ``"sharded"`` (rows split over every device:
#: :data:`ENGRAM_ROW_AXES`; the row gather is then partitioned by the compiler, each device
#: gathering its rows and an all-reduce adding exact zeros for the others) or ``"host"``
#: (split as ``"sharded"``, in the devices' host memory, :data:`HOST_MEMORY_KIND`: each
#: device's rows in pinned host memory, one host holding the whole tables once; the step
#: gathers the rows on the host, ``compute_on("device_host")``, and moves only those to the
#: device: :func:`dsv41_jax.layers.engram.gather_rows`).
ENGRAM_PLACES = ("replicated", "sharded", "host")
ENGRAM_ROW_AXES = MESH_AXES
#: The memory kind of the Engram tables with ``engram="host"``.
HOST_MEMORY_KIND = "pinned_host"
_ENGRAM_TABLE = re.compile(r"engram/embed/(weight|scale)$")

#: Parameter path (a regular expression, full match, on the leaf's path in the prepared tree
#: with ``layer_groups/<group>/<run>/`` removed) -> the logical axes of the leaf's dimensions
#: (after the two stack axes of a layer group). Linear weights appear in every prepared form:
#: ``weight`` / ``dq`` / ``fp8`` ``[out, in]`` with its E8M0 ``scale`` ``[out/32, in/32]``,
#: routed experts as ``fp4`` / ``weight`` ``[E, N, K/2]`` + ``scale`` ``[E, N, K/32]`` or the
#: kernel form ``i4`` ``[E, N, K]`` + ``scale_t`` ``[E, K/32, N]``. Leaves no rule names are
#: replicated.
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed/weight", ("vocab", "embed")),
    (r"head/weight", ("vocab", "embed")),
    (r"attn/wq_b/(weight|dq|fp8|scale)", ("q_heads", None)),
    (r"attn/attn_sink", ("q_heads",)),
    (r"attn/wo_a/(weight|dq|fp8|scale)", ("o_groups", None)),
    (r"ffn/experts/w[123]/(weight|dq|fp4|scale|i4|scale_t)", ("experts", None, None)),
    (r"engram/embed/(weight|scale)", ("engram_rows", None)),
)


def make_mesh(data=1, tensor=1, expert=1, devices=None) -> Mesh:
    """A :class:`jax.sharding.Mesh` with axes :data:`MESH_AXES` of sizes ``(data, tensor,
    expert)`` over ``devices`` (default: all of JAX's devices), every axis of type ``Auto``
    (the compiler propagates the shardings of the placed arrays; the MoE's expert axis is made
    manual by its ``shard_map``).

    Raises ``ValueError`` for a size that is not a positive int, or a product of the sizes that
    differs from the number of devices."""
    sizes = {"data": data, "tensor": tensor, "expert": expert}
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"mesh axis {name!r} must be a positive int, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    total = data * tensor * expert
    if total != len(devices):
        hint = ""
        if devices and all(d.platform == "cpu" for d in devices) and total > len(devices):
            hint = (f"; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={total} "
                    f"set before JAX starts gives {total} devices")
        raise ValueError(f"mesh (data={data}, tensor={tensor}, expert={expert}) needs "
                         f"{total} devices but {len(devices)} were given (the product of the "
                         f"axis sizes must equal the device count{hint})")
    return jax.make_mesh((data, tensor, expert), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def parse_mesh_spec(text: str, flag: str | None = "--mesh") -> dict[str, int]:
    """The axis sizes of a mesh written ``"data=1,tensor=2,expert=4"`` (the command lines'
    ``--mesh``): a comma list of ``axis=size`` with axes of :data:`MESH_AXES`, each at most
    once, sizes positive ints; an axis left out has size 1. Returns ``{"data": ..., "tensor":
    ..., "expert": ...}`` for :func:`make_mesh` (``make_mesh(**parse_mesh_spec(text))``).

    Raises ``ValueError`` starting with ``flag`` (when not None) for an empty spec, an item
    without ``=``, an unknown or repeated axis, or a size that is not an integer >= 1."""
    pre = f"{flag}: " if flag else ""
    sizes = dict.fromkeys(MESH_AXES, 1)
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{pre}empty mesh spec {text!r}; expected e.g. "
                         f"'data=1,tensor=2,expert=4'")
    seen = set()
    for item in items:
        name, eq, value = (x.strip() for x in item.partition("="))
        if not eq:
            raise ValueError(f"{pre}{item!r} is not axis=size (e.g. 'tensor=2')")
        if name not in MESH_AXES:
            raise ValueError(f"{pre}unknown mesh axis {name!r}; the axes are "
                             f"{', '.join(MESH_AXES)}")
        if name in seen:
            raise ValueError(f"{pre}mesh axis {name!r} given twice")
        seen.add(name)
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"{pre}the size of {name!r} must be an integer >= 1, got "
                             f"{value!r}") from None
        if n < 1:
            raise ValueError(f"{pre}the size of {name!r} must be an integer >= 1, got {n}")
        sizes[name] = n
    return sizes


def axis_size(mesh: Mesh | AbstractMesh | None, axis: str) -> int:
    """The size of mesh axis ``axis`` (1 without a mesh or without that axis)."""
    if mesh is None:
        return 1
    return dict(mesh.shape).get(axis, 1)


def check_mesh(mesh):
    """``mesh`` if its axes are :data:`MESH_AXES` (a mesh of :func:`make_mesh`), else
    ``ValueError``."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (make_mesh), got {type(mesh)}")
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes must be {MESH_AXES} (make_mesh), got {mesh.axis_names}")
    return mesh


def logical_axes_table(engram: str = "replicated") -> dict:
    """:data:`LOGICAL_AXES` with the Engram rows placed as ``engram`` says
    (:data:`ENGRAM_PLACES`; ``ValueError`` otherwise)."""
    if engram not in ENGRAM_PLACES:
        raise ValueError(f"engram must be one of {ENGRAM_PLACES}, got {engram!r}")
    if engram == "replicated":
        return LOGICAL_AXES
    return dict(LOGICAL_AXES, engram_rows=ENGRAM_ROW_AXES)


def host_memory_kind(device: Any) -> str:
    """:data:`HOST_MEMORY_KIND` if ``device`` (a ``jax.Device``, e.g. a mesh's
    ``mesh.devices.flat[0]``) has that memory (GPUs, TPUs; JAX 0.11's CPU devices too), else
    ``ValueError`` naming the backend and the memories it has."""
    kinds = sorted(m.kind for m in device.addressable_memories())
    if HOST_MEMORY_KIND not in kinds:
        raise ValueError(f"engram='host' needs the memory kind {HOST_MEMORY_KIND!r}, which "
                         f"the {device.platform} backend's devices do not have (they have "
                         f"{kinds}); use engram='sharded' or 'replicated'")
    return HOST_MEMORY_KIND


def is_engram_table(path: str) -> bool:
    """Whether the parameter at ``path`` (``"layer_groups/0/1/engram/embed/weight"``) is an
    Engram table (its FP8 rows or their E8M0 scales)."""
    return bool(_ENGRAM_TABLE.search(path))


def _axes_size(mesh, axis) -> int:
    """The size of a mesh axis or of a tuple of mesh axes (their product)."""
    if isinstance(axis, tuple):
        return math.prod(axis_size(mesh, a) for a in axis)
    return axis_size(mesh, axis)


def spec_for(logical: tuple[str | None, ...], shape: tuple[int, ...],
             mesh: Mesh | AbstractMesh, *, engram: str = "replicated") -> P:
    """The :class:`PartitionSpec` of an array of ``shape`` whose dimensions have the logical
    axes ``logical`` (``None``: replicated), by :data:`LOGICAL_AXES` (the Engram rows as
    ``engram`` says) on ``mesh`` (a device mesh, or an ``AbstractMesh`` of the same axes for a
    plan). A dimension the mesh axis (or axes) does not divide is replicated."""
    table = logical_axes_table(engram)
    out = []
    for name, n in zip(logical, shape):
        axis = table[name] if name is not None else None
        out.append(axis if axis is not None and n % _axes_size(mesh, axis) == 0
                   and _axes_size(mesh, axis) > 1 else None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def param_logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of the parameter at ``path`` (``"layer_groups/0/1/attn/wq_b/dq"``) of
    rank ``ndim``, by :data:`PARAM_RULES`: a layer group's leaf starts with two ``"stack"``
    axes, a leaf of the pooled routed experts (``"routed_experts/w1/i4"``, ``[layers, E, N,
    K]``: :func:`dsv41_jax.model.prepare_params`) with one, its rule that of a layer's experts.
    Raises ``ValueError`` where a rule's rank does not fit the leaf's."""
    lead: tuple[str | None, ...] = ()
    m = re.fullmatch(r"layer_groups/\d+/\d+/(.*)", path)
    if m:
        path, lead = m.group(1), ("stack", "stack")
    m = re.fullmatch(r"routed_experts/(.*)", path)    # the pooled experts: [layers, E, ...]
    if m:
        path, lead = "ffn/experts/" + m.group(1), ("stack",)
    for pattern, axes in PARAM_RULES:
        if re.fullmatch(pattern, path):
            if len(lead) + len(axes) != ndim:
                raise ValueError(f"sharding rule {pattern!r} gives {len(lead) + len(axes)} axes "
                                 f"but parameter {path!r} has rank {ndim}")
            return lead + axes
    return (lead + (None,) * ndim)[:ndim]


def param_specs(params, mesh: Mesh, *, engram: str = "replicated"):
    """A pytree like ``params`` (the tree of :func:`dsv41_jax.model.prepare_params`) of
    :class:`PartitionSpec` s, by :data:`PARAM_RULES` and :data:`LOGICAL_AXES` (the Engram
    rows as ``engram`` says, :data:`ENGRAM_PLACES`)."""
    def one(path, leaf):
        shape = tuple(np.shape(leaf))
        return spec_for(param_logical_axes(_path_str(path), len(shape)), shape, mesh,
                        engram=engram)
    return jax.tree_util.tree_map_with_path(one, params)


def param_shardings(params, mesh: Mesh, *, engram: str = "replicated"):
    """:func:`param_specs` as :class:`NamedSharding` s on ``mesh``; with ``engram="host"``
    the Engram tables' in the memory kind :func:`host_memory_kind` (``ValueError`` on a
    backend without it)."""
    host = host_memory_kind(mesh.devices.flat[0]) if engram == "host" else None

    def one(path, spec):
        kind = host if host and is_engram_table(_path_str(path)) else None
        return NamedSharding(mesh, spec, memory_kind=kind)
    return jax.tree_util.tree_map_with_path(one, param_specs(params, mesh, engram=engram),
                                            is_leaf=lambda s: isinstance(s, P))


def on_mesh(params, mesh: Mesh) -> bool:
    """Whether every leaf of ``params`` is a ``jax.Array`` placed on ``mesh`` (a
    :class:`NamedSharding` of that mesh, whatever its spec)."""
    leaves = jax.tree.leaves(params)
    return bool(leaves) and all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
                                and (x.sharding.mesh is mesh or x.sharding.mesh == mesh)
                                for x in leaves)


def _pad_engram_rows(params, mesh: Mesh):
    """``params`` with each Engram table's rows (``engram/embed/{weight,scale}``, axis -2)
    padded with zero rows to a multiple of the device count, so that they split evenly (the
    hashed row ids stay below the real row count: the padding is never read)."""
    n = _axes_size(mesh, ENGRAM_ROW_AXES)

    def pad(path, x):
        if not is_engram_table(_path_str(path)) or \
                x.shape[-2] % n == 0:
            return x
        width = [(0, 0)] * x.ndim
        width[-2] = (0, -x.shape[-2] % n)
        return (jnp.pad if isinstance(x, jax.Array) else np.pad)(x, width)
    return jax.tree_util.tree_map_with_path(pad, params)


def checkpoint_sharding(name: str, shape: tuple, mesh: Mesh, *, engram: str = "replicated"
                        ) -> tuple[tuple, NamedSharding]:
    """Where the sliced loader (:func:`dsv41_jax.checkpoint.stream_params` with a mesh) puts
    one reference checkpoint tensor: ``(global shape, NamedSharding)``. ``name``: the
    tensor's name as stored (``"layers.3.attn.wq_b.weight"``), or a layer's stacked routed
    experts (``"layers.3.ffn.experts.w1.scale"``, ``[E, ...]``). The spec is the one of the
    prepared leaf it becomes: :data:`PARAM_RULES` on its path within the layer (the
    ``layers.N.`` prefix dropped; the two stack axes that :func:`dsv41_jax.model.prepare_params`
    adds are never split), so the FP8 / FP4 weights and their E8M0 scales are each split by
    their own rule. The Engram tables (``engram.embed.weight`` / ``.scale``) with ``engram``
    ``"sharded"`` or ``"host"`` get their rows padded to a multiple of the device count and
    split over every device (``"host"``: in the memory kind :func:`host_memory_kind`, so they
    never pass through the devices' memory). ``mtp.*`` (DSpark) and vision tensors match no
    rule: replicated."""
    path = re.sub(r"^layers\.\d+\.", "", name).replace(".", "/")
    shape = tuple(shape)
    table = "sharded" if engram == "host" else engram
    if table == "sharded" and is_engram_table(path) and len(shape) >= 2:
        n = _axes_size(mesh, ENGRAM_ROW_AXES)
        shape = shape[:-2] + (-(-shape[-2] // n) * n,) + shape[-1:]
    spec = spec_for(param_logical_axes(path, len(shape)), shape, mesh, engram=table)
    kind = (host_memory_kind(mesh.devices.flat[0]) if engram == "host"
            and is_engram_table(path) else None)
    return shape, NamedSharding(mesh, spec, memory_kind=kind)


def check_experts(cfg: ModelConfig, mesh: Mesh | None):
    """``ValueError`` unless the mesh's ``expert`` size divides the routed experts."""
    ep = axis_size(mesh, "expert")
    if cfg.n_routed_experts % ep:
        raise ValueError(f"n_routed_experts={cfg.n_routed_experts} does not divide by the "
                         f"mesh's expert axis ({ep}): each expert shard holds whole experts")


def shard_params(params, cfg: ModelConfig, mesh: Mesh, *, engram: str = "replicated",
                 reshard: bool = False):
    """``params`` prepared by :func:`dsv41_jax.model.prepare_params` placed on ``mesh`` by
    :func:`param_shardings` (``jax.device_put``). A tree already on the mesh
    (:func:`on_mesh`) is returned as it is, so the entry points keep a placement made
    beforehand (e.g. with ``engram="sharded"``), unless ``reshard``: then every leaf is put
    where the table says (on the device when it is already there, no copy): for a tree
    prepared from the sliced loader's (:func:`dsv41_jax.checkpoint.stream_params` with a
    mesh), whose stacked leaves have the shardings the compiler gave ``prepare_params``' ops.

    ``engram`` (:data:`ENGRAM_PLACES`): ``"replicated"`` (default), ``"sharded"``: the
    Engram tables' rows split over every device, each table first padded with zero rows to a
    multiple of the device count (never read: the hashed ids stay below the real rows), or
    ``"host"``: split the same way in the devices' host memory (:func:`host_memory_kind`).

    Raises ``ValueError`` for a tree not prepared (no ``layer_groups``), a mesh not of
    :func:`make_mesh`, routed experts that the ``expert`` axis does not divide, or an
    ``engram`` not in :data:`ENGRAM_PLACES`, or ``engram="host"`` on a backend whose devices
    have no host memory kind (:func:`host_memory_kind`)."""
    check_mesh(mesh)
    check_experts(cfg, mesh)
    logical_axes_table(engram)
    if engram == "host":
        host_memory_kind(mesh.devices.flat[0])
    if "layer_groups" not in params:
        raise ValueError("params must be prepared (dsv41_jax.model.prepare_params(params, cfg)) "
                         "before shard_params: it places the stacked layer groups")
    if not reshard and on_mesh(params, mesh):
        return params
    if engram in ("sharded", "host"):
        params = _pad_engram_rows(params, mesh)
    return jax.device_put(params, param_shardings(params, mesh, engram=engram))


def batch_spec(ndim: int, batch: int, mesh: Mesh, *, strict: bool = True) -> P:
    """``P("data")`` (batch first, the rest replicated) for an array of rank ``ndim``; with
    ``strict=False`` a batch the ``data`` axis does not divide is replicated instead of a
    ``ValueError``."""
    dp = axis_size(mesh, "data")
    if batch % dp:
        if strict:
            raise ValueError(f"batch {batch} does not divide by the mesh's data axis ({dp})")
        return P()
    return P(LOGICAL_AXES["batch"]) if dp > 1 and ndim > 0 else P()


def state_shardings(state, mesh: Mesh, *, strict: bool = True):
    """A pytree like ``state`` (:class:`dsv41_jax.state.InferenceState`) of
    :class:`NamedSharding` s: every leaf split by its batch rows (its first axis) over
    ``data``. Raises ``ValueError`` (``strict``) if ``data`` does not divide the batch."""
    B = state.pos.shape[0]
    return jax.tree.map(lambda a: NamedSharding(mesh, batch_spec(np.ndim(a), B, mesh,
                                                                 strict=strict)), state)


def shard_state(state, mesh: Mesh):
    """``state`` placed on ``mesh`` by :func:`state_shardings` (``jax.device_put``), the host
    positions :func:`dsv41_jax.model.host_positions` knows kept. A state this function or a
    compiled step on ``mesh`` returned (:func:`mark_placed`) is returned as it is: a decode
    step then spends no host time re-placing its hundreds of arrays. Raises ``ValueError``
    for a mesh not of :func:`make_mesh` or a batch the ``data`` axis does not divide."""
    if placed_on(state) is mesh:
        return state
    check_mesh(mesh)
    known = getattr(state, "_host_pos", None)
    out = jax.device_put(state, state_shardings(state, mesh))
    if known is not None:
        object.__setattr__(out, "_host_pos", known)
    return mark_placed(out, mesh)


def mark_placed(state, mesh: Mesh | None):
    """Note on the state object (outside the pytree, like the host positions) that its arrays
    lie on ``mesh`` by :func:`state_shardings`; for states a compiled step on ``mesh``
    returned (the step constrains them there). Returns ``state``."""
    if mesh is not None:
        object.__setattr__(state, "_placed_on", mesh)
    return state


def placed_on(state) -> Mesh | None:
    """The mesh :func:`mark_placed` noted on ``state``, or None (a state made or changed
    elsewhere: ``replace`` returns a new object without the note)."""
    return getattr(state, "_placed_on", None)


def constrain_state(state, mesh: Mesh | None):
    """Inside a compiled step: ``state`` constrained to :func:`state_shardings` (a batch the
    ``data`` axis does not divide replicated), so a step returns the state where it found it
    (donation reuses the buffers). No-op without a mesh."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh, strict=False))


def batch_sharded(x, mesh: Mesh | None):
    """A host or device array with the batch first, placed split by rows over ``data`` (a
    batch ``data`` does not divide: replicated). ``x`` as it is without a mesh."""
    if mesh is None:
        return x
    return jax.device_put(x, NamedSharding(mesh, batch_spec(np.ndim(x), np.shape(x)[0], mesh,
                                                             strict=False)))


def describe(params, mesh: Mesh) -> list[tuple[str, tuple, Any]]:
    """``(path, shape, PartitionSpec)`` of every parameter leaf that is split (for a look at
    where things went)."""
    out = []
    specs = param_specs(params, mesh)
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                                  jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        if isinstance(getattr(leaf, "sharding", None), NamedSharding):
            spec = leaf.sharding.spec   # where it is (e.g. Engram rows placed "sharded")
        if any(a is not None for a in spec):
            out.append((_path_str(path), tuple(np.shape(leaf)), spec))
    return out
