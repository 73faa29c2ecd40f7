"""Pallas kernels of dsv41-jax: CSA2 sparse attention and the FP4 codec (architecture 6).

Every kernel has a pure-jnp reference beside it and is tested against it in interpret mode on
CPU and on real hardware (``scripts/bench_kernels.py --check``).
"""
