"""Benchmarks: each prints its figures side by side with ratios and saves JSON under benches/results/."""
