"""Generation: the on-device loop (:func:`dsv41_jax.generation.generate`) against a Python
loop of ``decode_step`` on the small config with random weights, EOS, its refusals; the chat
format and stop strings (:mod:`dsv41_jax.chat`); the generate command
(:mod:`dsv41_jax.cli.generate`) end to end and its refusals of bad options (exit status 2, one
line, before anything is built).

The generation tests share one compiled loop (batch 2, capacity 64, 5 new tokens, greedy), and
the command's batch test has the same shapes, so it reuses the loop and the prefill."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import chat, generation, model, random_weights, state as st, tokenizer
from dsv41_jax.cli import generate
from dsv41_jax.config import ModelConfig
from dsv41_jax.sampling import SamplingParams

ROOT = os.path.join(os.path.dirname(__file__), "..")
FLASH = os.path.join(ROOT, "configs", "flash.json")
SMALL = os.path.join(ROOT, "configs", "small.json")
N_NEW = 5


@pytest.fixture(autouse=True)
def _no_compile_cache(monkeypatch):
    """The command's default persistent compilation cache off (it would write to ~/.cache)."""
    monkeypatch.setenv("DSV41_JAX_CACHE_DIR", "none")


# ----------------------------------------------------------------------------- generation


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


@pytest.fixture(scope="module")
def small():
    """Small config, seeded random weights, a prefilled batch of 2 (10 and 6 prompt tokens,
    capacity 64), its last logits, and the greedy reference: ``N_NEW`` tokens per row from a
    Python loop of ``model.decode_step`` + argmax, int [2, N_NEW]. The state is never donated:
    tests use copies."""
    cfg = ModelConfig.from_json(SMALL)
    params = model.prepare_params(random_weights.random_params_device(cfg, seed=0), cfg)
    toks = np.zeros((2, 16), np.int32)
    toks[0, :10] = np.arange(100, 110)
    toks[1, :6] = np.arange(2000, 2600, 100)
    out, state = model.prefill(params, cfg, toks, st.init_state(cfg, 2, 64), [10, 6])
    logits = out.logits
    s, ref = _copy(state), []
    nxt = np.asarray(logits).argmax(-1)
    for i in range(N_NEW):
        ref.append(nxt)
        if i < N_NEW - 1:
            lg, s = model.decode_step(params, cfg, s, nxt)
            nxt = np.asarray(lg).argmax(-1)
    return dict(cfg=cfg, params=params, state=state, logits=logits, ref=np.stack(ref, 1),
                ref_state=s)


def test_greedy_generate_equals_a_decode_step_loop(small):
    """Tokens bitwise those of the Python loop; every row runs to max_new_tokens; the state
    holds all generated tokens but the last (the reference loop's state, bitwise)."""
    cfg = small["cfg"]
    res = generation.generate(small["params"], cfg, _copy(small["state"]), small["logits"],
                              max_new_tokens=N_NEW)
    assert isinstance(res, generation.GenerationResult)
    assert res.tokens.dtype == jnp.int32 and res.tokens.shape == (2, N_NEW)
    np.testing.assert_array_equal(res.tokens, small["ref"])
    np.testing.assert_array_equal(res.lengths, [N_NEW, N_NEW])
    np.testing.assert_array_equal(res.state.pos, [10 + N_NEW - 1, 6 + N_NEW - 1])
    np.testing.assert_array_equal(model.host_positions(res.state), res.state.pos)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(res.state),
                            jax.tree.leaves(small["ref_state"])):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                      np.asarray(b).view(np.uint8),
                                      err_msg=jax.tree_util.keystr(path))


def test_eos_ends_a_row(small):
    """EOS = row 0's third greedy token: row 0 stops there (EOS included, -1 after), row 1
    runs on unchanged (unless it meets the same id); the loop runs max(lengths) - 1 steps."""
    ref = small["ref"]
    eos = int(ref[0, 2])
    res = generation.generate(small["params"], small["cfg"], _copy(small["state"]),
                              small["logits"], max_new_tokens=N_NEW, eos_ids=[eos])
    want_len = [list(r).index(eos) + 1 if eos in r else N_NEW for r in ref]
    assert want_len[0] == 3
    np.testing.assert_array_equal(res.lengths, want_len)
    for b, n in enumerate(want_len):
        np.testing.assert_array_equal(res.tokens[b, :n], ref[b, :n])
        assert (np.asarray(res.tokens[b, n:]) == -1).all()
    steps = max(want_len) - 1
    np.testing.assert_array_equal(res.state.pos, [10 + steps, 6 + steps])
    np.testing.assert_array_equal(model.host_positions(res.state), res.state.pos)


