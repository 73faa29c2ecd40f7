"""Dtype and matmul-precision constants shared by the model code (one definition each)."""

import jax
import jax.numpy as jnp

F32 = jnp.float32
BF16 = jnp.bfloat16
HIGHEST = jax.lax.Precision.HIGHEST
