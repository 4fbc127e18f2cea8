"""Benchmark harness for mlx-engine: ``python -m bench.run [--quick]``.

Measures the engine's decoding modes against mlx-lm (plain and speculative)
on the same weights in the same process, and writes markdown, JSON, a chart and
``docs/benchmarks.md``.
"""
