"""Benchmarks run by ``exactstep bench NAME``; each prints ratios measured side by side."""
