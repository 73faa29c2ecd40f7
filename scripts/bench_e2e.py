"""The ``dsv41-bench-e2e`` command (:mod:`benchmarks.e2e`): end-to-end prefill and decode."""
import sys

from benchmarks.e2e import main

if __name__ == "__main__":
    sys.exit(main())
