"""The encoder-decoder family (R8), one folder: ``config.py`` (the ``[encdec]`` section),
``compiler.py`` (pairs to rows, and the pair data), ``reference.py`` (the pure-Python
oracle) and ``family.py`` (the glue: model, manifest section, greedy exact match).
"""
