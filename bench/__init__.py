"""Benchmarks (not tests): each bench_*.py has main() and writes bench/results/<name>.md."""
