"""The main job end to end: scripts/generate.py on the small config with random weights."""

import json
import os
import runpy
import sys


def test_generate_script(tmp_path, capsys):
    """Tokenize, CED prefill, decode 3 tokens; the report and the JSON carry the measurements."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "generate.py")
    out_json = tmp_path / "gen.json"
    argv = sys.argv
    sys.argv = [script, "--prompt", "The quick brown fox jumps over the lazy dog. " * 3,
                "--max-new-tokens", "3", "--json", str(out_json)]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
    text = capsys.readouterr().out
    assert "SEEDED RANDOM WEIGHTS" in text
    assert "time to first token" in text and "tokens/s" in text
    assert "global KV source layer 2 (ratio 2)" in text
    rec = json.loads(out_json.read_text())
    assert rec["prompt_tokens"] == 32 and len(rec["generated"]) == 3
    assert all(0 <= t < 129280 for t in rec["generated"])


def test_generate_refuses_random_weights_at_the_release_size():
    """Seeded random weights of configs/flash.json would take hundreds of GB of host memory:
    refused with a message naming the size and the way out, before anything is built."""
    import pytest
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "generate.py")
    flash = os.path.join(os.path.dirname(__file__), "..", "configs", "flash.json")
    argv = sys.argv
    sys.argv = [script, "--config", flash]
    try:
        with pytest.raises(SystemExit, match=r"--checkpoint DIR.*small.json"):
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
