"""The masked-LM family (R8), one folder: ``config.py`` (the ``[mlm]`` section),
``compiler.py`` (selection and corruption to rows) and ``family.py`` (the glue: the
encoder, manifest section, held-out figures). Its oracle lives with its tests.
"""
