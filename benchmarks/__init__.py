"""Benchmark scripts. Run as ``python -m benchmarks.<name>`` or ``python benchmarks/<name>.py``."""
