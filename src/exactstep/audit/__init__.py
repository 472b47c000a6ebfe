"""Conformance probes for any training step (A1, A2) and any policy loop (Q3, Q4).

``exactstep audit --target exactstep | python:MODULE:FUNCTION`` runs ``PROBES``
against a ``TrainingStep`` (the adapter protocol, ``exactstep.audit.protocol``) and
reports each contract's expected and observed value; a ``PolicyStep`` (a policy loop,
``exactstep.audit.policy_probes``) meets the policy probes. Two correct example loops ship
in ``exactstep.audit.examples`` (nanoGPT-style and Annotated-Transformer-style).
"""

from __future__ import annotations

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "TrainingStep": "exactstep.audit.protocol",
    "ProbeSpec": "exactstep.audit.protocol",
    "Microbatch": "exactstep.audit.protocol",
    "WindowCursor": "exactstep.audit.protocol",
    "PROBES": "exactstep.audit.probes",
    "PolicyStep": "exactstep.audit.policy_probes",
    "PolicyWindow": "exactstep.audit.policy_probes",
    "POLICY_PROBES": "exactstep.audit.policy_probes",
    "Probe": "exactstep.audit.probes",
    "Result": "exactstep.audit.probes",
    "run_probe": "exactstep.audit.probes",
    "AuditReport": "exactstep.audit.run",
    "audit": "exactstep.audit.run",
    "run_audit": "exactstep.audit.run",
    "resolve_target": "exactstep.audit.run",
}

_NAMES, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_NAMES)
