"""The run stage: a training run from its configuration to its last committed window
(U4, S1-S10, X3). ``runner`` builds the stages and runs windows, ``continuation``
continues, restarts or refuses a run that exists, ``finished_run`` opens a finished one
(for evaluation and export), ``report`` tells the user, ``host_memory`` sets how a
run's process returns freed memory (L1).
Design and derivations: docs/design/run.md (U4, S4, S7-S10, X3).
"""
