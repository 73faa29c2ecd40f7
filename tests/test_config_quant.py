"""Release config, layer roles, config validation, the nested HF layout, and the FP8 / FP4
quantisers (docs/architecture.md, "Configuration", "Layer schedule" and "Number formats").
Fast: no model is compiled."""

from __future__ import annotations

import copy
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from dsv41_jax import quant
from dsv41_jax.config import LayerPlan, ModelConfig

FLASH_JSON = os.path.join(os.path.dirname(__file__), "..", "configs", "flash.json")
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def flash_dict() -> dict:
    with open(FLASH_JSON) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- release config

# The released inference/config.json, all 64 keys with their verbatim values
# (docs/architecture.md, "Configuration").
RELEASE = dict(
    vocab_size=129280, dim=5120, moe_inter_dim=2304, n_layers=40, n_mtp_layers=3,
    dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=[37, 38, 39],
    dspark_markov_rank=256, dspark_n_routed_experts=128, dspark_n_activated_experts=3,
    n_heads=64, n_routed_experts=384, n_shared_experts=1, n_activated_experts=6,
    score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0, q_lora_rank=1280,
    head_dim=512, rope_head_dim=64, norm_eps=1e-20, o_groups=8, o_lora_rank=1024,
    window_size=128, kv_source_layers=[2, 8, 14, 20],
    index_source_layers=[2, 8, 14, 20, 24, 28, 32, 36], original_seq_len=65536,
    rope_theta=10000, rope_factor=16, beta_fast=32, beta_slow=1, index_n_heads=32,
    index_head_dim=128, index_topk=512, candidate_source_layer=20, candidate_topk_blocks=2048,
    candidate_block_size=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    engram_layer_ids=[1, 14], engram_vocab_size=16000000,
    engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4, engram_pad_id=2,
    engram_compressed_vocab_size=99092, dtype="fp8", expert_dtype="fp4",
    compress_rope_theta=160000, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    vision_n_layers=32, vision_dim=1024, vision_n_heads=16, vision_inter_dim=2816,
    vision_patch_size=14, vision_downsample_ratio=3, vision_max_n_token=1024,
    vision_min_pixels=295936, vision_max_wh_ratio=None, image_token_id=129264,
    engram_n_heads=8, engram_head_dim=256, vision_rope_theta=10000,
)


def test_release_config_has_the_64_keys(flash_dict):
    assert len(RELEASE) == 64
    assert len(flash_dict) == 64
    assert set(flash_dict) == set(RELEASE)
    for k, v in RELEASE.items():
        assert flash_dict[k] == v, f"configs/flash.json {k} = {flash_dict[k]!r}, release {v!r}"
    cfg = ModelConfig.from_json(FLASH_JSON)
    got = cfg.to_dict()
    for k, v in RELEASE.items():
        assert got[k] == v, f"ModelConfig.{k} = {got[k]!r}, expected {v!r}"
    # the five keys absent from the file take the ModelArgs defaults
    # (docs/architecture.md, "Configuration")
    assert (cfg.gate_temp, cfg.norm_topk_prob, cfg.temperature, cfg.max_batch_size,
            cfg.max_seq_len) == (1.0, True, 1.0, 4, 4096)
    assert len(cfg.compress_ratios) == 43 and cfg.n_all_layers == 43


