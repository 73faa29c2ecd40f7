"""dsv41-jax: DeepSeek-V4.1-Flash in JAX (CED prefill, CSA2 attention, packed FP4/FP8 state).

Numerics note: XLA may keep bf16 intermediates in fp32 inside a fusion
(``--xla_allow_excess_precision``, on by default), which silently skips the reference's bf16
roundings (measured: 8.6e-4 error in the mHC coefficients of layer 0 of ``tiny-a-bf16``).
Importing this package turns that off through ``XLA_FLAGS`` unless the caller set the flag;
import ``dsv41_jax`` before JAX initialises its backends.
"""

import os as _os

if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "")
                                + " --xla_allow_excess_precision=false").strip()

from dsv41_jax.config import LayerPlan, LayerRole, ModelConfig  # noqa: E402
from dsv41_jax.checkpoint import load_params, params_from_tensors, read_checkpoint  # noqa: E402
from dsv41_jax.state import init_state, global_kv_bytes_per_token  # noqa: E402
from dsv41_jax.model import forward, prefill, decode_step  # noqa: E402
from dsv41_jax.sampling import sample  # noqa: E402

__all__ = ["ModelConfig", "LayerPlan", "LayerRole", "load_params", "params_from_tensors",
           "read_checkpoint", "init_state", "global_kv_bytes_per_token", "forward", "prefill",
           "decode_step", "sample"]
