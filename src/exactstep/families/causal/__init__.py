"""The causal-LM family (R8): its folder holds only its glue, ``family.py`` (the
decoder, the manifest section). Its compiler is the core causal one (``rows.causal``,
``rows.compiler``), which every family shares, so it stays in ``rows``.
"""
