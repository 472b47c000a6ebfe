"""Benchmarks run by ``exactstep bench NAME``; each prints ratios measured side by side.

Every module here except the helper ``common`` is one benchmark, found by
``exactstep.cli.bench_names`` with ``pkgutil`` and imported as ``exactstep.bench.NAME``;
each builds its own inputs (random tensors, synthetic documents, small models), so an
installed wheel runs them with no test tree and no data files.
"""
