"""Parity with the official reference's golden fixtures (../shared/fixtures/reference).

Each fixture directory runs every case through ``dsv41_jax.parity``: teacher-forced blocks
(bit-exact or within the recorded per-layer noise), exact pieces (Engram ids and history, top-k
-1 structure, filled window slots, written cache entries) and end-to-end logits within the
recorded noise. The same code backs ``scripts/parity.py``.
"""

import importlib.util
import json
import os

import pytest

from conftest import fixture_dir
from dsv41_jax import parity


@pytest.mark.parametrize("name", ["tiny-a", "tiny-a-bf16", "tiny-engram", "tiny-vl"])
def test_fixture_dir(name):
    checks = parity.run_all(fixture_dir(name))
    assert checks, "no comparison ran"
    bad = [c.row() for c in checks if not c.ok]
    assert not bad, "\n".join(bad)


def test_chosen_layers_without_end_to_end(tmp_path, capsys):
    """``scripts/parity.py --layers 8 --no-end-to-end``: only the reindex layer's teacher-forced
    block of the full-detail case (what fits a GPU run's time limit); each case's result is
    printed and written to the JSON as soon as it ran."""
    spec = importlib.util.spec_from_file_location(
        "parity_script", os.path.join(os.path.dirname(__file__), "..", "scripts", "parity.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "p.json"
    rc = script.main([fixture_dir("tiny-a"), "--case", "prefill061", "--layers", "8",
                      "--no-end-to-end", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert {r["name"] for r in rows} == {f"tf.{k}.L8" for k in (
        "attn_out", "ffn_out", "block_out", "index_topk", "moe_topk_idx")}
    assert all(r["ok"] for r in rows)
    assert "ran prefill061" in capsys.readouterr().err
    with pytest.raises(ValueError, match="layers"):
        parity.run_all(fixture_dir("tiny-a"), cases=["prefill061"], layers=[12], e2e=False)
