"""Training of the DSpark draft head (:mod:`dsv41_jax.draft_training`; docs/training.md,
"Training the draft head"): its forward computes the inference draft (the reference's, on the
tiny-a-bf16 weights), its export is the reference's ``mtp.*`` format, and a few steps on a
fixed batch bring the draft towards the main model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import checkpoint, draft_training as dt, model, state as st, training
from dsv41_jax.checkpoint import expected_dspark_tensors
from dsv41_jax.config import ModelConfig


@pytest.fixture(scope="module")
def bf16_setup(tiny_a_bf16):
    cfg, params, _ = tiny_a_bf16
    return cfg, params, training.train_params_from(params)


def _tokens(seed, shape, vocab):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("p", [3, 9])        # ring partly empty (window 8), ring full
def test_training_draft_is_the_inference_draft(bf16_setup, p):
    """At anchor ``p``, on the target features the inference captured (its DSpark feature
    ring after an exact prefill of ``p + 1`` tokens), the training forward's draft (window KV
    QDQ'd, ``qat``) is :func:`dsv41_jax.model.draft`'s with ``forced`` = the same text:
    logits within the inference's FP8 / bf16 roundings (mean error 1-2% of their spread,
    where an anchor off by one gives 65-75%), the same top tokens up to near ties, the same
    confidence."""
    cfg, params, tp = bf16_setup
    bs, S, W = cfg.dspark_block_size, 16, cfg.window_size
    tokens = _tokens(p, (1, S), cfg.vocab_size)
    state = st.init_state(cfg, 1, 32)
    _, state = model.prefill(params, cfg, tokens[:, :p + 1], state, mode="exact")
    forced = tokens[:, p + 1:p + 1 + bs]
    _, inf_logits, inf_conf = model.draft(params, cfg, state, tokens[:, p + 1], forced=forced)
    T = len(cfg.dspark_target_layer_ids)
    ring = np.asarray(state.dspark.features, np.float32).reshape(1, W, T, cfg.dim)
    feats = np.zeros((1, S, T, cfg.dim), np.float32)
    for q in range(max(0, p - W + 1), p + 1):
        feats[0, q] = ring[0, q % W]
    want, want_conf = np.asarray(inf_logits[0]), np.asarray(inf_conf[0])
    scale = np.std(want)
    for anchor, ok in ((p, True), (p - 1, False)):
        out = dt.draft_forward(tp["dspark"], tp["embed"]["weight"], tp["head"]["weight"],
                               jnp.asarray(feats), jnp.asarray(tokens),
                               jnp.asarray([[anchor]], jnp.int32), cfg, qat=True)
        err = np.abs(np.asarray(out.logits[0, 0]) - want) / scale
        if not ok:                       # the check tells a misplaced block apart
            assert err.mean() > 0.3
            continue
        assert err.mean() < 0.03 and err.max() < 0.2, (err.mean(), err.max())
        # the inference's top token is the training draft's, up to a near tie
        got = np.asarray(out.logits[0, 0])
        at_top = np.take_along_axis(got, np.argmax(want, -1)[:, None], -1)[:, 0]
        assert (got.max(-1) - at_top < 0.1 * scale).all()
        np.testing.assert_allclose(np.asarray(out.confidence[0, 0]), want_conf,
                                   atol=0.1 * float(np.abs(want_conf).max()))


def test_training_features_are_the_main_forward_inputs(bf16_setup):
    """``train_forward(capture=...)`` returns the stream means of the target layers' inputs:
    on the tiny-a-bf16 weights they follow the inference's captured features (the training
    forward has no FP8 / FP4 quantisers, so they differ by the main model's quantisation
    noise, here 25-30% of their range at layers 9-11, but stay correlated)."""
    cfg, params, tp = bf16_setup
    W, T = cfg.window_size, len(cfg.dspark_target_layer_ids)
    tokens = _tokens(9, (1, W), cfg.vocab_size)
    state = st.init_state(cfg, 1, 32)
    _, state = model.prefill(params, cfg, tokens, state, mode="exact")
    ring = np.asarray(state.dspark.features, np.float32).reshape(W, T * cfg.dim)
    feats = training.train_forward(tp, cfg, jnp.asarray(tokens),
                                   capture=cfg.dspark_target_layer_ids).features
    got = np.asarray(feats[0]).reshape(W, T * cfg.dim)
    corr = [np.corrcoef(got[q], ring[q])[0, 1] for q in range(W)]
    assert min(corr) > 0.8, corr


def test_capture_returns_block_inputs_and_leaves_logits(bf16_setup):
    cfg, _, tp = bf16_setup
    tokens = jnp.asarray(_tokens(1, (2, 12), cfg.vocab_size))
    plain = training.train_forward(tp, cfg, tokens)
    cap = training.train_forward(tp, cfg, tokens, capture=(11, 9))
    assert plain.features is None
    np.testing.assert_array_equal(np.asarray(cap.logits), np.asarray(plain.logits))
    assert cap.features.shape == (2, 12, 2, cfg.dim)
    # layer 0's input is the embedding repeated over the streams: its mean is the embedding
    first = training.train_forward(tp, cfg, tokens, capture=(0,)).features[:, :, 0]
    np.testing.assert_allclose(np.asarray(first), np.asarray(tp["embed"]["weight"][tokens]),
                               rtol=1e-6)


def test_export_is_the_reference_mtp_format(bf16_setup):
    """``export_tensors(only_dspark=True)`` writes exactly the expected ``mtp.*`` tensors, and
    the loader reads them back into the same draft head (bf16 tensors bit for bit)."""
    cfg, params, tp = bf16_setup
    flat = training.export_tensors({"dspark": tp["dspark"]}, cfg, only_dspark=True)
    exp = expected_dspark_tensors(cfg)
    assert set(flat) == set(exp)
    for name, (shape, dtypes) in exp.items():
        assert flat[name].shape == tuple(shape), name
    back = checkpoint.params_from_tensors(
        {**training.export_tensors(tp, cfg)}, cfg)["dspark"]
    assert jax.tree.structure(back) == jax.tree.structure(params["dspark"])
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params["dspark"])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="no dspark subtree"):
        training.export_tensors({"layers": []}, cfg, only_dspark=True)


def test_with_dspark_and_anchors():
    cfg = ModelConfig.from_json("configs/demo.json")
    d = dt.with_dspark(cfg, markov_rank=8, experts=(16, 2))
    assert d.dspark_on and d.n_mtp_layers == 3 and d.dspark_target_layer_ids == (9, 10, 11)
    assert d.compress_ratios == cfg.compress_ratios + (0, 0, 0)
    assert d.dspark_experts == (16, 2) and d.dspark_noise_token_id == dt.NOISE_TOKEN_ID
    with pytest.raises(ValueError, match="DSpark off"):
        dt.init_draft_params(cfg)
    a = np.asarray(dt.draft_anchors(jax.random.key(0), 3, 20, 15, 5))
    assert a.shape == (3, 15) and a.min() >= 0 and a.max() <= 14
    assert all(len(set(r)) == 15 for r in a)            # distinct, so all 15 positions
    with pytest.raises(ValueError, match=r"n anchors must be in \[1, 15\]"):
        dt.draft_anchors(jax.random.key(0), 1, 20, 16, 5)


def test_steps_bring_the_draft_towards_the_main_model(bf16_setup):
    """From fresh draft weights, 25 AdamW steps on one batch cut the KL to the main model by
    more than half; the stage gate biases move by the balancing rule, not the optimizer."""
    cfg, _, tp = bf16_setup
    tpd = dt.init_draft_params(cfg, seed=3)
    tokens = jnp.asarray(_tokens(5, (2, 24), cfg.vocab_size))
    anchors = dt.draft_anchors(jax.random.key(1), 2, 24, 8, cfg.dspark_block_size)
    first = float(dt.draft_eval(tpd, tp, cfg, tokens, anchors)["kl"])
    trainable, biases = dt.split_stage_biases(tpd)
    b0 = [np.asarray(b) for b in biases]
    tx = training.AdamW(lr=3e-3, warmup_steps=1, total_steps=25, weight_decay=0.0)
    opt = tx.init(trainable)
    for _ in range(25):
        trainable, biases, opt, m = dt.draft_train_step(trainable, biases, opt, tp, tokens,
                                                        anchors, cfg=cfg, tx=tx)
    last = float(dt.draft_eval(dt.join_stage_biases(trainable, biases), tp, cfg, tokens,
                               anchors)["kl"])
    assert np.isfinite(first) and last < 0.5 * first, (first, last)
    moved = [np.abs(np.asarray(b) - b0_).max() for b, b0_ in zip(biases, b0)]
    assert all(0 < mv <= 25 * 1e-3 + 1e-6 for mv in moved), moved


def test_train_draft_script_smoke(tmp_path, tiny_a_bf16):
    """``scripts/train_draft.py`` on the tiny-a-bf16 main model without its head (2 steps on
    random tokens): the history, an exported checkpoint the loader reads with the new head
    (``mtp.*`` in ``dspark.safetensors``, DSpark on in its config), and the acceptance
    measurement with the tokens of plain decoding; run again on that export, the old head is
    replaced; a file mixing a head with the main model's tensors is refused."""
    import importlib.util
    import json
    import os
    from conftest import fixture_dir
    cfg, _, _ = tiny_a_bf16
    src = tmp_path / "main"
    src.mkdir()
    flat = checkpoint.read_checkpoint(fixture_dir("tiny-a-bf16"))
    checkpoint.write_safetensors(src / "model.safetensors",
                                 {k: v for k, v in flat.items() if not k.startswith("mtp.")})
    main_cfg = cfg.replace(n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=(),
                           compress_ratios=cfg.compress_ratios[:cfg.n_layers])
    (src / "config.json").write_text(json.dumps(main_cfg.to_dict()))
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(3, cfg.vocab_size, 3000).astype(np.uint32).tofile(data / "train.bin")
    rng.integers(3, cfg.vocab_size, 600).astype(np.uint32).tofile(data / "val.bin")
    spec = importlib.util.spec_from_file_location(
        "train_draft", os.path.join(os.path.dirname(__file__), "..", "scripts", "train_draft.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "out"
    argv = ["--checkpoint", str(src), "--data", str(data), "--out", str(out), "--steps", "2",
            "--batch", "2", "--seq-len", "32", "--anchors", "4", "--eval-every", "2",
            "--eval-batches", "1", "--prompts", "2", "--prompt-len", "12", "--new-tokens", "6",
            "--experts", "4,2", "--block-size", "3"]
    s = script.run(script.parse_args(argv))
    hist = json.loads((out / "history.json").read_text())
    assert [r["step"] for r in hist["val"]] == [0, 2] and len(hist["train"]) == 1
    ck = out / "checkpoint"
    assert sorted(os.listdir(ck)) == ["config.json", "dspark.safetensors", "model.safetensors"]
    loaded_cfg, params = checkpoint.load_params(str(ck))
    assert loaded_cfg.dspark_on and loaded_cfg.dspark_experts == (4, 2)
    assert len(params["dspark"]["stages"]) == 3
    assert [a["drafts"] for a in s["acceptance"]] == [3, "auto"]
    assert all(a["same_tokens_as_plain"] for a in s["acceptance"])
    # its own export again: the old head (a file of its own) is replaced, not copied
    s2 = script.run(script.parse_args(argv[:1] + [str(ck)] + argv[2:5] + [str(tmp_path / "again")]
                                      + argv[6:]))
    assert sorted(os.listdir(tmp_path / "again" / "checkpoint")) == sorted(os.listdir(ck))
    assert s2["steps"] == 2
    with pytest.raises(ValueError, match="holds a draft head .* beside the main"):
        script.run(script.parse_args(["--checkpoint", fixture_dir("tiny-a-bf16"),
                                      "--data", str(data), "--out", str(tmp_path / "mixed")]))
    with pytest.raises(SystemExit):
        script.parse_args(["--experts", "2,3"])
