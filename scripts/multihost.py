"""Several JAX processes on one machine (:mod:`dsv41_jax.cli.multihost`): prefill and generate
with ``jax.distributed`` over every process's devices."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41_jax.cli.multihost import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
