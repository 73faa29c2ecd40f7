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


def test_chosen_layers_without_end_to_end():
    """``scripts/parity.py --layers 8 --no-end-to-end``: only the reindex layer's teacher-forced
    block of the full-detail case (what fits a GPU run's time limit)."""
    checks = parity.run_all(fixture_dir("tiny-a"), cases=["prefill061"], layers=[8], e2e=False)
    assert {c.name for c in checks} == {f"tf.{k}.L8" for k in (
        "attn_out", "ffn_out", "block_out", "index_topk", "moe_topk_idx")}
    assert all(c.ok for c in checks)
    with pytest.raises(ValueError, match="layers"):
        parity.run_all(fixture_dir("tiny-a"), cases=["prefill061"], layers=[12], e2e=False)
