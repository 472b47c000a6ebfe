"""Example training loops wrapped as audit targets (A1, A2)."""
