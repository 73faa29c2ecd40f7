"""Compiled steps whose traced program is saved to disk, so that a later process skips tracing
and lowering (docs/architecture.md, "Compile once").

With JAX's persistent compilation cache on (:func:`dsv41_jax.compile_cache.enable`), a second
process loads each compiled program from disk, but only after tracing the model and lowering it
to StableHLO again: the cache's key is the lowered program. For this model that tracing and
lowering is most of a warm first call (on an H200, 3.9 s of the `mid` decode step's 5.6 s). A
:class:`SavedJit` is a ``jax.jit`` that, while the persistent cache is on, also saves the traced
program as a ``jax.export`` artifact under ``<cache dir>/dsv41-steps/``; a later process with
the same inputs' shapes, static arguments, package sources, JAX version and device kind loads
it and calls it (``jax.jit(exported.call)``, whose compiled program the persistent cache then
holds), without tracing the model.

The artifact's key covers everything the traced program depends on: the function's name, the
static arguments' ``repr``, the tree structure, shape and dtype of every array argument, the
digest of this package's sources (:func:`source_digest`), the JAX and jaxlib versions, the
backend and the device kind, the JAX options that change a trace (x64, the default matmul
precision), and the module-level settings of the two packages that differ from their sources'
values (:func:`changed_settings`: a switch such as ``model.UNROLL_DECODE_UNITS`` set by a
caller, which the trace reads); XLA's flags change only the compile, which the persistent cache
keys by them. Calls that cannot be saved take the plain ``jax.jit`` path: a
mesh among the static arguments (its devices are not part of the key), a static argument
whose ``repr`` holds an object address, or a program ``jax.export`` refuses. A file that
cannot be read is written again.

The saved files are loaded with ``pickle`` (the output's tree structure) and run as compiled
code: the cache directory is trusted, as JAX's own (see :mod:`dsv41_jax.compile_cache`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import pathlib
import pickle
import re
import sys
import tempfile
from collections.abc import Callable

import jax
import jaxlib

#: Sub-directory of the compilation cache directory holding the saved steps.
SUBDIR = "dsv41-steps"
#: Version of the saved files' layout (part of the key).
FORMAT = 1
#: Custom calls the saved programs may hold beyond ``jax.export``'s stable list: the Pallas
#: Triton kernels (their Triton IR is compiled when the program is).
ALLOWED_CUSTOM_CALLS = ("__gpu$xla.gpu.triton",)


def directory() -> str | None:
    """``<jax_compilation_cache_dir>/dsv41-steps`` while JAX's persistent compilation cache is
    on (:func:`dsv41_jax.compile_cache.enable`), else None (nothing is saved or loaded)."""
    base = jax.config.jax_compilation_cache_dir
    if not base or not jax.config.jax_enable_compilation_cache:
        return None
    return os.path.join(base, SUBDIR)


@functools.cache
def source_digest() -> str:
    """SHA-256 of the Python sources of ``dsv41_jax`` and ``pallas_kernels`` (every ``.py``
    file, by relative path and content): a saved step is reused only by the same code."""
    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parent.parent
    for pkg in ("dsv41_jax", "pallas_kernels"):
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


#: The packages whose module-level settings a trace reads.
PACKAGES = ("dsv41_jax", "pallas_kernels")
# a module-level assignment to an UPPER_CASE name on one line (annotated or not)
_SETTING_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)[ \t]*(?::[^=\n]*)?=[^=\n].*$", re.M)
_SCALARS = (bool, int, float, str, type(None))


@functools.cache
def _source_settings(path: str) -> tuple[tuple[str, object], ...]:
    """``(NAME, default)`` of a module's settings: its one-line top-level assignments of an
    ``UPPER_CASE`` name to a scalar literal (bool, int, float, str, None), or to another
    module's setting (a dotted name, kept as ``ast.Attribute`` / ``ast.Name`` to resolve)."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError:
        return ()
    out = []
    for m in _SETTING_LINE.finditer(text):
        try:
            node = ast.parse(m.group(0)).body[0].value
        except (SyntaxError, IndexError, AttributeError):
            continue          # the first line of a longer statement
        if isinstance(node, (ast.Name, ast.Attribute)):
            out.append((m.group(1), node))
            continue
        try:
            value = ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(value, _SCALARS):
            out.append((m.group(1), value))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _tracked(n_modules: int) -> tuple:
    """``(module name, namespace, NAME, default)`` of every scalar setting of the loaded
    modules of :data:`PACKAGES` (recomputed when the number of loaded modules changes)."""
    out = []
    for name in sorted(n for n in list(sys.modules) if n.split(".", 1)[0] in PACKAGES):
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None)
        for attr, default in _source_settings(path) if path else ():
            if isinstance(default, ast.AST) and not isinstance(_resolve(mod, default), _SCALARS):
                continue        # an alias of something else (a dtype, a tuple)
            out.append((name, vars(mod), attr, default))
    return tuple(out)


def _resolve(mod, node):
    """The current value of a dotted name in ``mod``'s namespace (None where it is gone)."""
    if isinstance(node, ast.Name):
        return vars(mod).get(node.id)
    return getattr(_resolve(mod, node.value), node.attr, None)


