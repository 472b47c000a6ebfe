"""Objective families (R8): one room per family (its compiler choice, model builder,
manifest section, score and specials) and the registry that picks the run's
(``families.registry``). The composition root of R8: it builds on ``rows``, ``model``,
``objective`` and ``eval``; nothing below imports it.
"""

from exactstep.families.inspect import inspect_rows
from exactstep.families.registry import (
    BUILT,
    DEFAULT_SOURCE,
    SPECIFIED,
    Family,
    FamilyParts,
    family_name,
    family_of,
    family_tokenizer,
    open_family,
    resolve,
    run_data_kind,
)

__all__ = ["BUILT", "DEFAULT_SOURCE", "SPECIFIED", "Family", "FamilyParts", "family_name",
           "family_of", "family_tokenizer", "inspect_rows", "open_family", "resolve",
           "run_data_kind"]
