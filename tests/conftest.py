"""Shared test fixtures: the reference fixtures and loaded parameters, built once.

Every function of ``dsv41_jax`` and ``pallas_kernels`` is checked against its jaxtyping
annotations (shapes and dtypes, beartype) during the tests: the import hook is installed here,
before anything imports the two packages.
"""

import contextlib
import sys

import jaxtyping
from jaxtyping import install_import_hook

if "dsv41_jax" in sys.modules or "pallas_kernels" in sys.modules:
    raise RuntimeError("dsv41_jax / pallas_kernels were imported before tests/conftest.py: "
                       "their jaxtyping annotations would go unchecked")
# is_pep484_tower: an int is accepted where a float is annotated (PEP 484's numeric tower)
install_import_hook(["dsv41_jax", "pallas_kernels"],
                    "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")

import dsv41_jax  # noqa: E402,F401  (sets the XLA numerics flag before JAX starts)
import pytest  # noqa: E402

from dsv41_jax.testing.fixtures import fixture_dir  # noqa: E402


@contextlib.contextmanager
def annotations_unchecked():
    """The jaxtyping checks off inside the block.

    For tests of a function's own input validation (the ``ValueError`` a caller gets without
    the checks) with inputs that its annotations reject: with the checks on, the annotation
    raises ``jaxtyping.TypeCheckError`` before the function's own check runs. A whole test can
    use ``@pytest.mark.annotations_unchecked`` instead.
    """
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


@pytest.fixture(autouse=True)
def _annotations_unchecked_marker(request):
    if request.node.get_closest_marker("annotations_unchecked") is None:
        yield
        return
    with annotations_unchecked():
        yield


@pytest.fixture(scope="session")
def tiny_a():
    """(cfg, params, manifest) of the tiny-a fixture (fp8 weights, fp4 experts)."""
    from dsv41_jax.testing import parity
    return parity.load_fixture_dir(fixture_dir("tiny-a"))


@pytest.fixture(scope="session")
def tiny_a_bf16():
    from dsv41_jax.testing import parity
    return parity.load_fixture_dir(fixture_dir("tiny-a-bf16"))


# -- compiled programs released between modules ------------------------------------------
# XLA's CPU backend maps every kernel of every compiled program into memory (about two mappings
# per fusion), and Linux caps a process at vm.max_map_count mappings (65,530 by default). A
# worker that runs many modules' programs without releasing them reaches the cap; past it,
# XLA's compiler crashes (SIGSEGV / SIGABRT) or a thread it needs cannot start and the worker
# hangs. So each module's compiled programs are dropped when the module ends.
MAP_COUNT_WARN = 40_000


def _mapping_count() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:         # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    import gc

    import jax
    gc.collect()
    jax.clear_caches()
    gc.collect()
    n = _mapping_count()
    if n > MAP_COUNT_WARN:
        import warnings
        warnings.warn(f"{n} memory mappings after a module's compiled programs were released "
                      f"(vm.max_map_count is usually 65,530): something still holds compiled "
                      f"programs", RuntimeWarning, stacklevel=1)


# -- two workers (scripts/test.sh: pytest-xdist, --dist loadgroup --no-loadscope-reorder) -----
# A test module's tests share compiled functions and module fixtures, so each module runs on
# one worker (its own group), except the fixture-parity directories (1.5-2 min each), which are
# a group each. Groups go to the workers in collection order (--no-loadscope-reorder: by
# default pytest-xdist sends the groups with the most tests first, which left the one-test
# parity directories for the end), and the longest groups are collected first, longest to
# shortest (about, on 2 CPU cores), so the two workers finish close together.
SLOW_FIRST = ("test_sharding.py::", "test_draft_training.py::", "test_layer_groups.py::",
              "test_notebooks.py::", "test_invariants.py::", "test_sparse_attention.py::",
              "test_generate.py::", "test_demo_checkpoint.py::", "test_cases.py::",
              "test_parity.py::test_fixture_dir", "test_grouped_matmul.py::", "test_dspark.py::",
              "test_bench_e2e.py::", "test_training.py::", "test_multihost.py::")
PARITY_DIR = "test_parity.py::test_fixture_dir"


def pytest_configure(config):
    # registered here too, so that a run without the plugin (-p no:xdist) does not warn
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one worker")
    config.addinivalue_line("markers", "annotations_unchecked: a test of input validation that "
                            "runs without the jaxtyping checks (see annotations_unchecked)")


def _slow_rank(item) -> int:
    name = item.nodeid.split("/")[-1]
    return next((i for i, p in enumerate(SLOW_FIRST) if name.startswith(p)), len(SLOW_FIRST))


@pytest.hookimpl(tryfirst=True)    # before pytest-xdist's, which reads the groups' markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        parity_dir = item.nodeid.split("/")[-1].startswith(PARITY_DIR)
        item.add_marker(pytest.mark.xdist_group(
            item.nodeid if parity_dir else item.nodeid.split("::")[0]))
    items.sort(key=_slow_rank)   # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)         # a pytest-xdist hook: the controller's side
def pytest_xdist_node_collection_finished(node, ids):
    """Under ``--dist loadgroup`` every test must carry its group to pytest-xdist (the node ids
    a worker collects end in ``@group``). Where a pytest / pytest-xdist pair drops the marks
    (pytest 9.2 with pytest-xdist 3.8), each test becomes its own unit: module fixtures are
    rebuilt and programs compiled again test by test, and the suite runs at about half its
    speed, silently. So that stops the run instead."""
    if node.config.getoption("dist", None) != "loadgroup":
        return
    lost = [i for i in ids if "@" not in i]
    if lost:
        pytest.exit(f"--dist loadgroup: {len(lost)} of {len(ids)} tests lost their xdist_group "
                    f"(first: {lost[0]}); this pytest / pytest-xdist pair does not pass the "
                    f"groups on (constraints.txt)", returncode=3)
