"""Pallas kernels of dsv41-jax: CSA2 sparse attention, the lightning indexer's scores and top-k,
the FP4 codec, and the FP8 stacked GEMV of a decode step's linears.

A leaf package: it imports nothing from the model package. Each op package holds its shared
primitives (``common.py``), its pure-jnp references (``reference.py``), the kernels in their
own modules, and one dispatch (the package itself; :mod:`.sparse_attention.gpu` within the GPU
family) choosing the implementation from the kernel family ``impl`` (:mod:`.impls`). Every
kernel is tested against its reference in Pallas interpret mode on CPU and on real hardware
(the kernel benchmark's ``--check``).
"""