def test_release_layer_plan():
    """The release layer table (docs/architecture.md, "Layer schedule"): SWA 0, 1; Full 2, 8, 14
    (ratio 2) and 20 (ratio 1); Reindex 24, 28, 32, 36; everything else Reuse; candidates from 20
    used by 24..36; decoder from 20; Engram 1, 14; KV groups 2->2..7, 8->8..13, 14->14..19,
    20->20..39 and the index groups."""
    cfg = ModelConfig.from_json(FLASH_JSON)
    plan = LayerPlan.from_config(cfg)
    assert len(plan) == 40
    modes = {i: plan[i].mode for i in range(40)}
    assert {i for i, m in modes.items() if m == "swa"} == {0, 1}
    assert {i for i, m in modes.items() if m == "full"} == {2, 8, 14, 20}
    assert {i for i, m in modes.items() if m == "reindex"} == {24, 28, 32, 36}
    assert {i for i, m in modes.items() if m == "reuse"} == \
        set(range(40)) - {0, 1, 2, 8, 14, 20, 24, 28, 32, 36}
    assert [plan[i].ratio for i in (2, 8, 14, 20)] == [2, 2, 2, 1]
    assert all(plan[i].ratio == 2 for i in range(2, 20))
    assert all(plan[i].ratio == 1 for i in range(20, 40))
    assert plan.kv_sources == (2, 8, 14, 20)
    assert {i for i in range(40) if plan[i].owns_index} == {2, 8, 14, 20, 24, 28, 32, 36}
    assert {i for i in range(40) if plan[i].uses_candidates} == {24, 28, 32, 36}
    assert {i for i in range(40) if plan[i].is_candidate_source} == {20}
    assert plan.decoder_start == 20
    assert [i for i in range(40) if plan[i].is_decoder] == list(range(20, 40))
    assert {i for i in range(40) if plan[i].engram} == {1, 14}
    kv_group = {**{i: 2 for i in range(2, 8)}, **{i: 8 for i in range(8, 14)},
                **{i: 14 for i in range(14, 20)}, **{i: 20 for i in range(20, 40)}}
    idx_group = {**kv_group, **{i: 20 for i in range(20, 24)},
                 **{i: 24 + 4 * ((i - 24) // 4) for i in range(24, 40)}}
    for i in range(40):
        assert plan[i].kv_layer == kv_group.get(i, -1), f"layer {i} kv_layer"
        assert plan[i].index_layer == idx_group.get(i, -1), f"layer {i} index_layer"
        assert plan[i].rope == ("base" if i < 2 else "compress"), f"layer {i} rope"


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("change, match", [
    (dict(candidate_topk_blocks=63), r"cannot hold index_topk=512"),      # 63 x 8 = 504 < 512
    (dict(kv_source_layers=[8, 14, 20]), r"layer 2 has compress_ratio 2 but no KV source"),
    (dict(n_shared_experts=2), r"n_shared_experts must be 1"),
    (dict(kv_source_layers=[2, 8, 14, 21]), r"layer 20 \(ratio 1\) reads KV source 14"),
    (dict(index_source_layers=[8, 14, 20]), r"layer 2 .* no index source"),
    (dict(candidate_source_layer=24), r"candidate_source_layer 24 must be a KV and index"),
    (dict(compress_ratios=[0, 0] + [2] * 18), r"compress_ratios has 20 entries"),
    (dict(compress_ratios=[0, 0, 3] + [2] * 17 + [1] * 20 + [0, 0, 0]), r"supported ratio"),
    (dict(head_dim=496), r"head_dim=496 must be a multiple of 32"),
    (dict(window_size=0), r"window_size must be > 0"),
    (dict(score_func="relu"), r"score_func 'relu'"),
    (dict(dtype="fp16"), r"dtype must be 'fp8' or 'bf16'"),
    (dict(engram_num_embeddings=[384006168]), r"engram_num_embeddings"),
])
def test_invalid_configs_raise(flash_dict, change, match):
    d = dict(flash_dict, **change)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(d)


def test_misspelt_key_names_the_closest_known_key(flash_dict, tmp_path):
    """A key the config does not have is refused (not ignored), naming the closest known key;
    from a file, the message starts with its path."""
    d = dict(flash_dict)
    d["windw_size"] = d.pop("window_size")
    with pytest.raises(ValueError, match=r"unknown config key 'windw_size'.*'window_size'"):
        ModelConfig.from_dict(d)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"cfg\.json: unknown config key 'windw_size'"):
        ModelConfig.from_json(path)
    with pytest.raises(ValueError, match=r"unknown config key 'zzz' in the config$"):
        ModelConfig.from_dict(dict(flash_dict, zzz=1))   # nothing close: no suggestion


@pytest.mark.parametrize("key,value,match", [
    ("dim", "big", r"'dim' must be an integer, got 'big'"),
    ("window_size", None, r"'window_size' must be an integer, got None"),
    ("window_size", "16", r"'window_size' must be an integer, got '16'"),
    ("n_layers", 2.5, r"'n_layers' must be an integer, got 2.5"),
    ("norm_topk_prob", 1, r"'norm_topk_prob' must be true or false"),
    ("compress_ratios", "abc", r"'compress_ratios' must be a list of integers"),
    ("kv_source_layers", [2, 8.5], r"'kv_source_layers' must be a list of integers"),
    ("score_func", 3, r"'score_func' must be a string"),
])
def test_wrong_value_types_are_refused(flash_dict, key, value, match):
    """A value of the wrong JSON type is a ValueError naming the key, not a TypeError later."""
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(dict(flash_dict, **{key: value}))


def test_config_file_errors_name_the_file(tmp_path):
    """Broken JSON and a JSON list are ValueErrors that start with the file's path."""
    bad = tmp_path / "broken.json"
    bad.write_text('{"dim": 2048,, }')
    with pytest.raises(ValueError, match=r"broken\.json: "):
        ModelConfig.from_json(bad)
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"list\.json: a config must be a JSON object"):
        ModelConfig.from_json(lst)


def test_metadata_keys_are_accepted(flash_dict):
    """Hugging Face bookkeeping keys are accepted and change nothing."""
    meta = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
                torch_dtype="bfloat16", transformers_version="4.57.0", auto_map={},
                quantization_config={"quant_method": "fp8"})
    assert ModelConfig.from_dict(dict(flash_dict, **meta)) == ModelConfig.from_dict(flash_dict)


