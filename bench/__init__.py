"""Benchmarks run on GPUs: ``python -m bench.<tool>`` from the repository root (bench/README.md)."""
