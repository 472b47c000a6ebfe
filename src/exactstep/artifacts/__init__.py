"""What goes in and out of runs as files of their own (P1, H3, R10): ``prepare``
tokenizes a source once into prepared shards, ``export`` writes a finished run as a
Hugging Face model directory with the handoff check, ``distill`` turns a teacher's
answers into a declared prepared source.
Design and derivations: docs/design/prepare-export.md (P1, H3, R10).
"""
