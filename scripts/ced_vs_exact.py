"""CED vs exact prefill logits (:mod:`benchmarks.ced_vs_exact`)."""
import sys

from benchmarks.ced_vs_exact import main

if __name__ == "__main__":
    sys.exit(main())
