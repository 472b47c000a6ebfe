"""S4, S5, S10 for warm-started runs of every objective family (R8), through the real
command line: ``exactstep resume PARENT --warm-start NEW --set ...`` run straight,
against the same warm start SIGKILLed inside window 0 (before its first checkpoint,
after window 0's update), continued from its parent's weights by ``exactstep resume
NEW`` (or ``train --resume auto``, the same command run again) and SIGKILLed again
inside window 2 (after the checkpoint at 2), then resumed to the end; the finished
run resumed once more is a no-op, and opens for ``eval``. The final checkpoints (weights, optimizer,
counters, RNG, cursor, the program's state), the ledger and the manifest (its
``parent`` section included) are byte-identical to the straight run's.

Negative control: the same killed warm start continued by a resume that ignores the
parent (window 0 from the fresh initialisation) ends with other weights.

Cost: a parent per base (the text decoder, the chat decoder, the two-stream decoder,
each encoder-decoder and the encoder), trained 2 windows and shared by the families over it; 4 warm
windows per lineage, the straight run beside the killed lineage.
"""

from __future__ import annotations

import copy
import json
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from families.test_family_kill_resume import final_state, lines
from state.test_kill_resume import LAUNCHER, Harness
from text_corpus import write_whole

from exactstep.families.registry import BUILT
from exactstep.run.finished_run import evaluate_run
from exactstep.state.compare import state_differences
from exactstep.state.store import latest_checkpoint

pytestmark = pytest.mark.slow

WINDOWS, EVERY = 4, 2

#: The harness's tiny run (``state.test_kill_resume.settings``), few held-out documents
#: so that each family's end-of-run score stays cheap.
TINY = {"seed": 3, "data.val_fraction": 0.08, "batch.seq_len": 32, "batch.rows": 2,
        "model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32,
        "update.accum": 2, "update.warmup": 2, "train.eval_tokens": 64,
        "train.threads": 1, "train.device": "cpu", "checkpoint.every": EVERY,
        "checkpoint.keep": 2}
ARITH = {"data.source": "arith", "data.kind": "chat", "objective.family": "chat",
         "arith.n_train": 48, "arith.n_heldout": 4, "arith.max_new_tokens": 4,
         "batch.seq_len": 112, "model.n_layers": 2}
CORRUPTION = {"span": {"objective.family": "span", "span.sentinels": 8},
              "mass": {"objective.family": "mass"},
              "bart": {"objective.family": "bart", "bart.noise":
                       "sentence_permutation,text_infilling,token_masking,document_rotation"}}

#: The parents: a base's settings on top of ``TINY`` (``{corpus}``: the harness corpus).
PARENTS = {
    "text": {"data.source": "{corpus}"},
    "chat": ARITH,
    "mlm": {"data.source": "{corpus}", "objective.family": "mlm"},
    # the two-stream decoder has a query stream a causal checkpoint lacks
    "permutation": {"data.source": "{corpus}", "objective.family": "permutation",
                    "permutation.predict_one_in": 2},
    "encdec": {"objective.family": "encdec", "encdec.n_train": 40, "encdec.n_heldout": 3,
               "encdec.max_value": 99, "encdec.source_len": 12, "batch.seq_len": 40,
               "encdec.max_new_tokens": 4},
    **{name: {"data.source": "{corpus}", **s} for name, s in CORRUPTION.items()},
}

#: Each family: its parent and the warm start's ``--set`` (the draws must matter).
FAMILIES = {
    "causal": ("text", {"update.lr": 0.01}),
    "scheduled_sampling": ("text", {"objective.family": "scheduled_sampling",
                                    "scheduled_sampling.schedule": "linear",
                                    "scheduled_sampling.slope": 0.1,
                                    "scheduled_sampling.floor": 0.5}),
    "permutation": ("permutation", {"update.lr": 0.01}),
    "mlm": ("mlm", {"update.lr": 0.01}),
    "span": ("span", {"update.lr": 0.01}),
    "mass": ("mass", {"update.lr": 0.01}),
    "bart": ("bart", {"update.lr": 0.01}),
    "encdec": ("encdec", {"update.lr": 0.01}),
    "chat": ("chat", {"update.lr": 0.01}),
    "prefix": ("chat", {"objective.family": "prefix"}),
    "policy": ("chat", {"objective.family": "policy", "generation.max_new_tokens": 4,
                        "generation.samples": 2, "policy.reward": "policy_rewards:length",
                        "policy.baseline": "moving_average", "update.lr": 0.05}),
    "professor": ("chat", {"objective.family": "professor", "generation.max_new_tokens": 4,
                           "professor.over": "chat", "professor.d_hidden": 8,
                           "professor.d_lr": 0.01, "professor.lambda_forced": 0.5,
                           "update.lr": 0.01}),
}
#: Families whose restart at window 0 is ``train --resume auto`` (S10), the rest
#: ``exactstep resume``; and those that also run the negative control.
AUTO = ("causal", "encdec", "policy", "mlm")
CONTROLLED = ("causal", "encdec", "policy")

#: A reward that varies from sample to sample (``policy.reward``), in the launch
#: directory, first on the processes' path.
REWARD = "def length(prompt, completion, reference):\n    return float(len(completion))\n"

#: The defect ``no_parent``: window 0 of a killed warm start from the fresh weights.
NO_PARENT = '''
if defect == "no_parent":
    continuation.parent_checkpoint = lambda run_dir, parent: None
'''
MARKER = 'if kill_at != "none" and not kill_at.startswith("window_"):'


def pairs(settings: dict) -> list[str]:
    return [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]