def test_every_row_done_early_stops_the_loop(small):
    """EOS ids covering both rows' second token: lengths 2 and 2, one model step."""
    ref = small["ref"]
    res = generation.generate(small["params"], small["cfg"], _copy(small["state"]),
                              small["logits"], max_new_tokens=N_NEW,
                              eos_ids=(int(ref[0, 1]), int(ref[1, 1])))
    want = [min(list(r).index(e) for e in (ref[0, 1], ref[1, 1]) if e in r) + 1 for r in ref]
    assert max(want) == 2
    np.testing.assert_array_equal(res.lengths, want)
    np.testing.assert_array_equal(res.state.pos, [11, 7])


@pytest.mark.annotations_unchecked
@pytest.mark.parametrize("kw, match", [
    (dict(max_new_tokens=55), "max_new_tokens=55: row 0 holds 10 tokens and the state's "
                              "capacity is 64, so at most 54 new tokens fit"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer >= 1"),
    (dict(logits=np.zeros((2, 100), np.float32)),
     r"logits must have shape \[B, V\] = \[2, 129280\].*got \[2, 100\]"),
    (dict(logits=np.zeros((3, 129280), np.float32)), r"the state holds 2 rows.*got \[3, 129280\]"),
    (dict(eos_ids=[129280]), r"eos_ids: 129280 is not a token id in \[0, vocab_size=129280\)"),
    (dict(eos_ids=[-1]), "eos_ids: -1 is not a token id"),
    (dict(attn_impl="triton"), "attn_impl='triton' is now attn_impl='gpu'"),
    (dict(sampling=0.5), "sampling must be a SamplingParams"),
    (dict(seed="x"), "seed must be an integer"),
])
def test_generate_refusals_leave_the_state_untouched(small, kw, match):
    state = _copy(small["state"])
    kw = dict(dict(max_new_tokens=N_NEW, logits=small["logits"]), **kw)
    with pytest.raises(ValueError, match=match):
        generation.generate(small["params"], small["cfg"], state, **kw)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(small["state"])):
        assert not a.is_deleted()
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_length_buckets_and_bucket_length():
    assert generation.length_buckets(256) == (16, 32, 64, 128, 256)
    assert generation.length_buckets(100) == (16, 32, 64, 100)
    assert generation.length_buckets(16) == (16,)
    assert generation.length_buckets(8) == (8,)
    assert generation.length_buckets(40, smallest=10) == (16, 32, 40)
    b = generation.length_buckets(256)
    assert [generation.bucket_length(n, b) for n in (1, 16, 17, 100, 129, 256)] == \
        [16, 16, 32, 128, 256, 256]
    with pytest.raises(ValueError, match="n=257 is above the largest bucket 256"):
        generation.bucket_length(257, b)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        generation.bucket_length(0, b)
    with pytest.raises(ValueError, match="buckets must be a non-empty list"):
        generation.bucket_length(3, [])
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        generation.length_buckets(0)


# ----------------------------------------------------------------------------- chat format


def test_chat_format_and_its_tokens():
    tok = tokenizer.load_tokenizer()
    ids = chat.check_special_tokens(tok)
    assert ids == {chat.BOS_TOKEN: 0, chat.EOS_TOKEN: 1, chat.USER_TOKEN: 128803,
                   chat.ASSISTANT_TOKEN: 128804, chat.THINK_START: 128821,
                   chat.THINK_END: 128822}
    assert chat.eos_id(tok) == tokenizer.EOS_ID == 1
    assert chat.format_chat("Hi", thinking=False) == \
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    assert chat.format_chat("Hi", thinking=True, system="Be brief.") == \
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜><think>"
    for thinking, last in ((False, 128822), (True, 128821)):
        got = chat.chat_ids(tok, "Hello world", thinking=thinking, system="S")
        assert got[0] == 0 and got.count(0) == 1 and got[-1] == last
        assert got[-2] == 128804 and 128803 in got
        body = tokenizer.encode(tok, "Hello world", bos=False)
        i = got.index(128803)
        assert got[i + 1:i + 1 + len(body)] == body


