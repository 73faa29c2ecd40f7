"""Bitwise tree assertions for the tests, on top of chex.

``chex.assert_trees_all_equal`` compares values with ``np.testing.assert_array_equal``, which
takes ``-0.0 == 0.0`` and any NaN equal to any NaN. The model's state and logits are compared bit
for bit instead: :func:`assert_trees_bitwise_equal` checks the trees' structure, shapes and
dtypes with chex and then their bit patterns (every leaf viewed as unsigned integers of its
width) with ``chex.assert_trees_all_equal``; when that fails, the message lists every differing
leaf (chex stops at the first), with the number of differing elements and the largest value
difference.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import chex
import jax
import numpy as np

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(tree):
    """``tree`` with every leaf as a numpy array of unsigned integers of the leaf's item size
    (its bit pattern)."""
    def view(a):
        a = np.ascontiguousarray(np.asarray(a))
        return a.view(_UINT[a.dtype.itemsize])
    return jax.tree.map(view, tree)


def max_abs_diff(a, b) -> float:
    """Largest ``|a - b|`` in float64 over two arrays (equal infinities count 0, NaN ignored)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    with np.errstate(invalid="ignore"), warnings.catch_warnings(action="ignore",
                                                                category=RuntimeWarning):
        d = np.where(np.isinf(a) & (a == b), 0.0, np.abs(a - b))
        return float(np.nanmax(d)) if d.size else 0.0   # all NaN: nan


def path_str(path) -> str:
    """A leaf's path as ``sources/2/tail/kv`` (an :class:`~dsv41_jax.state.InferenceState`'s
    attributes and dict keys joined by ``/``; a flat dict's key as it is)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _keep(tree, skip: Callable[[str], bool] | None):
    """``tree`` with the leaves whose :func:`path_str` ``skip`` accepts replaced by None."""
    if skip is None:
        return tree
    return jax.tree_util.tree_map_with_path(lambda p, v: None if skip(path_str(p)) else v, tree)


def bitwise_diffs(a, b, skip: Callable[[str], bool] | None = None) -> list[str]:
    """One line per leaf of two trees (the same structure, checked by chex) whose bits, shapes
    or dtypes differ: path, number of differing elements, max |diff|. ``skip(path)``
    (:func:`path_str`) leaves out a leaf."""
    a, b = _keep(a, skip), _keep(b, skip)
    chex.assert_trees_all_equal_structs(a, b)
    out = []
    fa = jax.tree_util.tree_flatten_with_path(a)[0]
    fb = jax.tree_util.tree_leaves(b)
    for (path, x), y in zip(fa, fb):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{path_str(path)}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}")
            continue
        neq = bits(x) != bits(y)
        if neq.any():
            out.append(f"{path_str(path)}: {int(neq.sum())}/{neq.size} elements "
                       f"differ, max |diff| {max_abs_diff(x, y):.3g}")
    return out


def assert_trees_bitwise_equal(a, b, what: str = "trees",
                               skip: Callable[[str], bool] | None = None) -> None:
    """Assert two pytrees (or arrays) equal bit for bit: the same structure (chex), every leaf
    the same shape and dtype (chex) and the same bits (``chex.assert_trees_all_equal`` on
    :func:`bits`, strict). ``skip(path)`` leaves out leaves by their :func:`path_str`. The
    ``AssertionError`` names ``what`` and lists every differing leaf."""
    a, b = _keep(a, skip), _keep(b, skip)
    chex.assert_trees_all_equal_structs(a, b)
    try:
        chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
        chex.assert_trees_all_equal(bits(a), bits(b), strict=True)
    except AssertionError as e:
        raise AssertionError(f"{what} differ:\n" + "\n".join(bitwise_diffs(a, b))) from e
