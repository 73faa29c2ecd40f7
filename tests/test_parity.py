"""Parity with the official reference's golden fixtures (../shared/fixtures/reference).

Each fixture directory runs every case through ``dsv41_jax.parity``: teacher-forced blocks
(bit-exact or within the recorded per-layer noise), exact pieces (Engram ids and history, top-k
-1 structure, filled window slots, written cache entries) and end-to-end logits within the
recorded noise. The same code backs ``scripts/parity.py``.
"""

import pytest

from conftest import fixture_dir
from dsv41_jax import parity


@pytest.mark.parametrize("name", ["tiny-a", "tiny-a-bf16", "tiny-engram", "tiny-vl"])
def test_fixture_dir(name):
    checks = parity.run_all(fixture_dir(name))
    assert checks, "no comparison ran"
    bad = [c.row() for c in checks if not c.ok]
    assert not bad, "\n".join(bad)
