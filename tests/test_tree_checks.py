"""tests/tree_checks.py: bitwise tree equality on top of chex."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import state as st
from tree_checks import assert_trees_bitwise_equal, bitwise_diffs, max_abs_diff


def test_bitwise_equal_is_stricter_than_value_equal():
    a = {"x": np.array([0.0, 1.0], np.float32), "n": np.array([np.nan], np.float32)}
    assert_trees_bitwise_equal(a, {k: v.copy() for k, v in a.items()})
    neg_zero = dict(a, x=np.array([-0.0, 1.0], np.float32))
    with pytest.raises(AssertionError, match=r"state differ:\nx: 1/2 elements differ"):
        assert_trees_bitwise_equal(a, neg_zero, "state")
    other_nan = (np.array([np.nan], np.float32).view(np.uint32) + np.uint32(1)).view(np.float32)
    assert np.isnan(other_nan).all()
    with pytest.raises(AssertionError, match=r"n: 1/1 elements differ"):
        assert_trees_bitwise_equal(a, dict(a, n=other_nan))


def _source(fill):
    """A one-source state (the inference state's typed layout) whose main KV and compressor
    tail kv hold ``fill``."""
    z = jnp.zeros((2, 3), jnp.uint8)
    return st.InferenceState(
        pos=jnp.array([3]), windows=st.WindowRing(kv=z, scale=z),
        sources={2: st.KVSource(main=jnp.full((2, 3), fill, jnp.bfloat16), main_scale=z,
                                index=z, index_scale=z,
                                tail=st.CompressorTail(kv=jnp.full((2,), fill, jnp.float32),
                                                       score=jnp.zeros((2,), jnp.float32)))})


def test_every_differing_leaf_listed_and_skip():
    a, b = _source(0), _source(1)
    assert bitwise_diffs(a, b) == ["sources/2/main: 6/6 elements differ, max |diff| 1",
                                   "sources/2/tail/kv: 2/2 elements differ, max |diff| 1"]
    with pytest.raises(AssertionError, match=r"(?s)sources/2/main.*sources/2/tail/kv"):
        assert_trees_bitwise_equal(a, b)
    b_main = b.replace(sources={2: b.sources[2].replace(main=a.sources[2].main)})
    assert_trees_bitwise_equal(a, b_main, skip=lambda p: "/tail/" in p)
    with pytest.raises(AssertionError, match=r"sources/2/tail/kv"):
        assert_trees_bitwise_equal(a, b_main)
    # plain dicts: the key as it is
    da = {"kv": {"L2": {"main": jnp.zeros((2, 3), jnp.bfloat16)}}, "pos": jnp.array([3])}
    db = {"kv": {"L2": {"main": jnp.ones((2, 3), jnp.bfloat16)}}, "pos": jnp.array([3])}
    assert bitwise_diffs(da, db) == ["kv/L2/main: 6/6 elements differ, max |diff| 1"]


def test_shape_dtype_and_structure_checked():
    x = np.zeros((2,), np.float32)
    with pytest.raises(AssertionError, match="float32 vs"):
        assert_trees_bitwise_equal(x, x.view(np.int32))     # same bits, other dtype
    with pytest.raises(AssertionError):
        assert_trees_bitwise_equal(x, np.zeros((1, 2), np.float32))
    with pytest.raises(AssertionError):
        assert_trees_bitwise_equal({"a": x}, {"b": x})


def test_max_abs_diff():
    a = np.array([1.0, np.inf, np.nan, 2.0])
    assert max_abs_diff(a, np.array([1.5, np.inf, 0.0, 2.0])) == 0.5
