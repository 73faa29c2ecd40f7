"""JAX's persistent compilation cache, set up for this model's programs.

The first call of each entry point compiles for seconds to minutes; with the cache on, a later
process with the same shapes, config and JAX version loads the compiled program from disk.
:func:`enable` caches every program (no minimum compile time or size) and, on NVIDIA GPUs,
XLA's per-fusion autotuning results (``<dir>/xla_gpu_per_fusion_autotune_cache_dir``, JAX's
``jax_persistent_cache_enable_xla_caches``), so a cached run also skips the autotuning.

The cache directory is trusted: whoever can write to it can make this process run arbitrary
code (JAX's warning), so do not share it with users you do not trust.

    from dsv41_jax import compile_cache
    compile_cache.enable(compile_cache.resolve(None))   # the default directory, or $DSV41_JAX_CACHE_DIR
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

#: Environment variable overriding the default directory (``none``: no cache).
ENV_VAR = "DSV41_JAX_CACHE_DIR"
#: Default cache directory (``~`` expanded by :func:`resolve`).
DEFAULT_DIR = os.path.join("~", ".cache", "dsv41-jax", "jax-cache")
#: The word that turns the cache off, in ``--compile-cache`` and :data:`ENV_VAR`.
OFF = "none"


def resolve(value: str | None) -> str | None:
    """The cache directory for a ``--compile-cache`` value: ``value`` itself (``~`` expanded,
    made absolute); when ``value`` is ``None``, ``$DSV41_JAX_CACHE_DIR`` if set and not empty,
    else :data:`DEFAULT_DIR`. ``"none"`` (any case) from either gives ``None``: no cache.
    Raises ``ValueError`` for an empty ``value``."""
    if value is None:
        value = os.environ.get(ENV_VAR) or DEFAULT_DIR
    elif not value.strip():
        raise ValueError("compile cache directory: empty (pass a directory or 'none')")
    if value.strip().lower() == OFF:
        return None
    return os.path.abspath(os.path.expanduser(value))


def enable(directory: str) -> str:
    """Turn JAX's persistent compilation cache on at ``directory`` (created if missing) for
    every later compilation of this process; returns the absolute path.

    Sets ``jax_compilation_cache_dir``, ``jax_enable_compilation_cache`` (True),
    ``jax_persistent_cache_min_compile_time_secs`` (0: cache every program),
    ``jax_persistent_cache_min_entry_size_bytes`` (-1: no size minimum) and
    ``jax_persistent_cache_enable_xla_caches`` (``xla_gpu_per_fusion_autotune_cache_dir``:
    XLA's GPU autotuning results beside the programs), then resets JAX's cache object so the
    setting applies even after earlier compilations.

    Raises ``ValueError`` when ``directory`` is empty or names something that is not a
    directory; ``OSError`` when it cannot be created.
    """
    if not directory or not directory.strip():
        raise ValueError("directory: empty (pass the cache directory)")
    path = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"directory: {path} exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_enable_xla_caches",
                      "xla_gpu_per_fusion_autotune_cache_dir")
    _jax_cache.reset_cache()
    return path


def disable() -> None:
    """Turn the persistent compilation cache off for later compilations of this process
    (``jax_compilation_cache_dir`` unset, JAX's cache object reset)."""
    jax.config.update("jax_compilation_cache_dir", None)
    _jax_cache.reset_cache()