@pytest.mark.parametrize("user, system, match", [
    ("a<｜User｜>b", None, "user_text contains the special token '<｜User｜>'"),
    ("a<｜begin▁of▁sentence｜>", None, "user_text contains the special token"),
    ("a", "x<｜Assistant｜>", "system contains the special token '<｜Assistant｜>'"),
])
def test_chat_refuses_special_tokens_in_the_text(user, system, match):
    with pytest.raises(ValueError, match=match):
        chat.format_chat(user, thinking=False, system=system)


def test_truncate_at_stop():
    assert chat.truncate_at_stop("abc END def", ["END"]) == ("abc ", True)
    assert chat.truncate_at_stop("abc END d\n\nx", ["\n\n", "END"]) == ("abc ", True)
    assert chat.truncate_at_stop("abc d\n\nx END", ["END", "\n\n"]) == ("abc d", True)
    assert chat.truncate_at_stop("abc", ["x"]) == ("abc", False)
    assert chat.truncate_at_stop("abc", []) == ("abc", False)
    assert chat.truncate_at_stop("STOP", ["STOP"]) == ("", True)
    with pytest.raises(ValueError, match="stops: '' is not a non-empty string"):
        chat.truncate_at_stop("abc", [""])


# ----------------------------------------------------------------------------- command


