"""Benchmarks (not tests): each script measures on the device it runs on and writes JSON with the
exact command, GPU and commit to ``bench/results/``."""
