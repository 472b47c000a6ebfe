"""exactstep: train language models so every optimizer update is exactly the declared
objective. See the contracts (R, L, U, D, S, E, A, X ids) in the README."""

__version__ = "0.1.0"
