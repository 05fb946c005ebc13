"""Benchmarks: each script prints a table and writes JSON (run from the repository root, `python -m bench.X`)."""
