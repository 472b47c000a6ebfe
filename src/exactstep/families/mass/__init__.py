"""The MASS family (R9, Song et al. 2019), one folder: ``config.py`` (the ``[mass]``
section and row shape), ``compiler.py`` (a masked fragment to encoder-decoder rows),
``render.py`` (its ``inspect`` view) and ``family.py`` (the glue). Its oracle lives with
its tests.
"""
