"""The prefix-LM family (R8), one folder: ``compiler.py`` (causal rows plus the
bidirectional prefix), ``reference.py`` (the pure-Python visibility rule) and
``family.py`` (the glue: decoder, manifest section, greedy exact match). It reads the
shared ``[chat]`` and ``[arith]`` sections.
"""
