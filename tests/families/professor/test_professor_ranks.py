"""Q5, D1 for Professor Forcing: a window of eight examples over two gloo ranks (four
each) steps both models as the same window does in one process. Each rank's generator
and discriminator after the window are within the float64 reference's tolerance
(``test_professor_reference``: twice the reference's own fp32 distance from float64),
as the one-process window is; the free runs are the same tokens wherever each example
was (Q1).
Negative control: ranks that step the discriminator on their own share (no reduction of
its gradient or its count) are outside the tolerance.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import contract_tolerance
from forcing_support import Setup, professor, reference_updates, split
from parallel.workers import spawn_ranks

from exactstep.families.professor.forcing import ProfessorForcing
from exactstep.parallel.agreement import distribute_engine
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.process_group import init_distributed, launcher_env, shutdown
from exactstep.parallel.reducer import build_reducer

pytestmark = pytest.mark.slow

IDS = [[0, 1, 2, 3], [4, 5, 6, 7]]
EXAMPLES = 8


class LocalDiscriminator(ProfessorForcing):
    """WRONG (D1): each rank steps the discriminator on its own share of the window."""

    def prepare(self, model, batches, *, reducer=None, **kw):
        self._reducer = reducer
        return super().prepare(model, batches, reducer=None, **kw)


def rank_window(rank: int, world: int, port: int, out: str, job: dict) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(ParallelConfig(timeout_s=60.0), "cpu",
                           env=launcher_env(rank, world, port))
    try:
        program_cls = LocalDiscriminator if job.get("local") else ProfessorForcing
        setup = Setup(professor(), program_cls=program_cls, examples=split(EXAMPLES),
                      reducer=build_reducer(ctx))
        distribute_engine(setup.engine, ctx, ParallelConfig())
        disposition = setup.window([IDS[rank]])
        torch.save({"generator": setup.generator(), "discriminator": setup.discriminator(),
                    "free": setup.free, "info": disposition.inputs}, f"{out}/rank{rank}.pt")
    finally:
        shutdown(ctx)


def within(engine: dict, want: dict, tol: float) -> bool:
    return all(float((engine[n].double() - w).abs().max()) <= tol for n, w in want.items())


def test_two_ranks_step_both_models_as_one_process(tmp_path):
    results, codes, _ = spawn_ranks(rank_window, 2, tmp_path, {}, deadline_s=240)
    assert codes == [0, 0], results
    single = Setup(professor(), examples=split(EXAMPLES))
    g, d = single.generator(), single.discriminator()
    single.window([IDS[0] + IDS[1]])
    assert {**results[0]["free"], **results[1]["free"]} == single.free  # Q1
    assert results[0]["info"]["examples"] == results[1]["info"]["examples"] == EXAMPLES
    ids = IDS[0] + IDS[1]
    g64, d64 = reference_updates(single, g, d, ids, torch.float64)
    g32, d32 = reference_updates(single, g, d, ids, torch.float32)
    g_tol = contract_tolerance(0.0, list(g32.values()), list(g64.values()))
    d_tol = contract_tolerance(0.0, list(d32.values()), list(d64.values()))
    assert within(single.generator(), g64, g_tol) and within(single.discriminator(), d64, d_tol)
    for rank in (0, 1):
        assert within(results[rank]["generator"], g64, g_tol), rank
        assert within(results[rank]["discriminator"], d64, d_tol), rank
    (tmp_path / "wrong").mkdir()
    wrong, codes, _ = spawn_ranks(rank_window, 2, tmp_path / "wrong", {"local": True},
                                  deadline_s=240)
    assert codes == [0, 0], wrong
    assert not within(wrong[0]["discriminator"], d64, d_tol)
