"""The ``dsv41-generate`` command (:mod:`dsv41_jax.cli.generate`): generate text."""
import sys

from dsv41_jax.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
