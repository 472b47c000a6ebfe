"""S5, Q5 for Professor Forcing, through the real command line at one and two threads:
``exactstep train --set objective.family=professor`` straight, against the same run
SIGKILLed **between the discriminator's steps and the generator's** in a window (the
discriminator stepped in memory, the generator not), resumed, SIGKILLed again after a
later window's two updates (before its ledger line), and resumed to the end. The final
checkpoints (generator, discriminator weights, both optimizers' states, both clocks),
the ledger, the manifest and the rollout journal are byte-identical: either both
updates of a window are on disk, or neither.
Negative control: a resume that forgets the discriminator's state (its weights,
moments and clock start over) ends elsewhere.
"""

from __future__ import annotations

import json
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from families.test_family_kill_resume import FamilyHarness, final_state, lines

from exactstep.state.compare import state_differences

pytestmark = pytest.mark.slow

PROFESSOR = {"objective.family": "professor", "data.source": "arith", "data.kind": "chat",
             "arith.n_train": 64, "arith.n_heldout": 8, "arith.max_new_tokens": 4,
             "batch.seq_len": 112, "generation.max_new_tokens": 4,
             "professor.over": "chat", "professor.d_hidden": 8, "professor.d_lr": 0.01,
             "professor.lambda_forced": 0.5, "update.lr": 0.01}

#: Installed in the launcher before the command runs: ``between_d_and_g:W`` kills the
#: process once window W's discriminator steps are taken, before the generator's
#: forward; ``no_discriminator`` is the defect that drops the discriminator's state.
PATCH = '''
if kill_at.startswith("between_d_and_g:"):
    from exactstep.families.professor.forcing import ProfessorForcing
    _target, _prepare = int(kill_at.split(":")[1]), ProfessorForcing.prepare
    def _killing_prepare(self, model, batches, *, window, **kw):
        out = _prepare(self, model, batches, window=window, **kw)
        if window == _target:
            assert self.second.pending > 0   # the discriminator stepped in memory
            die()
        return out
    ProfessorForcing.prepare = _killing_prepare
    kill_at = "none"
if defect == "no_discriminator":
    from exactstep.families.professor.forcing import ProfessorForcing
    ProfessorForcing.load_state_dict = lambda self, state: None
    defect = "none"
'''


class ProfessorHarness(FamilyHarness):
    def __init__(self, root: Path, family: dict) -> None:
        super().__init__(root, family)
        text = self.launcher.read_text()
        marker = 'if kill_at != "none" and not kill_at.startswith("window_"):'
        self.launcher.write_text(text.replace(marker, PATCH + marker, 1))


def straight(h: ProfessorHarness) -> Path:
    run_dir = h.root / "straight"
    assert h.train(run_dir) == 0, h.last_output
    return run_dir


def killed(h: ProfessorHarness) -> tuple[Path, Path]:
    run_dir = h.root / "killed"
    assert h.train(run_dir, kill_at="between_d_and_g:3") == -signal.SIGKILL, h.last_output
    assert lines(run_dir) == 3  # windows 0-2 logged; window 3 died between its updates
    assert h.resume(run_dir, kill_at="window_end:6") == -signal.SIGKILL, h.last_output
    defective = h.root / "no_discriminator"
    shutil.copytree(run_dir, defective)
    assert h.resume(run_dir) == 0, h.last_output
    assert h.resume(defective, defect="no_discriminator") == 0, h.last_output
    return run_dir, defective


@pytest.mark.parametrize("threads, d_steps", [(1, 1), (2, 2)])
def test_a_run_killed_between_its_two_updates_resumes_bitwise(threads, d_steps, tmp_path):
    h = ProfessorHarness(tmp_path, {**PROFESSOR, "train.threads": threads,
                                    "professor.d_steps": d_steps})
    with ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(straight, h)
        b = pool.submit(killed, h)
        run_a, (run_b, defective) = a.result(), b.result()
    name_a, state_a, files_a = final_state(run_a)
    name_b, state_b, files_b = final_state(run_b)
    assert name_a == name_b
    assert state_differences(state_a, state_b) == []
    assert files_a == files_b
    for name in ("ledger.jsonl", "manifest.json", "rollouts.jsonl"):
        assert (run_a / name).read_bytes() == (run_b / name).read_bytes(), name
    ledger = [json.loads(x) for x in (run_a / "ledger.jsonl").read_text().splitlines()]
    assert sum(r["disposition"] == "COMMITTED" for r in ledger) == len(ledger) == 10
    assert all(len(r["inputs"]["discriminator"]["lr"]) == d_steps for r in ledger)
    manifest = json.loads((run_a / "manifest.json").read_bytes())["manifest"]
    assert manifest["environment"]["threads"] == threads
    assert manifest["objective"]["professor"]["order"]["d_steps"] == d_steps
    assert state_a["program"]["discriminator"]["committed"] == 10 * d_steps
    differences = state_differences(state_a, final_state(defective)[1])
    assert any("discriminator" in d for d in differences)
