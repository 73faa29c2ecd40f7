"""Plot benchmark results (:mod:`benchmarks.plot`)."""
import sys

from benchmarks.plot import main

if __name__ == "__main__":
    sys.exit(main())
