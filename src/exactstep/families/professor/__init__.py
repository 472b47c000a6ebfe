"""Professor Forcing over a base family (Q5, R8), one folder: ``config.py`` (the
``[professor]`` section), ``discriminator.py`` (the behaviour discriminator),
``reference.py`` (a float64 reference of one window's two updates) and ``family.py``
(the glue over the base family). The window program, both paths and the two-optimizer
transaction, is the generation stage's (``generation.forcing``, over
``update.second``); the generator's S / D the objective stage's
(``objective.professor``).
"""
