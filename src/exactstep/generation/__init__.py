"""Sampling from a model (Q1): the declared policy (``config``), the sampler with
addressed draws (``sampler``) and a window's prompts (``prompts``), shared by the
families' window programs (policy rollouts, Professor Forcing) and ``exactstep
generate``. It knows no family. A stage room of its own, never a branch of the update
stage.
Design and derivations: docs/design/generation.md (Q1, E1, S5).
"""
