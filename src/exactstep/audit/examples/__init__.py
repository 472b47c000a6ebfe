"""Example training loops wrapped as audit targets (A1, A2).

``nanogpt`` (a nanoGPT-style loop) and ``annotated`` (an Annotated-Transformer-style
loop) are correct loops the audit must pass; each module's ``make`` is the factory that
``exactstep audit --target python:exactstep.audit.examples.NAME:make`` calls.
"""