@pytest.mark.parametrize("name", ["flash.json", "small.json"])
def test_repository_configs_load(name):
    cfg = ModelConfig.from_json(os.path.join(os.path.dirname(FLASH_JSON), name))
    assert cfg.n_layers > 0


@pytest.mark.parametrize("name", ["tiny-a", "tiny-a-bf16", "tiny-engram", "tiny-vl"])
def test_fixture_configs_load(name):
    from conftest import fixture_dir
    cfg = ModelConfig.from_json(os.path.join(fixture_dir(name), "config.json"))
    assert cfg.n_layers > 0


def test_candidate_pool_exactly_large_enough_is_valid(flash_dict):
    cfg = ModelConfig.from_dict(dict(flash_dict, candidate_topk_blocks=64))   # 64 x 8 = 512
    assert cfg.candidate_topk_blocks == 64


def test_replace_validates():
    cfg = ModelConfig.from_json(FLASH_JSON)
    with pytest.raises(ValueError, match="n_shared_experts"):
        cfg.replace(n_shared_experts=2)


# ----------------------------------------------------------------------------- nested HF layout

_TO_HF = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id", "engram_pad_id": "engram_pad_token_id",
    "n_mtp_layers": "num_nextn_predict_layers", "norm_eps": "rms_norm_eps",
    "route_scale": "routed_scaling_factor", "score_func": "scoring_func",
    "n_activated_experts": "num_experts_per_tok",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size",
}


def _hf_layout(flat: dict) -> dict:
    """The release config in the nested Hugging Face layout (docs/architecture.md,
    "Configuration")."""
    text, vision = {}, {}
    rope_keys = ("rope_factor", "original_seq_len", "beta_fast", "beta_slow")
    for k, v in flat.items():
        if k in rope_keys or k in ("dtype", "expert_dtype"):
            continue
        if k.startswith("vision_"):
            vision[k] = v
        else:
            text[_TO_HF.get(k, k)] = v
    text["rope_scaling"] = {"type": "yarn", "factor": flat["rope_factor"],
                            "original_max_position_embeddings": flat["original_seq_len"],
                            "beta_fast": flat["beta_fast"], "beta_slow": flat["beta_slow"]}
    text.update(topk_method="noaux_tc", norm_topk_prob=True, max_position_embeddings=1048576)
    return {"architectures": ["DeepseekV4ForCausalLM"], "dtype": "bfloat16",
            "text_config": text, "vision_config": vision,
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                    "scale_fmt": "ue8m0", "expert_dtype": "fp4"}}


def test_nested_hf_layout_gives_the_same_config(flash_dict):
    hf = _hf_layout(flash_dict)
    for name in ("hidden_size", "num_hidden_layers", "kv_source_layer_ids",
                 "index_source_layer_ids", "num_experts_per_tok", "rope_scaling"):
        assert name in hf["text_config"]
    assert "dim" not in hf["text_config"] and "rope_factor" not in hf["text_config"]
    a = ModelConfig.from_dict(copy.deepcopy(hf)).to_dict()
    b = ModelConfig.from_json(FLASH_JSON).to_dict()
    diff = {k: (a[k], b[k]) for k in b if a[k] != b[k]}
    assert not diff, f"nested HF layout differs from the flat config: {diff}"
    # the top-level "dtype: bfloat16" is the storage dtype, not "unquantised"
    assert a["dtype"] == "fp8" and a["expert_dtype"] == "fp4"


@pytest.mark.parametrize("where, key, match", [
    ("top", "text_confg", r"'text_confg' in the top level \(did you mean 'text_config'\?\)"),
    ("text", "hiden_size", r"'hiden_size' in text_config \(did you mean 'hidden_size'\?\)"),
    ("vision", "patch_sise", r"'vision_patch_sise' in vision_config .*'vision_patch_size'"),
])
def test_nested_hf_layout_refuses_unknown_keys(flash_dict, where, key, match):
    hf = _hf_layout(flash_dict)
    part = {"top": hf, "text": hf["text_config"], "vision": hf["vision_config"]}[where]
    part[key] = 1
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(hf)


