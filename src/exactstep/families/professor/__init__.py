"""Professor Forcing over a base family (Q5, R8), one folder: ``config.py`` (the
``[professor]`` section), ``discriminator.py`` (the behaviour discriminator),
``reference.py`` (a float64 reference of one window's two updates), ``forcing.py``
(the window program: both paths, over the generation stage's sampler, and the
two-optimizer transaction, over ``update.second``) and ``family.py`` (the glue over the
base family). The generator's S / D is the objective stage's (``objective.professor``).
"""
