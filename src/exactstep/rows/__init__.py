"""Objective compilers from examples to ``Batch`` rows (R1-R8).

The rows stage, what every family uses: packing, the causal and chat compilers,
invariants (R7), the row stream, background loading (a worker thread or a loader
process, P3), ``inspect`` (R6) and a batch's copies to a device (``transfer``, U7); a
family's own compiler lives in its folder (``families/<name>/``). The public names are
exported lazily.
Design and derivations: docs/design/rows.md#rows__init__py (R1-R8, P2, P3).
"""

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "BackgroundStream": "exactstep.rows.background",
    "Batch": "exactstep.rows.batch",
    "BatchConfig": "exactstep.rows.config",
    "ChatPolicy": "exactstep.rows.chat",
    "DataBundle": "exactstep.rows.example",
    "Example": "exactstep.rows.example",
    "IGNORE_INDEX": "exactstep.rows.batch",
    "LoaderProcess": "exactstep.rows.loader_process",
    "PackPlanner": "exactstep.rows.packing",
    "PreparedDocuments": "exactstep.rows.prepared",
    "RowPlan": "exactstep.rows.packing",
    "RowStream": "exactstep.rows.stream",
    "Segment": "exactstep.rows.batch",
    "chat_examples": "exactstep.rows.chat",
    "check_batch": "exactstep.rows.invariants",
    "eval_batches": "exactstep.rows.stream",
    "load_bundle": "exactstep.rows.sources",
    "load_prepared_bundle": "exactstep.rows.prepared",
    "render_rows": "exactstep.rows.inspect",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
