"""Sampling from a model (Q1): the declared policy (``config``) and the sampler with
addressed draws (``sampler``), used by rollouts (the policy family) and by ``exactstep
generate``. A stage room of its own, never a branch of the update stage.
Design and derivations: docs/design/generation.md (Q1, E1, S5).
"""
