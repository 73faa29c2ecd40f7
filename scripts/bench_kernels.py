"""The ``dsv41-bench-kernels`` command (:mod:`benchmarks.kernels`): time and check the kernels."""
import sys

from benchmarks.kernels import main

if __name__ == "__main__":
    sys.exit(main())