def test_generate_end_to_end(tmp_path, capsys):
    """Tokenize, CED prefill, decode 3 tokens; the report and the JSON carry the measurements."""
    out_json = tmp_path / "gen.json"
    assert generate.main(["--prompt", "The quick brown fox jumps over the lazy dog. " * 3,
                          "--max-new-tokens", "3", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "SEEDED RANDOM WEIGHTS" in text
    assert "time to first token" in text and "tokens/s" in text and "nan" not in text
    assert "prefill in 1 call of width 32; state capacity 64" in text
    assert "global KV source layer 2 (ratio 2)" in text
    rec = json.loads(out_json.read_text())
    assert rec["prompt_tokens"] == 32 and len(rec["rows"]) == 1
    row = rec["rows"][0]
    assert row["prompt_tokens"] == 32 and len(row["generated"]) in (1, 2, 3)
    assert all(0 <= t < 129280 for t in row["generated"])
    assert row["finish"] == ("length" if len(row["generated"]) == 3 else "eos")
    assert rec["decode_tokens_per_s"] > 0
    assert "generation loop: compiled in " in text
    assert rec["loop_compile_s"] > 0 and rec["loop_wait_s"] >= 0


def test_converted_parameters_skip_the_conversion(tmp_path):
    """--converted DIR (generate.load_prepared, the command's loading): the first start
    converts and saves (orbax), the next restores the same prepared tree; other weights (a
    seed) are refused, naming both."""
    from benchmarks.config import tiny_config
    cfg, _ = tiny_config("drop")
    conv = tmp_path / "conv"
    args = generate.build_parser().parse_args(["--converted", str(conv)])
    args.config = "tiny"
    _, first, src = generate.load_prepared(args, cfg)
    assert f"converted parameters saved to {conv}" in src
    _, second, src = generate.load_prepared(args, cfg)
    assert f"converted parameters restored from {conv}" in src
    assert jax.tree.structure(first) == jax.tree.structure(second)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    args.seed = 1
    with pytest.raises(ValueError, match="was converted from 'seeded random weights, seed 0', "
                                         "not 'seeded random weights, seed 1'"):
        generate.load_prepared(args, cfg)


def test_generate_a_batch_of_chat_prompts_with_a_stop_string(tmp_path, capsys):
    """--prompts-file (2 prompts, one batch), --chat: greedy tokens, then the same with --stop
    set to a piece of the first row's text: that row is cut before it and marked "stop", the
    tokens do not change; --time-steady repeats the run and reports the same tokens."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n\nThe capital of France is\n")
    out1, out2 = tmp_path / "a.json", tmp_path / "b.json"
    base = ["--prompts-file", str(prompts), "--chat", "--max-new-tokens", str(N_NEW)]
    assert generate.main(base + ["--json", str(out1)]) == 0
    text = capsys.readouterr().out
    assert "2 prompts of 6-9 tokens (prefill in 1 call of width 16; state capacity 64)" in text
    assert text.count("[generated] ") == 2
    rec = json.loads(out1.read_text())
    tok = tokenizer.load_tokenizer()
    assert [r["prompt_tokens"] for r in rec["rows"]] == \
        [len(chat.chat_ids(tok, p, thinking=False)) for p in ("Hello there",
                                                              "The capital of France is")]
    first = rec["rows"][0]
    assert first["finish"] in ("length", "eos") and len(first["text"]) > 2
    stop = first["text"][1:3]
    assert generate.main(base + ["--stop", stop, "--stop", "\x00never", "--time-steady",
                                 "--json", str(out2)]) == 0
    text = capsys.readouterr().out
    assert "[stopped at a stop string]" in text
    assert "prefill (steady, a second run on a fresh state)" in text
    assert "decode (steady)" in text and "different tokens" not in text
    rec2 = json.loads(out2.read_text())
    row = rec2["rows"][0]
    assert row["finish"] == "stop" and row["text"] == first["text"][:first["text"].index(stop)]
    assert [r["generated"] for r in rec2["rows"]] == [r["generated"] for r in rec["rows"]]
    assert rec2["steady"]["same_tokens"] is True


SPEC_PROMPT = "The cat sat on the mat, and the dog ran to the park."


def _spec_config(tmp_path) -> str:
    """The tiny config (benchmarks.config) with a DSpark head (one stage, 2 drafts, targets
    3-5) and the first 16,384 token ids (the prompt's fit), as a JSON file."""
    from benchmarks.config import tiny_config
    d = tiny_config("drop")[0].to_dict()
    d.update(vocab_size=16384, n_mtp_layers=1, dspark_block_size=2,
             dspark_target_layer_ids=[3, 4, 5], dspark_markov_rank=16,
             dspark_noise_token_id=16383)
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_generate_speculative_end_to_end(tmp_path, capsys):
    """--speculative --drafts auto (sampled, --no-eos; the token distribution is tested in
    tests/test_speculative.py): the report and the JSON carry the verify calls, the acceptance
    length and the tokens per main-model call, consistent with each other (5 tokens after the
    first over the calls; at most the acceptance length + 1 per call)."""
    cfg = _spec_config(tmp_path)
    b = tmp_path / "b.json"
    assert generate.main(["--config", cfg, "--prompt", SPEC_PROMPT, "--max-new-tokens", "6",
                          "--no-eos", "--mode", "exact", "--temperature", "2",
                          "--speculative", "--drafts", "auto",
                          "--confidence-threshold", "0.2", "--json", str(b)]) == 0
    text = capsys.readouterr().out
    assert "speculative: DSpark drafts per call: auto (confidence >= 0.2, at most 2)" in text
    assert "main-model calls (verify); acceptance length " in text
    assert "tokens per main-model call" in text and "nan" not in text
    spec = json.loads(b.read_text())
    assert len(spec["rows"][0]["generated"]) == 6
    assert all(0 <= t < 16384 for t in spec["rows"][0]["generated"])
    sp = spec["speculative"]
    assert sp["drafts"] == "auto" and 1 <= sp["verify_calls"] <= 5
    assert sp["verify_calls"] <= sp["drafts_verified"] <= 2 * sp["verify_calls"]
    assert sp["tokens_per_call"] * sp["verify_calls"] == pytest.approx(5)
    assert 0 <= sp["acceptance_length"] <= 2
    # the last call's tokens may be cut at max_new_tokens
    assert sp["tokens_per_call"] <= sp["acceptance_length"] + 1 + 1e-9
    assert sp["draft_acceptance_rate"] == pytest.approx(
        sp["acceptance_length"] * sp["verify_calls"] / sp["drafts_verified"])


def test_speculative_refusals_naming_the_head(tmp_path, capsys):
    """--drafts above the block size and a checkpoint whose files ship no mtp.* tensor (read
    from the headers, nothing loaded) are refused (status 2); --speculative with --mesh is
    taken (the loop runs on the mesh: generation.generate_speculative(mesh=),
    tests/test_sharding.py)."""
    cfg = _spec_config(tmp_path)
    assert "argument --drafts: at most 2 (the DSpark block size), got 3" in _refused(
        ["--config", cfg, "--speculative", "--drafts", "3"], capsys)
    args, _ = generate.parse_args(["--config", cfg, "--speculative", "--mesh", "data=1"])
    assert args.speculative and args.mesh == {"data": 1, "tensor": 1, "expert": 1}
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(open(cfg).read())
    from dsv41_jax import checkpoint
    checkpoint.write_safetensors(ck / "model.safetensors",
                                 {"embed.weight": np.zeros((2, 2), np.float32)})
    assert f"argument --speculative: the checkpoint {ck} ships no DSpark draft head (no mtp.* " \
           "tensor)" in _refused(["--checkpoint", str(ck), "--speculative"], capsys)


def test_chunk_plan_and_state_capacity():
    assert generate.chunk_plan([600], 256) == [[256], [256], [88]]
    assert generate.chunk_plan([600, 10], 256) == [[256, 8], [256, 1], [88, 1]]
    assert generate.chunk_plan([5, 3], 256) == [[5, 3]]
    with pytest.raises(ValueError, match="prompt 1 has 2 tokens, fewer than the 3 prefill"):
        generate.chunk_plan([600, 2], 256)
    assert [generate.state_capacity(n) for n in (1, 64, 65, 4096, 4097, 9000)] == \
        [64, 64, 128, 4096, 8192, 12288]


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
    (["--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
    (["--top-p", "0"], r"argument --top-p: must be a number in (0, 1] (1: off), got 0"),
    (["--top-p", "1.5"], r"argument --top-p: must be a number in (0, 1]"),
    (["--top-k", "40"], "argument --top-k: only with --temperature > 0 (temperature 0 is "
                        "greedy"),
    (["--top-p", "0.9", "--temperature", "0"], "argument --top-p: only with --temperature > 0"),
    (["--thinking"], "argument --thinking: only with --chat"),
    (["--system", "x"], "argument --system: only with --chat"),
    (["--stop", ""], "argument --stop: the stop string is empty"),
    (["--chat", "--prompt", "a<｜User｜>b"],
     "argument --chat: user_text contains the special token '<｜User｜>'"),
    (["--prompts-file", "no/such.txt"], "argument --prompts-file: no such file: no/such.txt"),
    (["--prompt", "a", "--prompts-file", "p.txt"],
     "argument --prompts-file: not allowed with argument --prompt"),
    (["--compile-cache", ""], "argument --compile-cache: compile cache directory: empty"),
    (["--compile-cache", SMALL], f"argument --compile-cache: {os.path.abspath(SMALL)} is not a "
                                 "directory"),
    (["--converted", SMALL], f"argument --converted: {SMALL} is not a directory"),
    (["--engram", "host"], "argument --engram: only with --mesh"),
    (["--mesh", "tensor=2,tensor=4"], "argument --mesh: mesh axis 'tensor' given twice"),
    (["--mesh", "tensor"], "argument --mesh: 'tensor' is not axis=size (e.g. 'tensor=2')"),
    (["--mesh", ""], "argument --mesh: empty mesh spec ''"),
    (["--mesh", "data=x"], "argument --mesh: the size of 'data' must be an integer >= 1, got 'x'"),
    (["--mesh", "tensor=2,expert=4"], "argument --mesh: mesh (data=1, tensor=2, expert=4) needs "
                                      "8 devices but 1 were given"),
    (["--drafts", "2"], "argument --drafts: only with --speculative"),
    (["--confidence-threshold", "0.3"], "argument --confidence-threshold: only with "
                                        "--speculative"),
    (["--speculative", "--confidence-threshold", "0.3"],
     "argument --confidence-threshold: only with --drafts auto"),
    (["--speculative", "--drafts", "0"], "argument --drafts: must be an integer >= 1 or 'auto', "
                                         "got 0"),
    (["--speculative", "--drafts", "many"], "argument --drafts: must be an integer >= 1 or "
                                            "'auto', got 'many'"),
    (["--speculative", "--drafts", "auto", "--confidence-threshold", "1.5"],
     "argument --confidence-threshold: must be a number in [0, 1], got 1.5"),
    (["--speculative"], "argument --speculative: the config has no DSpark draft head "
                        "(n_mtp_layers 0, dspark_block_size 0)"),
])
def test_refused_options(argv, match, capsys):
    assert match in _refused(argv, capsys)


def test_refuses_an_empty_prompt_file(tmp_path, capsys):
    p = tmp_path / "p.txt"
    p.write_text("\n")
    assert f"argument --prompt-file: {p} is empty" in _refused(["--prompt-file", str(p)], capsys)


def test_refuses_unreadable_prompt_files(tmp_path, capsys):
    """A prompt file that is not UTF-8, or a directory, is refused with one line naming the
    option (not a traceback, not "no such file")."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfeh\x00i\x00")
    for opt in ("--prompt-file", "--prompts-file"):
        assert f"argument {opt}: {bad} is not UTF-8 text (byte 0" in _refused([opt, str(bad)],
                                                                              capsys)
        assert f"argument {opt}: {tmp_path} is a directory, not a file" in _refused(
            [opt, str(tmp_path)], capsys)


def test_refuses_a_cache_directory_it_cannot_make(tmp_path, capsys):
    """A cache directory that cannot be created is refused naming --compile-cache."""
    blocked = tmp_path / "file"
    blocked.write_text("x")
    where = blocked / "cache"          # below a regular file: makedirs fails
    line = _refused(["--compile-cache", str(where), "--max-new-tokens", "1"], capsys)
    assert f"argument --compile-cache: cannot use {where}: Not a directory" in line


def test_refuses_a_blank_prompts_file_and_prompts_too_far_apart(tmp_path, capsys):
    p = tmp_path / "p.txt"
    p.write_text("\n  \n")
    assert f"argument --prompts-file: {p} has no prompt" in _refused(["--prompts-file", str(p)],
                                                                     capsys)
    p.write_text("a\n" + "word " * 40 + "\n")
    line = _refused(["--prompts-file", str(p), "--chunk", "16"], capsys)
    assert "argument --prompts-file: prompt 0 has 2 tokens, fewer than the 3 prefill chunks" \
        in line


def test_refuses_a_config_with_a_misspelt_key(tmp_path, capsys):
    d = json.loads(open(SMALL).read())
    d["windw_size"] = d.pop("window_size")
    p = tmp_path / "c.json"
    p.write_text(json.dumps(d))
    line = _refused(["--config", str(p)], capsys)
    assert "unknown config key 'windw_size'" in line and "'window_size'" in line


def test_config_and_checkpoint_must_agree(tmp_path, capsys):
    """--config beside --checkpoint: refused when it differs from the checkpoint's config.json
    (naming the differing keys); a checkpoint without config.json needs --config (a folder
    holding checkpoints: the message names those inside)."""
    ck = tmp_path / "ckpt"
    ck.mkdir()
    line = _refused(["--checkpoint", str(ck)], capsys)
    assert "has no config.json (a checkpoint without its own config.json: pass --config)" in line
    # a folder of checkpoints: the ones inside are named
    (ck / "demo").mkdir()
    (ck / "demo" / "config.json").write_text(open(SMALL).read())
    line = _refused(["--checkpoint", str(ck)], capsys)
    assert f"has no config.json; these folders in it have one: {ck / 'demo'}" in line
    (ck / "demo" / "config.json").unlink()
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
    assert generate.decode_line(4, 2.0, rows=3) == "decode: 4 steps x 3 rows in 2.00s = 6.0 tokens/s"
