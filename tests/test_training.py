"""Training (dsv41_jax.training, docs/training.md): the training forward computes the inference
model, its gradients match finite differences for every kind of parameter, a fixed batch is
overfit, a run resumed from an orbax checkpoint continues bit-exactly, and the exported
checkpoint goes through the reference loader."""

import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from benchmarks.config import identity_token_map, tiny_config
from dsv41_jax import checkpoint, model, random_weights, training
from dsv41_jax.config import LayerPlan
from dsv41_jax.layers import engram as engram_layer
from dsv41_jax.layers import mhc
from dsv41_jax.layers.linear import rms_norm


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name):
    spec = importlib.util.spec_from_file_location(f"_{name}", os.path.join(ROOT, "scripts",
                                                                           f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# scripts/train_config.py:tiny; the tests below train with the same optimizer and shapes, so
# that they and the scripts/train.py smoke run share one compiled step
TINY_RUN = _script("train_config").get_config("tiny")


@pytest.fixture(scope="module")
def tiny():
    """The tiny config (every layer role, Engram on layer 1) and its training parameters."""
    cfg, _ = tiny_config()
    return cfg, training.init_train_params(cfg, 0, identity_token_map(cfg.vocab_size))


def _tokens(cfg, shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, cfg.vocab_size, shape),
                       jnp.int32)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_training_block_computes_the_inference_block():
    """Layer by layer, teacher-forced on the inference forward's inputs (bf16 weights, the KV
    quantisers on as straight-through QDQ): every block's output within 10% (norm) of the
    inference block's (the rest is bf16 rounding and the FP8 / FP4 code flips it causes), the
    SWA-only layer's attention within 3%, and the index sources pick the same top-k for most
    queries."""
    cfg, _ = tiny_config()
    cfg = cfg.replace(dtype="bf16", expert_dtype="bf16")
    tmap = identity_token_map(cfg.vocab_size)
    params = checkpoint.params_from_tensors(random_weights.random_tensors(cfg, 0), cfg, tmap)
    tp = training.train_params_from(params)
    tok = np.asarray(_tokens(cfg, (1, 32)))
    ref = model.forward(params, cfg, tok, collect=True).records
    roles = LayerPlan.from_config(cfg).roles
    B, S = tok.shape
    X0 = jnp.repeat(tp["embed"]["weight"][tok][:, :, None, :], cfg.hc_mult, axis=2)
    inputs = [(X0, mhc.identity_pre_mix((B, S), cfg.hc_mult))] + [
        (ref[r.layer]["block_out"].astype(jnp.float32), ref[r.layer]["block_pre_mix"])
        for r in roles[:-1]]

    @jax.jit
    def teacher_forced(tp, inputs):
        ids = engram_layer.engram_hash_ids(
            tp["engram_token_map"][tok], engram_layer.engram_init_history(B, 3),
            jnp.arange(S, dtype=jnp.int32)[None], tp["engram_consts"])
        sources, bus, freqs, outs = {}, {}, training.rope_tables(cfg), []
        for role, (X, pre_mix) in zip(roles, inputs):
            lp = tp["layers"][role.layer]
            out = training.train_block(lp, X, pre_mix, role, cfg, freqs, sources, bus,
                                       ids[:, :, 0], qat=True)[0]
            xa = rms_norm(training._hc_pre(X, pre_mix), lp["attn_norm"]["weight"],
                          cfg.norm_eps)
            attn = training._attention(lp["attn"], xa, role, cfg, freqs[role.rope],
                                       dict(sources), dict(bus), True)[0]
            outs.append((out, attn, bus.get("selected") if role.owns_index else None))
        return outs

    for role, (out, attn, sel) in zip(roles, teacher_forced(tp, inputs)):
        rec = ref[role.layer]
        assert _rel(out, rec["block_out"]) < 0.1, role
        if role.mode == "swa":
            assert _rel(attn, rec["attn_out"]) < 0.03
        if role.owns_index:
            sel = np.asarray(sel)
            mine = np.sort(np.where(sel, np.arange(sel.shape[-1]), 10 ** 6), -1)
            theirs = np.asarray(rec["index_topk"])
            k = theirs.shape[-1]
            theirs = np.sort(np.where(theirs < 0, 10 ** 6, theirs), -1)
            agree = np.mean(np.all(mine[..., :k] == theirs, -1))
            assert agree > 0.75, (role, agree)


@pytest.fixture(scope="module")
def collected(tiny):
    """24 tokens through the tiny model's training forward with ``collect=True``."""
    cfg, tp = tiny
    tok = _tokens(cfg, (1, 24))
    return tok, jax.jit(lambda tp, t: training.train_forward(tp, cfg, t, collect=True))(tp, tok)


def test_collect_records_what_each_layer_attends_to(tiny, collected):
    """``train_forward(collect=True)`` leaves the logits bitwise as they are and records, per
    layer, attention masses that sum to 1 with the sink, a selection inside the visible entries
    (a Reuse layer's that of its index source), and query logits finite exactly where an entry
    is visible; a Reindex layer's candidate pool and unrestricted indexer scores."""
    cfg, tp = tiny
    tok, out = collected
    plain = jax.jit(lambda tp, t: training.train_forward(tp, cfg, t))(tp, tok)
    assert plain.records is None
    np.testing.assert_array_equal(np.asarray(plain.logits), np.asarray(out.logits))
    roles = LayerPlan.from_config(cfg).roles
    assert sorted(out.records) == [r.layer for r in roles]
    for r in roles:
        rec = jax.tree.map(np.asarray, out.records[r.layer])
        total = rec["mass_window"] + rec["mass_global"] + rec["mass_sink"]
        np.testing.assert_allclose(total, 1, atol=1e-5)
        if not r.ratio:
            assert "selected" not in rec and (rec["mass_global"] == 0).all()
            continue
        vis, sel = rec["visible"], rec["selected"]
        assert (sel <= vis).all() and sel.any()
        assert (np.isfinite(rec["global_logits"]) == vis[:, :, None, :]).all()
        if r.mode == "reuse":
            src = np.asarray(out.records[r.index_layer]["selected"])
            np.testing.assert_array_equal(sel, src & vis)
        if r.mode == "reindex":
            pool = rec["candidates"]
            assert (sel <= pool).all() and np.isfinite(rec["index_score"][vis]).all()
            assert (~pool & vis).any()          # the pool restricts


def test_attention_sublayers_take_the_quantisers_apart(tiny, collected):
    """``attention_sublayers`` teacher-forced on the training forward's own ``attn_input``
    records gives its ``attn_output`` and selections; with the value quantisers only
    (``qat=("main", "window")``) every layer keeps that selection and its output moves; with
    the indexer's (``"index_k"``, ``"index_q"``) too, as ``qat=True``, some selections change;
    an unknown kind is refused."""
    cfg, tp = tiny
    _, out = collected
    inputs = {l: r["attn_input"] for l, r in out.records.items()}
    kinds = [(), ("main", "window"), training.QAT_KINDS, True]
    runs = jax.jit(lambda tp, x: [training.attention_sublayers(tp, cfg, x, qat=q)
                                  for q in kinds])(tp, inputs)
    ref, values, every, qat_true = jax.tree.map(np.asarray, runs)
    roles = LayerPlan.from_config(cfg).roles
    changed = 0
    for r in roles:
        rec = jax.tree.map(np.asarray, out.records[r.layer])
        np.testing.assert_allclose(ref[r.layer]["out"], rec["attn_output"], rtol=1e-5,
                                   atol=1e-6)
        assert _rel(values[r.layer]["out"], ref[r.layer]["out"]) > 1e-3
        np.testing.assert_array_equal(every[r.layer]["out"], qat_true[r.layer]["out"])
        if r.ratio:
            np.testing.assert_array_equal(ref[r.layer]["selected"], rec["selected"])
            np.testing.assert_array_equal(values[r.layer]["selected"], rec["selected"])
            changed += int((every[r.layer]["selected"] != rec["selected"]).sum())
    assert changed > 0
    with pytest.raises(ValueError, match="unknown qat kinds"):
        training.attention_sublayers(tp, cfg, inputs, qat=("main", "fp4"))


# (path in the training tree, what it exercises); all on the LM loss
LM_PARAMS = [
    (("layers", 1, "attn", "wq_a", "weight"), "attention query (Full, ratio 2)"),
    (("layers", 4, "attn", "wkv", "weight"), "window KV (Reuse, ratio 1)"),
    (("layers", 1, "attn", "compressor", "wgate", "weight"), "ratio-2 compressor gate"),
    (("layers", 3, "attn", "compressor", "wkv", "weight"), "ratio-1 compressor"),
    (("layers", 5, "attn", "wo_a", "weight"), "grouped output projection (Reindex)"),
    (("layers", 0, "attn", "attn_sink"), "attention sink"),
    (("layers", 2, "hc_attn_fn"), "mHC coefficient head"),
    (("layers", 3, "hc_ffn_base"), "mHC base"),
    (("layers", 4, "hc_attn_scale"), "mHC scale"),
    (("layers", 2, "ffn", "experts", "w1", "weight"), "routed experts"),
    (("layers", 0, "ffn", "gate", "weight"), "router"),
    (("layers", 5, "ffn", "shared_experts", "w2", "weight"), "shared expert"),
    (("layers", 1, "engram", "embed", "weight"), "Engram table"),
    (("layers", 1, "engram", "wkv", "weight"), "Engram projection"),
    (("layers", 1, "engram", "q_weight"), "Engram gate weight"),
    (("embed", "weight"), "embedding"),
    (("head", "weight"), "head"),
]
INDEXER_PARAMS = [
    (("layers", 1, "attn", "indexer", "wq_b", "weight"), "indexer queries (Full, ratio 2)"),
    (("layers", 3, "attn", "indexer", "wk", "weight"), "indexer K (ratio-1 source)"),
    (("layers", 5, "attn", "indexer", "weights_proj", "weight"), "indexer head weights (Reindex)"),
]


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    k = path[0]
    if isinstance(tree, list):
        out = list(tree)
        out[k] = _set(tree[k], path[1:], value)
        return out
    return {**tree, k: _set(tree[k], path[1:], value)}


def test_gradients_match_finite_differences(tiny):
    """For a parameter of every kind, the directional derivative ``grad . v`` along a random
    direction ``v`` (elements of the parameter's rms) matches the fp32 central difference
    ``(L(p + h v) - L(p - h v)) / 2h``, ``h = 1e-2``, to 3% plus 2e-4 (the fp32 rounding of
    the loss over 2h); the LM loss for the model's parameters, the distillation loss for the
    indexers', whose LM-loss gradient is exactly 0 (the top-k is not differentiated, the
    indexers' inputs are detached). 8 positions: every visible entry is then selected
    (T <= index_topk), so the loss is smooth; a selection that flips under the perturbation
    would be a jump no finite difference follows."""
    cfg, full = tiny
    tp, biases, consts = training.split_biases(full)
    tok = _tokens(cfg, (1, 9), seed=3)

    def both(t):
        m = training.losses(training.join_biases(t, biases, consts), cfg, tok)[1]
        return m["lm"], m["distill"]

    with jax.default_matmul_precision("highest"):
        f = jax.jit(both)
        grads = jax.jit(jax.jacrev(both))(tp)
        for k, params in ((0, LM_PARAMS), (1, INDEXER_PARAMS)):
            for i, (path, what) in enumerate(params):
                p = _get(tp, path)
                rms = float(jnp.sqrt(jnp.mean(p * p))) or 1e-2
                v = jnp.asarray(np.random.default_rng(i).standard_normal(p.shape),
                                jnp.float32) * rms
                h = 1e-2
                fd = (f(_set(tp, path, p + h * v))[k] - f(_set(tp, path, p - h * v))[k]) / (2 * h)
                an = jnp.sum(_get(grads[k], path) * v)
                assert abs(float(an) - float(fd)) < 0.03 * abs(float(fd)) + 2e-4, (
                    what, float(an), float(fd))
    for path, what in INDEXER_PARAMS:
        assert not np.any(np.asarray(_get(grads[0], path))), what


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """Six steps of training on a fixed batch from the tiny parameters (the tiny run's
    optimizer: lr 1e-2, 2 warm-up steps), with an orbax checkpoint after the third:
    ``(model, optimizer, metrics, checkpoint manager, batch, optimizer transformation)``."""
    cfg, tp = tiny
    tx = training.AdamW(**TINY_RUN.optim.to_dict(), total_steps=TINY_RUN.steps)
    m, opt = _fresh(cfg, tp, tx)
    batch = _tokens(cfg, (TINY_RUN.batch_size, TINY_RUN.seq_len + 1), seed=5)
    mgr = ocp.CheckpointManager(tmp_path_factory.mktemp("orbax"))
    metrics = []
    for step in range(6):
        metrics.append(training.train_step(m, opt, batch, distill_weight=TINY_RUN.distill_weight,
                                           bias_rate=TINY_RUN.bias_rate))
        if step == 2:
            mgr.save(3, args=ocp.args.StandardSave(training.checkpoint_state(m, opt)))
            mgr.wait_until_finished()
    return m, opt, metrics, mgr, batch, tx


def _fresh(cfg, tp, tx):
    m = training.TrainModel(tp, cfg)
    return m, training.make_optimizer(m, tx)


def test_overfits_a_fixed_batch(tiny, trained):
    """Six AdamW steps on one batch (lr 1e-2 after a 2-step warm-up, cosine to 1e-3) take
    the LM loss from ~ln(512) to less than half of it; the distillation loss falls too, and
    the router biases moved (by the balancing rule, +-1e-3 per step). The parameters carry
    the sharding schema's logical axes."""
    m, _, metrics, _, _, _ = trained
    lm = [float(x["lm"]) for x in metrics]
    assert lm[0] > 6.0 and lm[-1] < 0.5 * lm[0], lm
    assert float(metrics[-1]["distill"]) < float(metrics[0]["distill"])
    moved = np.abs(np.asarray(m.router_bias[0].get_value())
                   - np.asarray(tiny[1]["layers"][0]["ffn"]["gate"]["bias"]))
    assert moved.max() > 0 and moved.max() <= 6e-3 + 1e-6
    p = m.params["layers"][2]["ffn"]["experts"]["w1"]["weight"]
    assert p.get_metadata()["logical_axes"] == ("experts", None, None)
    assert m.params["head"]["weight"].get_metadata()["logical_axes"] == ("vocab", "embed")


def test_resume_from_orbax_is_bit_exact(tiny, trained):
    """A fresh model and optimizer restored from the step-3 orbax checkpoint and trained on
    the same batches (the same optimizer: the compiled step is reused) reach bitwise the
    parameters, moments, step and biases of the run that never stopped."""
    cfg, tp = tiny
    m1, o1, _, mgr, batch, tx = trained
    m2, o2 = _fresh(cfg, tp, tx)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, training.checkpoint_state(m2, o2))
    training.restore_state(m2, o2, mgr.restore(3, args=ocp.args.StandardRestore(abstract)))
    for _ in range(3):
        training.train_step(m2, o2, batch, distill_weight=TINY_RUN.distill_weight,
                            bias_rate=TINY_RUN.bias_rate)
    a = jax.tree.leaves(training.checkpoint_state(m1, o1))
    b = jax.tree.leaves(training.checkpoint_state(m2, o2))
    assert len(a) == len(b) > 100
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_export_goes_through_the_reference_loader(tiny, trained):
    """The trained parameters exported in the reference format pass the loader's layout
    checks, and the FP8 / FP4 weights it reads are the trained ones to within their formats'
    rounding (e4m3: 2^-4 relative, e2m1: 1/4 of a block's scale step)."""
    cfg, _ = tiny
    m = trained[0]
    tp = m.tree()
    flat = training.export_tensors(tp, cfg)
    params = checkpoint.params_from_tensors(flat, cfg, identity_token_map(cfg.vocab_size))
    back = training.train_params_from(params)
    for path, tol in ((("layers", 1, "attn", "wq_a", "weight"), 0.07),
                      (("layers", 2, "ffn", "experts", "w1", "weight"), 0.2),
                      (("layers", 5, "attn", "wo_a", "weight"), 0.07),
                      (("layers", 1, "engram", "embed", "weight"), 0.07),
                      (("head", "weight"), 0.005)):
        assert _rel(_get(back, path), _get(tp, path)) < tol, path
    np.testing.assert_array_equal(np.asarray(back["layers"][0]["ffn"]["gate"]["bias"]),
                                  np.asarray(tp["layers"][0]["ffn"]["gate"]["bias"]))


