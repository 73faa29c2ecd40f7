"""The generate command (:mod:`dsv41_jax.cli.generate`): the main job end to end on the small
config with random weights, and its refusals of bad options (exit status 2, one line, before
anything is built)."""

import json
import os
import subprocess
import sys

import pytest

from dsv41_jax.cli import generate

ROOT = os.path.join(os.path.dirname(__file__), "..")
FLASH = os.path.join(ROOT, "configs", "flash.json")
SMALL = os.path.join(ROOT, "configs", "small.json")


def test_generate_end_to_end(tmp_path, capsys):
    """Tokenize, CED prefill, decode 3 tokens; the report and the JSON carry the measurements."""
    out_json = tmp_path / "gen.json"
    assert generate.main(["--prompt", "The quick brown fox jumps over the lazy dog. " * 3,
                          "--max-new-tokens", "3", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "SEEDED RANDOM WEIGHTS" in text
    assert "time to first token" in text and "tokens/s" in text and "nan" not in text
    assert "global KV source layer 2 (ratio 2)" in text
    rec = json.loads(out_json.read_text())
    assert rec["prompt_tokens"] == 32 and len(rec["generated"]) == 3
    assert all(0 <= t < 129280 for t in rec["generated"])
    assert rec["decode_tokens_per_s"] > 0


def _refused(argv, capsys) -> str:
    """Run the command on ``argv``; assert it exits with status 2 and return its stderr's last
    line (argparse prints the usage above it)."""
    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("dsv41-generate: error: ")
    return err[-1]


@pytest.mark.parametrize("argv, match", [
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["--max-new-tokens", "-5"], "argument --max-new-tokens: must be >= 1, got -5"),
    (["--chunk", "0"], "argument --chunk: must be >= 1, got 0"),
    (["--chunk", "x"], "argument --chunk: 'x' is not an integer"),
    (["--prompt", ""], "argument --prompt: the prompt is empty"),
    (["--prompt", "  \n"], "argument --prompt: the prompt is empty"),
    (["--prompt", "a", "--prompt-file", "p.txt"],
     "argument --prompt-file: not allowed with argument --prompt"),
    (["--temperature", "-0.5"], "argument --temperature: must be a finite number >= 0"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
    (["--config", "no/such.json"], "argument --config: no such file: no/such.json"),
    (["--checkpoint", "no/such/dir"], "argument --checkpoint: no such directory: no/such/dir"),
    (["--prompt-file", "no/such.txt"], "argument --prompt-file: no such file: no/such.txt"),
    (["--json", "no/such/dir/out.json"], "argument --json: no such directory:"),
    (["--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
    (["--config", FLASH], "--checkpoint DIR or a smaller config (configs/small.json)"),
])
def test_refused_options(argv, match, capsys):
    assert match in _refused(argv, capsys)


def test_refuses_an_empty_prompt_file(tmp_path, capsys):
    p = tmp_path / "p.txt"
    p.write_text("\n")
    assert f"argument --prompt-file: {p} is empty" in _refused(["--prompt-file", str(p)], capsys)


def test_refuses_a_config_with_a_misspelt_key(tmp_path, capsys):
    d = json.loads(open(SMALL).read())
    d["windw_size"] = d.pop("window_size")
    p = tmp_path / "c.json"
    p.write_text(json.dumps(d))
    line = _refused(["--config", str(p)], capsys)
    assert "unknown config key 'windw_size'" in line and "'window_size'" in line


def test_config_and_checkpoint_must_agree(tmp_path, capsys):
    """--config beside --checkpoint: refused when it differs from the checkpoint's config.json
    (naming the differing keys); a checkpoint without config.json needs --config."""
    ck = tmp_path / "ckpt"
    ck.mkdir()
    line = _refused(["--checkpoint", str(ck)], capsys)
    assert "has no config.json (pass --config)" in line
    d = json.loads(open(SMALL).read())
    (ck / "config.json").write_text(json.dumps(dict(d, window_size=64)))
    line = _refused(["--checkpoint", str(ck), "--config", SMALL], capsys)
    assert f"--config {SMALL} differs from" in line and "window_size 16 vs 64" in line


def test_runtime_error_is_one_line(tmp_path, capsys):
    """An error while running (here: a checkpoint without weights) prints one line and
    returns 1, no traceback."""
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(open(SMALL).read())
    assert generate.main(["--checkpoint", str(ck), "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]


def test_every_option_has_help():
    for action in generate.build_parser()._actions:
        assert action.help, action.option_strings


def test_script_shim_refuses_too(tmp_path):
    """scripts/generate.py runs the same command (here: a refusal, nothing built)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"),
                        "--max-new-tokens", "0"], capture_output=True, text=True, env=env)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("--max-new-tokens: must be >= 1, got 0")


def test_decode_line_never_prints_nan():
    """With --max-new-tokens 1 the one token comes from the prefill: no rate, no "nan"."""
    assert generate.decode_line(0, 0.0) == \
        "decode: no decode steps (the one token came from the prefill)"
    assert generate.decode_line(1, 0.5) == "decode: 1 token in 0.50s = 2.0 tokens/s"
    assert generate.decode_line(4, 2.0) == "decode: 4 tokens in 2.00s = 2.0 tokens/s"
