"""Smoke tests (``exactstep smoke NAME``): every path of a device exercised once, each
check PASS / FAIL / SKIP, any FAIL a non-zero exit. Not benchmarks: their figures are
reported, but what they promise is that the paths run and agree (``make gpu-smoke``).
"""