class WarmHarness(Harness):
    """The kill-resume launcher with the ``no_parent`` defect; runs named by role."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.launcher = root / "warm_launch.py"
        write_whole(self.launcher, LAUNCHER.replace(MARKER, NO_PARENT + MARKER, 1))
        write_whole(root / "policy_rewards.py", REWARD)

    def settings(self, base: str, corpus: Path | None = None) -> dict:
        corpus = corpus or self.corpus
        return {**TINY, "train.steps": EVERY,
                **{k: str(v).replace("{corpus}", str(corpus))
                   for k, v in PARENTS[base].items()}}

    def parent(self, base: str) -> Path:
        run_dir = self.root / f"parent_{base}"
        assert self.launch(["train", "--no-progress", "--out", str(run_dir),
                            *pairs(self.settings(base))], run_dir=run_dir) == 0, \
            self.last_output
        return run_dir

    def warm(self, parent: Path, run_dir: Path, family: str, **kw) -> int:
        return self.launch(["resume", "--no-progress", str(parent), "--warm-start",
                            str(run_dir), *pairs(self.warm_settings(family))],
                           run_dir=run_dir, **kw)

    @staticmethod
    def warm_settings(family: str) -> dict:
        """A warm start is a new run: its thread count is its own (S9), pinned here so
        that the straight run and the lineage, launched under different
        ``OMP_NUM_THREADS``, declare the same environment."""
        return {**FAMILIES[family][1], "train.steps": WINDOWS, "train.threads": 1}

    def auto(self, run_dir: Path, family: str, parent: Path, **kw) -> int:
        """``train --resume auto``: the parent's command line and the warm start's
        ``--set``, all the command line can say (not the parent)."""
        every = {**self.settings(FAMILIES[family][0], parent.parent / "corpus.jsonl"),
                 **self.warm_settings(family)}
        return self.launch(["train", "--no-progress", "--out", str(run_dir), "--resume",
                            "auto", *pairs(every)], run_dir=run_dir, **kw)


@pytest.fixture(scope="module")
def parents(tmp_path_factory):
    """Every base's parent, trained once for the module (two at a time)."""
    h = WarmHarness(tmp_path_factory.mktemp("parents"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        built = dict(zip(PARENTS, pool.map(h.parent, PARENTS), strict=True))
    return built


def killed_lineage(h: WarmHarness, parent: Path, family: str) -> tuple[Path, Path | None]:
    run_dir = h.root / "killed"
    assert h.warm(parent, run_dir, family, kill_at="window_end:0") == -signal.SIGKILL, \
        h.last_output
    assert latest_checkpoint(run_dir / "checkpoints") is None and lines(run_dir) == 0
    control = None
    if family in CONTROLLED:
        control = h.root / "no_parent"
        shutil.copytree(run_dir, control)
    kill = f"window_end:{EVERY}"
    code = (h.auto(run_dir, family, parent, kill_at=kill) if family in AUTO
            else h.resume(run_dir, kill_at=kill))
    assert code == -signal.SIGKILL, h.last_output
    assert "from the parent's weights" in h.last_output
    assert lines(run_dir) == EVERY
    assert latest_checkpoint(run_dir / "checkpoints").name == f"window-{EVERY:08d}"
    assert h.resume(run_dir) == 0, h.last_output
    if control is not None:
        assert h.resume(control, defect="no_parent") == 0, h.last_output
    return run_dir, control


@pytest.mark.parametrize("family", BUILT)
def test_a_killed_warm_start_resumes_bitwise_from_its_parent_s4_s5(family, parents,
                                                                    tmp_path):
    """Straight warm start = killed before its first checkpoint, restarted from the
    parent, killed again and resumed, bitwise; a resume of the finished run changes
    nothing; ignoring the parent ends elsewhere (negative control)."""
    h = WarmHarness(tmp_path)
    parent = parents[FAMILIES[family][0]]
    straight = tmp_path / "straight"
    mine = copy.copy(h)  # each thread's own last_output
    with ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(mine.warm, parent, straight, family)
        b = pool.submit(killed_lineage, copy.copy(h), parent, family)
        assert a.result() == 0, mine.last_output
        killed, control = b.result()
    name_a, state_a, files_a = final_state(straight)
    name_b, state_b, files_b = final_state(killed)
    assert name_a == name_b == f"window-{WINDOWS:08d}"
    assert state_differences(state_a, state_b) == []
    assert files_a == files_b
    journals = ["ledger.jsonl", "manifest.json"] + (["rollouts.jsonl"] if
                                                    family in ("policy", "professor") else [])
    for name in journals:
        assert (straight / name).read_bytes() == (killed / name).read_bytes(), name
    manifest = json.loads((straight / "manifest.json").read_bytes())["manifest"]
    parent_manifest = json.loads((parent / "manifest.json").read_bytes())
    assert manifest["parent"] == {"run_dir": str(parent), "checkpoint": f"window-{EVERY:08d}",
                                  "manifest_digest": parent_manifest["digest"]}
    assert manifest["config"]["objective"]["family"] == family
    # the finished run resumed again: nothing to do, nothing committed changes (S4, S8)
    before = {n: (killed / n).read_bytes() for n in journals}
    assert h.resume(killed) == 0, h.last_output
    assert {n: (killed / n).read_bytes() for n in journals} == before
    assert final_state(killed)[2] == files_a
    if family == "causal":  # the finished warm start opens for eval as any run does
        a, b = evaluate_run(straight), evaluate_run(killed)
        assert (a.checkpoint, a.result) == (b.checkpoint, b.result)
        assert a.result.tokens > 0
    if control is not None:
        differences = state_differences(state_a, final_state(control)[1])
        assert any(d.startswith("model.") for d in differences)


def test_the_table_covers_every_built_family():
    assert sorted(FAMILIES) == sorted(BUILT)
    assert set(AUTO) <= set(FAMILIES) and set(CONTROLLED) <= set(FAMILIES)
