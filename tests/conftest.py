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
    from dsv41_jax import parity
    return parity.load_fixture_dir(fixture_dir("tiny-a"))


@pytest.fixture(scope="session")
def tiny_a_bf16():
    from dsv41_jax import parity
    return parity.load_fixture_dir(fixture_dir("tiny-a-bf16"))
