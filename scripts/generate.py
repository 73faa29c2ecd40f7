"""Generate text (the ``dsv41-generate`` command: :mod:`dsv41_jax.cli.generate`)."""
import sys

from dsv41_jax.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
