"""The span-corruption family (R8, T5-style), one folder: ``config.py`` (the ``[span]``
section and row shape), ``compiler.py`` (corruption to encoder-decoder rows),
``render.py`` (its ``inspect`` view) and ``family.py`` (the glue). Its oracle lives with
its tests.
"""
