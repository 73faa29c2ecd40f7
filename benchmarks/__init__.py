"""Benchmarks of the model and its kernels, as importable functions with thin command lines.

* :mod:`benchmarks.kernels`: the Pallas kernels against the XLA path at the release dimensions
  (``dsv41-bench-kernels``);
* :mod:`benchmarks.prefill`: CED against exact prefill on a 40-layer config
  (``dsv41-bench-prefill``);
* :mod:`benchmarks.ced_vs_exact`: the logit distance of CED's bounded replay from exact prefill;
* :mod:`benchmarks.config`: the benchmark model configs;
* :mod:`benchmarks.timing`: timing, profiler-trace device time, roofline, JSON output;
* :mod:`benchmarks.plot`: figures from the JSON results.
"""
