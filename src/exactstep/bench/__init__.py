"""Benchmarks run by ``exactstep bench NAME``; each prints ratios measured side by side.

Every module here except the helper ``common`` is one benchmark, found without
importing it and runnable from an installed wheel (it builds its own inputs).
Design and derivations: docs/design/bench.md#bench__init__py.
"""
