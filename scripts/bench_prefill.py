"""The ``dsv41-bench-prefill`` command (:mod:`benchmarks.prefill`): CED vs exact prefill."""
import sys

from benchmarks.prefill import main

if __name__ == "__main__":
    sys.exit(main())
