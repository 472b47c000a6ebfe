"""Scheduled sampling over a base family (R8), one folder: ``config.py`` (the
``[scheduled_sampling]`` section), ``inputs.py`` (the input program feeding the model's
own tokens) and ``family.py`` (the glue over the base family).
"""
