"""Sequence-level policy training over a base family (R8, Q1-Q4), one folder:
``config.py`` (the ``[policy]`` section), ``rewards.py`` (declared rewards),
``reference.py`` (the pure-Python reference of one window's objective), the window
program (``rollouts.py``; ``clipped.py``, its clipped epochs; ``regressor.py``, MIXER's
learned baseline) over the generation stage's sampler, and ``family.py`` (the glue over
the base family). The window's S / D is the objective stage's (``objective.policy``).
"""
