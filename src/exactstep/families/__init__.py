"""Objective families (R8): one folder per family and the registry that picks the run's.

``families/<name>/`` holds a family whole: its compiler, config section and pure-Python
reference (rows-floor code: ``config`` reads the section) and its glue, ``family.py``
(model, manifest section, score). The registry (``families.registry``) finds a family
by its folder. Public names are exported lazily, so ``config`` can read a section
without loading the registry. Design: docs/design/families.md (R8, S1, X4).
"""

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "BUILT": "exactstep.families.registry",
    "DEFAULT_SOURCE": "exactstep.families.registry",
    "SPECIFIED": "exactstep.families.registry",
    "Family": "exactstep.families.registry",
    "FamilyParts": "exactstep.families.registry",
    "family_name": "exactstep.families.registry",
    "family_of": "exactstep.families.registry",
    "family_tokenizer": "exactstep.families.registry",
    "inspect_rows": "exactstep.families.inspect",
    "open_family": "exactstep.families.registry",
    "resolve": "exactstep.families.registry",
    "run_data_kind": "exactstep.families.registry",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
