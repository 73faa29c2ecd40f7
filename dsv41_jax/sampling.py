"""Sampling: greedy at temperature 0, else the Gumbel-max form of softmax sampling.

See docs/architecture.md, "Norms, embedding and head".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def sample(logits: Float[Array, "B V"], temperature: float, key: jax.Array | None = None
           ) -> Int[Array, "B"]:
    """Next token per row: ``argmax`` at temperature 0, else ``argmax(probs / E)``, E ~ Exp(1).

    ``probs = softmax(logits / max(T, 1e-5))`` in fp32. Raises ``ValueError`` for T < 0 or a
    missing ``key`` when T > 0.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key")
    probs = jax.nn.softmax(logits.astype(jnp.float32) / max(temperature, 1e-5), axis=-1)
    e = jax.random.exponential(key, probs.shape, jnp.float32)
    return jnp.argmax(probs / e, axis=-1).astype(jnp.int32)