def changed_settings() -> tuple[tuple[str, str], ...]:
    """The module-level settings of :data:`PACKAGES` whose current value differs from the one
    their source assigns: ``(("module.NAME", repr(value)), ...)``, sorted; ``()`` when every
    setting is as the sources say.

    A setting is an ``UPPER_CASE`` name a module's source binds, on one top-level line, to a
    scalar literal or to another module's setting (``AUTO_MAX_ROWS = triton.MAX_TILE_ROWS``):
    the switches that callers and ``tools/decode_ab.py`` set (``model.UNROLL_DECODE_UNITS``,
    ``gemv.triton.UNSPLIT_ROW_BLOCKS``, ...). A trace reads them, so they are part of a saved
    program's key, and of the key a :class:`SavedJit` keeps its loaded programs under in a
    process. Only the modules already imported are looked at (one not imported holds its
    source's values, which :func:`source_digest` covers). About 20 us on a CPU core."""
    out = []
    for name, namespace, attr, default in _tracked(len(sys.modules)):
        value = namespace.get(attr)
        if value is default:
            continue
        if isinstance(default, ast.AST):
            default = _resolve(sys.modules[name], default)
        same = value == default or (value != value and default != default)      # NaN == NaN
        if type(value) is not type(default) or not same:
            out.append((f"{name}.{attr}", repr(value)))
    return tuple(sorted(out))


def _has_mesh(value) -> bool:
    return type(value).__name__ in ("Mesh", "AbstractMesh") or \
        getattr(value, "mesh", None) is not None


class SavedJit:
    """``jax.jit(fun, static_argnames=..., donate_argnames=...)`` whose traced program is saved
    and loaded as described in the module docstring. Call it as the jitted function with the
    array arguments positional and the static ones by keyword; the results (outputs, donation)
    are those of ``jax.jit(fun)``, bit for bit: the same program, compiled by the same XLA.

    Each instance keeps the programs it loaded or saved in this process (keyed by the
    arguments' structure, shapes and static values, and the settings of
    :func:`changed_settings`), as ``jax.jit`` keeps its compiled ones.
    """

    def __init__(self, fun: Callable, *, static_argnames: tuple[str, ...] = (),
                 donate_argnames: tuple[str, ...] = ()):
        self._fun = fun
        self._name = f"{fun.__module__}.{fun.__qualname__}"
        self._static = tuple(static_argnames)
        params = list(inspect.signature(fun).parameters)
        self._donate = tuple(params.index(n) for n in donate_argnames)
        self.jitted = jax.jit(fun, static_argnames=static_argnames,
                              donate_argnames=donate_argnames)
        self._programs: dict = {}

    def __call__(self, *args, **static):
        where = directory()
        if where is None or set(static) - set(self._static) or \
                any(_has_mesh(v) for v in static.values()):
            return self.jitted(*args, **static)
        flat = [jax.tree.flatten(a) for a in args]
        try:     # about 75 us for 300 arrays on a CPU core: the price of a saved program
            sig = (tuple(t for _, t in flat), tuple(sorted(static.items())),
                   tuple([(x.shape, x.dtype) for leaves, _ in flat for x in leaves]),
                   changed_settings())
        except AttributeError:          # a leaf that is not an array
            return self.jitted(*args, **static)
        program = self._programs.get(sig)
        if program is None:
            program = self._programs[sig] = self._load_or_save(where, flat, sig, static)
        if program is False:
            return self.jitted(*args, **static)
        call, out_tree = program
        return jax.tree.unflatten(out_tree, call(*[leaves for leaves, _ in flat]))

    def _key(self, sig, static) -> str | None:
        text = repr(sorted(static.items()))
        if " at 0x" in text:            # an object address: not the same in another process
            return None
        dev = jax.devices()[0]
        h = hashlib.sha256()
        for part in (FORMAT, self._name, text, repr(sig[0]), repr(sig[2]), repr(sig[3]),
                     source_digest(),
                     jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind,
                     jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision):
            h.update(repr(part).encode())
            h.update(b"\0")
        return h.hexdigest()

    def _load_or_save(self, where: str, flat, sig, static):
        """``(jitted exported call, output tree)`` from the saved file or a new export, or
        ``False`` where the call cannot be saved."""
        key = self._key(sig, static)
        if key is None:
            return False
        path = os.path.join(where, f"{self._fun.__name__}-{key[:32]}.jaxexport")
        try:
            with open(path, "rb") as f:
                saved = pickle.load(f)
            exported = jax.export.deserialize(bytearray(saved["exported"]))
            out_tree = saved["out_tree"]
        except Exception:  # noqa: BLE001  (missing, truncated or stale: export anew)
            try:
                exported, out_tree = self._export(flat, static)
                blob = pickle.dumps({"format": FORMAT, "out_tree": out_tree,
                                     "exported": bytes(exported.serialize())})
                os.makedirs(where, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=where, suffix=".tmp")
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
            except Exception:  # noqa: BLE001  (what jax.export refuses, or no flatbuffers to
                return False   # serialize with, or a directory not writable: plain jit)
        # every argument on one device, placed or not: one compiled program for both (without
        # the sharding, arrays a step returned and fresh ones would compile it twice)
        device = next((next(iter(x.devices())) for leaves, _ in flat for x in leaves
                       if isinstance(x, jax.Array) and x.committed), jax.devices()[0])
        return jax.jit(exported.call, donate_argnums=self._donate,
                       in_shardings=jax.sharding.SingleDeviceSharding(device)), out_tree

    def _export(self, flat, static):
        trees = [t for _, t in flat]
        out_tree = []

        def flat_fun(*leaf_lists):
            out = self._fun(*[jax.tree.unflatten(t, leaves)
                              for t, leaves in zip(trees, leaf_lists)], **static)
            leaves, tree = jax.tree.flatten(out)
            out_tree.append(tree)
            return leaves

        skip = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ALLOWED_CUSTOM_CALLS]
        exported = jax.export.export(jax.jit(flat_fun, donate_argnums=self._donate),
                                     disabled_checks=skip)(*[leaves for leaves, _ in flat])
        return exported, out_tree[0]

    def lower(self, *args, **static):
        """``jax.jit(fun).lower``: the plain path's lowering (for ahead-of-time compiles)."""
        return self.jitted.lower(*args, **static)
