"""Memory plan of a config (:mod:`dsv41_jax.memory_plan`): weights by kind, the inference
state, a prefill chunk's activations, per device, and whether it fits.

    python scripts/plan_memory.py --config configs/flash.json --batch 8 --context 131072 \
        --devices 8 --engram host --device-gb 141 [--json]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41_jax.memory_plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