# ----------------------------------------------------------------------------- e2m1


def _qdq(x, block, fmt):
    return np.asarray(quant.fp4_qdq(jnp.asarray(np.asarray(x, BF16)), block, fmt), np.float32)


@pytest.mark.parametrize("block, fmt", [(32, "e8m0"), (16, "e4m3")])
def test_e2m1_ties_and_signed_zero(block, fmt):
    """A block holding 6.0 has scale exactly 1 in both formats, so values land on the e2m1 grid
    unscaled: ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (to the even code),
    the same mirrored for negatives with the sign kept on zero; -0.0 stays -0.0."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    near = [0.26, 0.74, 1.26, 1.74, 2.52, 3.48, 5.04]
    near_want = [0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 6.0]
    vals = [6.0, -0.0, 0.0] + ties + [-t for t in ties] + near
    x = np.zeros((len(vals), block), np.float32)   # one block per value: [v, 6, 0, ...]
    x[:, 0] = vals
    x[:, 1] = 6.0                                  # amax 6 -> scale exactly 1
    xq = jnp.asarray(np.asarray(x, BF16))
    y = _qdq(x, block, fmt)[:, 0]
    xb = np.asarray(x, BF16).astype(np.float32)[:, 0]   # the bf16 inputs the quantiser sees
    nt = len(ties)
    assert y[0] == 6.0
    assert y[1] == 0.0 and np.signbit(y[1]), "negative zero lost its sign"
    assert y[2] == 0.0 and not np.signbit(y[2])
    np.testing.assert_array_equal(y[3:3 + nt], want)
    np.testing.assert_array_equal(y[3 + nt:3 + 2 * nt], [-w for w in want])
    assert np.signbit(y[3 + nt]), "-0.25 must round to -0.0"
    np.testing.assert_array_equal(y[3 + 2 * nt:], near_want,
                                  err_msg=f"non-ties (bf16 inputs {xb[3 + 2 * nt:]})")
    # the codes themselves: magnitude index, sign in bit 3 (code 8 = -0)
    codes, scale = quant.fp4_quantize(xq, block, fmt)
    assert np.all(np.asarray(quant.fp4_scale_to_f32(scale)) == 1.0)
    codes = np.asarray(codes)[:, 0]
    assert codes[1] == 8 and codes[2] == 0 and codes[0] == 7
    np.testing.assert_array_equal(codes[3:3 + nt], [0, 2, 2, 4, 4, 6, 6])
    np.testing.assert_array_equal(codes[3 + nt:3 + 2 * nt], [8, 10, 10, 12, 12, 14, 14])


def test_e2m1_ties_with_an_e4m3_scale():
    """Ties must also go to the even code when the E4M3 scale is not a power of two: a block
    with amax 22.5 has s = e4m3(22.5 / 6) = 3.75 and x = 3.75 * t is an exact tie t (x/s is
    exact in fp32 for these bf16 values), so QDQ gives 3.75 * {0, 1, 1, 2, 2, 4, 4}."""
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    want = 3.75 * np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], np.float32)
    x = np.zeros((2 * len(ties), 16), np.float32)
    x[:len(ties), 0] = 3.75 * ties
    x[len(ties):, 0] = -3.75 * ties
    x[:, 1] = 22.5
    assert np.array_equal(np.asarray(x, BF16).astype(np.float32), x)
    assert np.all(x[:, 0] / np.float32(3.75) == np.concatenate([ties, -ties]))
    _, scale = quant.fp4_quantize(jnp.asarray(np.asarray(x, BF16)), 16, "e4m3")
    assert np.all(np.asarray(scale).astype(np.float32) == 3.75)
    y = _qdq(x, 16, "e4m3")[:, 0]
    np.testing.assert_array_equal(y, np.concatenate([want, -want]),
                                  err_msg="x = 3.75 * [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5] "
                                  "and its negation")


def test_pack_unpack_roundtrip():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (3, 5, 64)).astype(np.uint8)
    packed = np.asarray(quant.pack_nibbles(jnp.asarray(codes)))
    assert packed.shape == (3, 5, 32) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
    np.testing.assert_array_equal(np.asarray(quant.unpack_nibbles(jnp.asarray(packed))), codes)
    every_byte = np.arange(256, dtype=np.uint8).reshape(4, 64)
    np.testing.assert_array_equal(
        np.asarray(quant.pack_nibbles(quant.unpack_nibbles(jnp.asarray(every_byte)))), every_byte)
    # element 2j in the low nibble, 2j+1 in the high one (docs/architecture.md, "Number formats")
    assert int(quant.pack_nibbles(jnp.asarray(np.array([1, 2], np.uint8)))[0]) == 0x21


# ----------------------------------------------------------------------------- FP8


def _random_bf16(rng, shape, block) -> np.ndarray:
    """bf16 data over many magnitudes: per-block scales 10^U(-6, 4), some exact zeros,
    an all-zero block and a block below the amax floor."""
    x = rng.standard_normal(shape).astype(np.float32)
    xb = x.reshape(-1, block)
    xb *= (10.0 ** rng.uniform(-6, 4, (xb.shape[0], 1))).astype(np.float32)
    xb[rng.random(xb.shape) < 0.05] = 0.0
    xb[0] = 0.0
    xb[1] *= 0.0
    xb[1] -= 0.0           # -0.0 entries
    xb[2] = rng.standard_normal(block).astype(np.float32) * 1e-7
    return np.asarray(x, BF16)


def test_fp8_qdq_idempotent():
    rng = np.random.default_rng(1)
    x = jnp.asarray(_random_bf16(rng, (64, 256), 32))
    y = quant.act_quant_qdq(x, 32)
    z = quant.act_quant_qdq(y, 32)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(z).view(np.uint16), np.asarray(y).view(np.uint16))
    assert not np.array_equal(np.asarray(y), np.asarray(x)), "QDQ did nothing (test data too kind)"


def _np_pow2_ceil_exp(t: np.ndarray) -> np.ndarray:
    """Exponent of the smallest power of two >= t via the fp32 bits (docs/architecture.md,
    "Number formats")."""
    bits = np.asarray(t, np.float32).view(np.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)


def test_fp8_exact_powers_of_two_not_bumped():
    """amax = 448 * 2^k gives amax * f32(1/448) == 2^k exactly in fp32, so the scale is 2^k
    (byte 127 + k) and the block's amax is reproduced exactly; one bf16 ulp more bumps it to
    2^(k+1). The QDQ values of both kinds of block match the numpy reading of
    docs/architecture.md, "Number formats"."""
    ks = np.arange(-20, 8)
    assert np.all(np.float32(448.0) * np.exp2(ks).astype(np.float32) * np.float32(1 / 448)
                  == np.exp2(ks).astype(np.float32))
    x = np.zeros((len(ks) * 2, 32), np.float32)
    x[:len(ks), 0] = 448.0 * np.exp2(ks)
    x[len(ks):, 0] = 448.0 * np.exp2(ks) * (1 + 2.0 ** -7)     # next bf16 above
    x[:, 1] = -x[:, 0] / 3
    xb = np.asarray(x, BF16)
    codes, scale = quant.fp8_quantize(jnp.asarray(xb), 32)
    scale = np.asarray(scale)[:, 0].astype(np.int32)
    np.testing.assert_array_equal(scale[:len(ks)], 127 + ks)
    np.testing.assert_array_equal(scale[len(ks):], 128 + ks)
    y = np.asarray(quant.act_quant_qdq(jnp.asarray(xb), 32), np.float32)
    np.testing.assert_array_equal(y[:len(ks), 0], x[:len(ks), 0])
    np.testing.assert_array_equal(y, _np_act_quant_qdq(xb, 32).astype(np.float32))


def _np_act_quant_qdq(x: np.ndarray, block: int) -> np.ndarray:
    """act_quant (docs/architecture.md, "Number formats") in numpy: floor 1e-4, pow2-ceil
    scale, e4m3 RNE of the clamp."""
    xf = x.astype(np.float32).reshape(-1, block)
    amax = np.maximum(np.abs(xf).max(-1, keepdims=True), np.float32(1e-4))
    s = np.exp2(_np_pow2_ceil_exp(amax * np.float32(1 / 448))).astype(np.float32)
    q = np.clip(xf / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * s).reshape(x.shape).astype(BF16)


def test_fp8_qdq_matches_numpy_spec():
    rng = np.random.default_rng(2)
    x = _random_bf16(rng, (64, 256), 32)
    y = np.asarray(quant.act_quant_qdq(jnp.asarray(x), 32))
    np.testing.assert_array_equal(y.view(np.uint16), _np_act_quant_qdq(x, 32).view(np.uint16))


# ----------------------------------------------------------------------------- FP4 vs numpy

_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _np_e2m1_round(v: np.ndarray) -> np.ndarray:
    """Nearest e2m1 magnitude by distance, ties to the even code index; the sign (also of zero)
    is copied from ``v``."""
    a = np.abs(v)[..., None]
    d = np.abs(a - _GRID)
    best = d.min(-1, keepdims=True)
    cand = np.where(d == best, np.arange(8), 99)
    even = np.where(cand % 2 == 0, cand, 99).min(-1)
    idx = np.where(even < 99, even, cand.min(-1))
    return np.copysign(_GRID[idx], v).astype(np.float32)


def _np_fp4_qdq(x: np.ndarray, block: int, fmt: str) -> np.ndarray:
    """fp4_act_quant + dequantisation (docs/architecture.md, "Number formats") in numpy."""
    xf = x.astype(np.float32).reshape(-1, block)
    amax = np.abs(xf).max(-1, keepdims=True)
    if fmt == "e4m3":
        amax = np.maximum(amax, np.float32(6 * 2.0 ** -9))
        s = np.minimum(amax / np.float32(6), np.float32(448))          # satfinite
        s = s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)      # RNE
    else:
        amax = np.maximum(amax, np.float32(6 * 2.0 ** -126))
        s = np.exp2(_np_pow2_ceil_exp(amax * np.float32(1 / 6))).astype(np.float32)
    v = np.clip(xf / s, -6, 6)
    return (_np_e2m1_round(v) * s).reshape(x.shape).astype(BF16)


def _fp4_test_data(rng, block: int) -> np.ndarray:
    x = _random_bf16(rng, (128, 256), block).astype(np.float32)
    # blocks whose scale is exactly 0.5 (amax 3), filled with exact ties x/s on every boundary
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    xb = x.reshape(-1, block)
    for r in range(3, 40):
        vals = rng.choice(np.concatenate([ties, -ties, [0.0, -0.0, 6.0]]), block)
        vals[0] = 6.0
        xb[r] = vals * 0.5
    return np.asarray(x, BF16)


@pytest.mark.parametrize("block, fmt", [(16, "e4m3"), (32, "e8m0")])
def test_fp4_qdq_matches_numpy_spec(block, fmt):
    """FP4 QDQ (the E4M3-scale main-KV path and the E8M0 MXFP4 path) bit for bit against an
    independent numpy reading of docs/architecture.md, "Number formats" (nearest grid value by
    distance, ties to the even code), on random data over many magnitudes plus blocks of exact
    ties."""
    rng = np.random.default_rng(3 if fmt == "e4m3" else 4)
    x = _fp4_test_data(rng, block)
    got = np.asarray(quant.fp4_qdq(jnp.asarray(x), block, fmt))
    want = _np_fp4_qdq(x, block, fmt)
    bad = got.view(np.uint16) != want.view(np.uint16)
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} differ; first at {np.argwhere(bad)[0].tolist()}: "
        f"x={x[bad][0]}, got {got[bad][0]}, numpy {want[bad][0]}")
    # the stored E4M3 scales are amax / 6 rounded (not a power of two)
    if fmt == "e4m3":
        _, s = quant.fp4_quantize(jnp.asarray(x), block, fmt)
        s = np.asarray(s).astype(np.float32).reshape(-1)
        amax = np.maximum(np.abs(x.astype(np.float32)).reshape(-1, block).max(-1),
                          np.float32(6 * 2.0 ** -9))
        np.testing.assert_array_equal(
            s, np.minimum(amax / np.float32(6), np.float32(448))            # satfinite
            .astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_jit_keeps_the_spec_bf16_roundings():
    """The indexer's ``bf16(sum_h f32(bf16(relu(dot) * w_h)))`` jitted on CPU equals its eager
    value bit for bit (XLA:CPU's YNNPACK fusions, off through the package's XLA flags, drop the
    inner rounding: 41% of these outputs differ with them)."""
    def f(a, b):
        prod = (jnp.maximum(a, 0) * b).astype(jnp.bfloat16).astype(jnp.float32)
        return jnp.sum(prod, axis=1).astype(jnp.bfloat16)
    a = jax.random.normal(jax.random.PRNGKey(2), (4, 32, 300)).astype(jnp.bfloat16)
    a = a.astype(jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(3), (4, 32, 1))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(a, b), np.float32),
                                  np.asarray(f(a, b), np.float32))
