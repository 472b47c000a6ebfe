"""The update stage: objective -> one committed (or skipped) update per window (U1-U7).

- ``UpdateEngine.run_window``: the window transaction, in the order of U3.
- ``Precision``: autocast and the fp16 loss scaler (U2).
- ``resolve_groups`` / ``build_optimizer``: unique parameters in declared groups (U6).
- ``Schedule`` / ``build_schedule``: learning rate on a committed-update or token clock (U5).
- ``Ledger``: one JSON line per window (U4).
"""

from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Disposition, Outcome
from exactstep.update.groups import (
    ResolvedGroups,
    build_optimizer,
    paper_to_torch_weight_decay,
    resolve_groups,
    torch_to_paper_weight_decay,
)
from exactstep.update.ledger import Ledger
from exactstep.update.precision import Precision
from exactstep.update.schedule import Schedule, build_schedule
from exactstep.update.window import LocalReducer, Reducer, TrainModule, UpdateEngine

__all__ = [
    "Disposition",
    "Ledger",
    "LocalReducer",
    "NumericsConfig",
    "Outcome",
    "Precision",
    "Reducer",
    "ResolvedGroups",
    "Schedule",
    "TrainModule",
    "UpdateConfig",
    "UpdateEngine",
    "build_optimizer",
    "build_schedule",
    "paper_to_torch_weight_decay",
    "resolve_groups",
    "torch_to_paper_weight_decay",
]
