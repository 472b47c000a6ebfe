"""Sequence-level policy training over a base family (R8, Q1-Q4), one folder:
``config.py`` (the ``[policy]`` section), ``rewards.py`` (declared rewards),
``reference.py`` (the pure-Python reference of one window's objective) and
``family.py`` (the glue over the base family). The rollout program is the generation
stage's (``generation.rollouts``), the window's S / D the objective stage's
(``objective.policy``).
"""
