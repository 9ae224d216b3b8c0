"""Benchmarks: run each as `python -m benchmarks.<name>`."""