def test_train_script_smoke_and_resume(tmp_path):
    """scripts/train.py on the tiny run config (6 steps on random tokens of the tiny
    vocabulary): history, validation losses, loss curve, orbax checkpoints, a reference-format
    export that the loader reads (summary: its validation loss under the inference numerics
    within 0.5 nats of the training-time one: FP8 / FP4 on a 6-step model); then the step-6
    checkpoint removed and the run restarted: it resumes at step 3 and exports bit for bit
    the same checkpoint."""
    train = _script("train")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(3, 512, 4000).astype(np.uint32).tofile(data / "train.bin")
    rng.integers(3, 512, 500).astype(np.uint32).tofile(data / "val.bin")
    c = TINY_RUN.copy_and_resolve_references()
    c.data, c.out = str(data), str(tmp_path / "out")
    c.quantised_eval = False
    s = train.run(c)
    hist = json.load(open(tmp_path / "out" / "history.json"))
    assert [r["step"] for r in hist["val"]] == [3, 6]
    assert len(hist["train"]) == 6 and s["train_loss"] == hist["train"][-1]["lm"]
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    ck = tmp_path / "out" / "checkpoint"
    cfg, _ = tiny_config()
    loaded_cfg, params = checkpoint.load_params(str(ck), tokenizer_map=identity_token_map(512))
    assert loaded_cfg == cfg and params["layers"][2]["ffn"]["experts"]["w1"]["weight"].dtype \
        == np.uint8
    first = (ck / "model.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "out" / "orbax" / "6")
    s2 = train.run(c)
    assert (ck / "model.safetensors").read_bytes() == first
    assert s2["val_loss"] == s["val_loss"]


def test_demo_config_keeps_the_release_layout_in_25_mb():
    """configs/demo.json: every layer role (SWA-only, ratio-2 Full + Reuse, ratio-1 Full with
    the candidate pool, Reuse, Reindex over the pool), Engram on two layers, the real
    vocabulary and tokenizer map, and at most 25 MB in the reference format."""
    from dsv41_jax.config import ModelConfig
    cfg = ModelConfig.from_json(os.path.join(ROOT, "configs", "demo.json"))
    roles = LayerPlan.from_config(cfg).roles
    kinds = {(r.mode, r.ratio, r.is_candidate_source, r.uses_candidates) for r in roles}
    assert kinds >= {("swa", 0, False, False), ("full", 2, False, False),
                     ("reuse", 2, False, False), ("full", 1, True, False),
                     ("reuse", 1, False, False), ("reindex", 1, False, True)}
    assert len(cfg.engram_layer_ids) == 2 and cfg.vocab_size == 129280
    assert cfg.engram_compressed_vocab_size == 99092
    size = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1}
    stored = sum(int(np.prod(shape)) * size[dts[0]]
                 for shape, dts in checkpoint.expected_tensors(cfg).values())
    assert stored <= 25e6, stored


def test_prepare_data_splits_by_document():
    """scripts/prepare_data.py: the split is by whole documents, disjoint, covering all,
    reproducible with the seed; the unigram cross entropy is that of the smoothed counts; a
    split of one document or a fraction outside (0, 1) is refused."""
    prep = _script("prepare_data")
    names = [f"doc{i}" for i in range(43)]
    train, val = prep.split_documents(names, 0.1, 0)
    assert len(val) == 4 and not set(train) & set(val) and sorted(train + val) == sorted(names)
    assert prep.split_documents(names, 0.1, 0) == (train, val)
    assert prep.split_documents(names, 0.1, 1) != (train, val)
    h = prep.unigram_entropy(np.array([0, 0, 1]), np.array([0, 1]), 3)
    assert h == pytest.approx(-(np.log(3 / 6) + np.log(2 / 6)) / 2)
    for bad in ((["a"], 0.1), (names, 0.0), (names, 1.0)):
        with pytest.raises(ValueError):
            prep.split_documents(*bad, 0)
