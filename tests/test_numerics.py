"""Numerics the package's XLA flags guarantee on CPU (see ``dsv41_jax/__init__.py``).

A row's result must not depend on the rows batched with it or on right padding: XLA:CPU's
YNNPACK library fusions broke that (logits of a padded batch of two differed from each row run
alone by 0.1-0.7 at every position), so the package turns them off; and on x86 hosts without
AVX-512 XLA's own GEMMs broke it in the last bits, so there YNNPACK takes the dots alone.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import dsv41_jax
from dsv41_jax import checkpoint, model, state as st
from dsv41_jax.config import ModelConfig
from dsv41_jax.random_weights import random_tensors

PROMPT_LEN = 13
BUCKET = 64


def _bf16_cfg() -> ModelConfig:
    """bf16 weights, no expert quantisation, window 12, KV sources 1/3/5 (ratio 2, 2, 1: the
    last is the candidate source), 6 experts top-2, no SwiGLU clamp, route scale 1, no YaRN,
    no Engram; small dims so that it runs in seconds on CPU."""
    return ModelConfig.from_dict(dict(
        vocab_size=512, dim=64, moe_inter_dim=32, n_layers=7, n_mtp_layers=0, n_heads=4,
        n_routed_experts=6, n_activated_experts=2, route_scale=1.0, swiglu_limit=0.0,
        q_lora_rank=32, head_dim=64, rope_head_dim=32, o_groups=2, o_lora_rank=32,
        window_size=12, compress_ratios=[0, 2, 2, 2, 2, 1, 1], kv_source_layers=[1, 3, 5],
        index_source_layers=[1, 3, 5], original_seq_len=0, index_n_heads=4, index_head_dim=32,
        index_topk=4, candidate_source_layer=5, candidate_topk_blocks=3, candidate_block_size=2,
        dtype="bf16", expert_dtype=None))


def test_import_sets_the_numerics_flags():
    flags = os.environ.get("XLA_FLAGS", "").split()
    assert "--xla_allow_excess_precision=false" in flags
    assert set(dsv41_jax.NUMERICS_FLAGS) == {"xla_allow_excess_precision",
                                             "xla_cpu_experimental_ynn_fusion_type"}
    value = dsv41_jax.NUMERICS_FLAGS["xla_cpu_experimental_ynn_fusion_type"]
    assert value in ("", "individual_dot")
    assert f"--xla_cpu_experimental_ynn_fusion_type={value}" in flags


def test_cpu_library_fusion_by_host():
    """YNNPACK takes the dots alone on x86 without AVX-512, nothing elsewhere."""
    avx2 = "fpu sse sse2 avx fma avx2 bmi2"
    assert dsv41_jax.cpu_library_fusion(avx2, "x86_64") == "individual_dot"
    assert dsv41_jax.cpu_library_fusion(avx2 + " avx512f avx512bw", "x86_64") == ""
    assert dsv41_jax.cpu_library_fusion(avx2 + " avx512fp16", "x86_64") == "individual_dot"
    assert dsv41_jax.cpu_library_fusion("", "aarch64") == ""
    assert dsv41_jax.cpu_library_fusion("fp asimd", "arm64") == ""


def test_import_keeps_the_callers_flags():
    """A flag the caller set in ``XLA_FLAGS`` is left as it is; the other one is added."""
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_experimental_ynn_fusion_type=+dot")
    out = subprocess.run(
        [sys.executable, "-c", "import os, dsv41_jax; print(os.environ['XLA_FLAGS'])"],
        env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["--xla_cpu_experimental_ynn_fusion_type=+dot",
                   "--xla_allow_excess_precision=false"]


@pytest.fixture(scope="module")
def bf16_model():
    cfg = _bf16_cfg()
    return cfg, checkpoint.params_from_tensors(random_tensors(cfg, 0), cfg)


def test_padded_batch_equals_each_row_alone(bf16_model):
    """Two 13-token prompts right-padded to 64 in one exact prefill: every position's logits
    equal those of the row prefilled alone, bitwise."""
    cfg, params = bf16_model
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, (2, PROMPT_LEN))
    prompts[:, 0] = 0                                               # BOS
    tokens = np.zeros((2, BUCKET), np.int64)
    tokens[:, :PROMPT_LEN] = prompts
    out, _ = model.prefill(params, cfg, tokens, st.init_state(cfg, 2, BUCKET + 16),
                           np.full(2, PROMPT_LEN), mode="exact", all_logits=True)
    batched = np.asarray(out.all_logits)[:, :PROMPT_LEN]
    for row in range(2):
        alone, _ = model.prefill(params, cfg, prompts[row:row + 1],
                                 st.init_state(cfg, 1, BUCKET + 16), mode="exact",
                                 all_logits=True)
        alone = np.asarray(alone.all_logits)[0]
        assert np.isfinite(alone).all() and np.abs(alone).max() > 0.1
        diff = np.abs(batched[row] - alone).max(-1)
        assert (batched[row].view(np.uint32) == alone.view(np.uint32)).all(), (
            f"row {row}: max |diff| per position {np.round(diff, 4).tolist()}")
    assert not np.array_equal(batched[0], batched[1])               # two different prompts
