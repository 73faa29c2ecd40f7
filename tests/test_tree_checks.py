"""tests/tree_checks.py: bitwise tree equality on top of chex."""

import jax.numpy as jnp
import numpy as np
import pytest

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


def test_every_differing_leaf_listed_and_skip():
    a = {"kv": {"L2": {"main": jnp.zeros((2, 3), jnp.bfloat16),
                       "tail_kv": jnp.zeros((2,), jnp.float32)}}, "pos": jnp.array([3])}
    b = {"kv": {"L2": {"main": jnp.ones((2, 3), jnp.bfloat16),
                       "tail_kv": jnp.ones((2,), jnp.float32)}}, "pos": jnp.array([3])}
    assert bitwise_diffs(a, b) == ["kv/L2/main: 6/6 elements differ, max |diff| 1",
                                   "kv/L2/tail_kv: 2/2 elements differ, max |diff| 1"]
    with pytest.raises(AssertionError, match=r"(?s)kv/L2/main.*kv/L2/tail_kv"):
        assert_trees_bitwise_equal(a, b)
    b_main = {"kv": {"L2": dict(b["kv"]["L2"], main=a["kv"]["L2"]["main"])}, "pos": b["pos"]}
    assert_trees_bitwise_equal(a, b_main, skip=lambda p: "tail_" in p)


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
