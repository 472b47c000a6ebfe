"""The permutation-LM family (R8), one folder: ``config.py`` (the ``[permutation]``
section), ``compiler.py`` (orders and two-stream rows), ``reference.py`` (the
pure-Python oracle) and ``family.py`` (the glue: two-stream model, manifest section).
"""
