"""Fixture parity: ``dsv41-parity`` (:mod:`dsv41_jax.cli.parity`)."""

import sys

from dsv41_jax.cli.parity import main

if __name__ == "__main__":
    sys.exit(main())
