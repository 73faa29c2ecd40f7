"""dsv41-jax: DeepSeek-V4.1-Flash in JAX (CED prefill, CSA2 attention, packed FP4/FP8 state).

Numerics: the model reproduces the reference's bf16 roundings, so importing this package sets
two XLA flags through ``XLA_FLAGS`` (each only if the caller has not set it; import
``dsv41_jax`` before JAX initialises its backends):

* ``--xla_allow_excess_precision=false``: otherwise XLA may keep bf16 intermediates in fp32
  inside a fusion and skip roundings the reference performs (8.6e-4 in the mHC coefficients
  of layer 0 of ``tiny-a-bf16``).
* ``--xla_cpu_experimental_ynn_fusion_type=``: which XLA:CPU operations YNNPACK may take
  (:func:`cpu_library_fusion` picks the value for the host). Its fusions of elementwise work
  drop explicit bf16 roundings (the indexer's ``bf16(sum_h f32(bf16(relu(dot) * w_h)))``;
  docs/architecture.md, "Indexer"), so they are never on. What is left is the GEMM: a row's
  result must not depend on the other rows of its batch, its padding or its chunk. On hosts
  with AVX-512 the value is empty (XLA's own GEMMs, which keep that); on x86 hosts without
  AVX-512 those GEMMs block their sums by the number of rows (the last bits of a padded
  batch's logits differ from each row run alone), and ``individual_dot`` hands each dot, and
  nothing else, to YNNPACK, whose GEMMs keep it from two rows up (bf16 operands in either
  layout, fp32 ones in the weights' ``[out, in]`` layout, which is the model's). GPU and TPU
  use neither.

``tests/test_numerics.py`` and ``tests/test_config_quant.py`` check both properties.
"""

import os as _os
import platform as _platform


def cpu_library_fusion(cpu_flags: str, machine: str) -> str:
    """The value of ``--xla_cpu_experimental_ynn_fusion_type`` for a host: ``"individual_dot"``
    on an x86 CPU without AVX-512 (``avx512f`` missing from ``cpu_flags``, the ``flags`` line
    of ``/proc/cpuinfo``; also where that file is missing, so the flags are unknown), else
    ``""`` (no YNNPACK fusion). ``machine``: ``platform.machine()``.
    See the module docstring and docs/architecture.md, "XLA flags"."""
    x86 = machine.lower() in ("x86_64", "amd64", "i686", "i386")
    return "individual_dot" if x86 and "avx512f" not in cpu_flags.split() else ""


def _host_cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1] for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


#: XLA flags this package sets unless ``XLA_FLAGS`` already names them (see above).
NUMERICS_FLAGS = {"xla_allow_excess_precision": "false",
                  "xla_cpu_experimental_ynn_fusion_type": cpu_library_fusion(
                      _host_cpu_flags(), _platform.machine())}

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
