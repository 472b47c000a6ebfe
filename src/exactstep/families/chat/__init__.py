"""The chat SFT family (R5, R8): its glue, ``family.py``. Its compiler is the core causal
one over rendered chats, owned by the chat policy (``rows.chat``), which the prefix
family and prepared data share.
"""
