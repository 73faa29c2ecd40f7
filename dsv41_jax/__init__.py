"""dsv41-jax: DeepSeek-V4.1-Flash in JAX (CED prefill, CSA2 attention, packed FP4/FP8 state).

Numerics: the model reproduces the reference's bf16 roundings, so importing this package sets
two XLA flags through ``XLA_FLAGS`` (each only if the caller has not set it; import
``dsv41_jax`` before JAX initialises its backends):

* ``--xla_allow_excess_precision=false``: otherwise XLA may keep bf16 intermediates in fp32
  inside a fusion and skip roundings the reference performs (8.6e-4 in the mHC coefficients
  of layer 0 of ``tiny-a-bf16``).
* ``--xla_cpu_experimental_ynn_fusion_type=`` (empty: no YNNPACK library fusions on CPU):
  those fusions drop explicit bf16 roundings even with excess precision off (the indexer's
  ``bf16(sum_h f32(bf16(relu(dot) * w_h)))``; docs/architecture.md, "Indexer") and make a row's
  result depend on the rest of its batch (a right-padded batch no longer equals each row run
  alone, by up to 0.6 in the logits of a bf16 model). GPU and TPU do not use them.

``tests/test_numerics.py`` and ``tests/test_config_quant.py`` check both properties.
"""

import os as _os

#: XLA flags this package sets unless ``XLA_FLAGS`` already names them (see above).
NUMERICS_FLAGS = {"xla_allow_excess_precision": "false",
                  "xla_cpu_experimental_ynn_fusion_type": ""}

for _name, _value in NUMERICS_FLAGS.items():
    if _name not in _os.environ.get("XLA_FLAGS", ""):
        _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "")
                                    + f" --{_name}={_value}").strip()
del _name, _value

from dsv41_jax.config import LayerPlan, LayerRole, ModelConfig  # noqa: E402
from dsv41_jax.checkpoint import load_params, params_from_tensors, read_checkpoint  # noqa: E402
from dsv41_jax.state import init_state, global_kv_bytes_per_token  # noqa: E402
from dsv41_jax.model import forward, prefill, decode_step, prepare_params  # noqa: E402
from dsv41_jax.sampling import SamplingParams, sample  # noqa: E402
from dsv41_jax.generation import GenerationResult, generate  # noqa: E402

__all__ = ["ModelConfig", "LayerPlan", "LayerRole", "load_params", "params_from_tensors",
           "read_checkpoint", "init_state", "global_kv_bytes_per_token", "forward", "prefill",
           "decode_step", "prepare_params", "sample", "SamplingParams", "generate",
           "GenerationResult"]
