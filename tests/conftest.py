"""Shared test fixtures: the golden reference fixtures and loaded parameters, built once."""

import os

import dsv41_jax  # noqa: F401  (sets the XLA numerics flag before JAX starts)
import pytest

FIXTURES = os.environ.get(
    "DSV41_FIXTURES",
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures", "reference"))


def fixture_dir(name: str) -> str:
    path = os.path.join(FIXTURES, name)
    if not os.path.isdir(path):
        pytest.fail(f"fixture directory {path} is missing (set DSV41_FIXTURES)")
    return path


@pytest.fixture(scope="session")
def tiny_a():
    """(cfg, params, manifest) of the tiny-a fixture (fp8 weights, fp4 experts)."""
    from dsv41_jax.testing import parity
    return parity.load_fixture_dir(fixture_dir("tiny-a"))


@pytest.fixture(scope="session")
def tiny_a_bf16():
    from dsv41_jax.testing import parity
    return parity.load_fixture_dir(fixture_dir("tiny-a-bf16"))


# -- two workers (scripts/test.sh: pytest-xdist, --dist loadgroup) ---------------------------
# A test module's tests share compiled functions and session fixtures, so each module runs on
# one worker (its own group), except the fixture-parity directories (3-4.5 min each, half the
# suite), which are a group each. The longest groups are collected first, so the two workers
# finish close together instead of one starting a fixture directory near the end.
SLOW_FIRST = ("test_parity.py::test_fixture_dir", "test_sparse_attention.py::test_model_with")


def pytest_configure(config):
    # registered here too, so that a run without the plugin (-p no:xdist) does not warn
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one worker")


def _slow_rank(item) -> int:
    name = item.nodeid.split("/")[-1]
    return next((i for i, p in enumerate(SLOW_FIRST) if name.startswith(p)), len(SLOW_FIRST))


def pytest_collection_modifyitems(config, items):
    for item in items:
        parity_dir = _slow_rank(item) == 0
        item.add_marker(pytest.mark.xdist_group(
            item.nodeid if parity_dir else item.nodeid.split("::")[0]))
    items.sort(key=_slow_rank)   # stable: the rest keep their order
