"""The update stage: objective -> one committed (or skipped) update per window (U1-U7).

- ``UpdateEngine.run_window``: the window transaction, in the order of U3.
- ``Precision``: autocast and the fp16 loss scaler (U2).
- ``resolve_groups`` / ``build_optimizer``: unique parameters in declared groups (U6).
- ``Schedule`` / ``build_schedule``: learning rate on a committed-update or token clock (U5).
- ``Ledger``: one JSON line per window (U4).
Design and derivations: docs/design/update.md (U1-U7).
"""

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "Disposition": "exactstep.update.disposition",
    "Ledger": "exactstep.update.ledger",
    "LocalReducer": "exactstep.update.window",
    "NumericsConfig": "exactstep.update.config",
    "Outcome": "exactstep.update.disposition",
    "Precision": "exactstep.update.precision",
    "Reducer": "exactstep.update.window",
    "ResolvedGroups": "exactstep.update.groups",
    "Schedule": "exactstep.update.schedule",
    "TrainModule": "exactstep.update.window",
    "UpdateConfig": "exactstep.update.config",
    "UpdateEngine": "exactstep.update.window",
    "build_optimizer": "exactstep.update.groups",
    "build_schedule": "exactstep.update.schedule",
    "paper_to_torch_weight_decay": "exactstep.update.groups",
    "resolve_groups": "exactstep.update.groups",
    "torch_to_paper_weight_decay": "exactstep.update.groups",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
