"""S5, Q1 for the policy family, through the real command line at one and two threads:
``exactstep train --set objective.family=policy`` straight, against the same run
SIGKILLed inside a window (after its update, before its ledger line) and again from
outside while a later window runs, resumed each time. The final checkpoints, the ledger,
the manifest and the rollout journal (every sampled response's decoded prompt and
completion, length, reward, baseline and advantage) are byte-identical: a resumed run samples the same tokens.
The baseline is the moving average at one thread and MIXER's learned regressor at two,
whose checkpointed states (the average; the regressor's weights and Adam moments) must
survive too.
Negative control: a resume that drops the data cursor ends elsewhere.
"""

from __future__ import annotations

import json

import pytest
from families.test_family_kill_resume import (
    FamilyHarness,
    bitwise_lineage,
    final_state,
)

from exactstep.state.compare import state_differences

pytestmark = pytest.mark.slow

POLICY = {"objective.family": "policy", "data.source": "arith", "data.kind": "chat",
          "arith.n_train": 64, "arith.n_heldout": 8, "arith.max_new_tokens": 4,
          "batch.seq_len": 112, "generation.max_new_tokens": 4, "generation.samples": 2,
          "policy.reward": "policy_rewards:length", "policy.baseline": "moving_average",
          "update.lr": 0.05}
#: Written beside the launcher (its directory is first on the processes' path): a
#: reward that varies from sample to sample, so every window trains.
REWARD = "def length(prompt, completion, reference):\n    return float(len(completion))\n"


@pytest.mark.parametrize("threads, baseline", [(1, "moving_average"), (2, "learned")])
def test_a_killed_policy_run_resumes_bitwise_with_the_same_samples(threads, baseline,
                                                                   tmp_path):
    (tmp_path / "policy_rewards.py").write_text(REWARD)
    h = FamilyHarness(tmp_path, {**POLICY, "train.threads": threads,
                                 "policy.baseline": baseline})
    straight, defective, manifest = bitwise_lineage(h)
    killed = tmp_path / "killed"
    rollouts = (straight / "rollouts.jsonl").read_bytes()
    assert rollouts == (killed / "rollouts.jsonl").read_bytes()
    ledger = [json.loads(x) for x in (straight / "ledger.jsonl").read_text().splitlines()]
    assert rollouts.count(b"\n") == sum(r["inputs"]["samples"] for r in ledger) > 0
    records = [json.loads(x) for x in rollouts.splitlines()]  # each with its text (Q2)
    assert all(isinstance(r["prompt"], str) and r["prompt"] and isinstance(r["completion"], str)
               and set(r["rewards"]) == {"policy_rewards:length"} for r in records)
    assert all(r["rewards"]["policy_rewards:length"] == r["reward"] for r in records)
    assert sum(r["disposition"] == "COMMITTED" for r in ledger) >= 5  # the draws trained
    assert manifest["environment"]["threads"] == threads
    assert manifest["objective"]["policy"]["baseline"] == baseline
    state = final_state(straight)[1]
    if baseline == "moving_average":
        assert state["program"]["moving_average"] is not None
    else:  # the regressor stepped: its weights and Adam moments are in the checkpoint
        assert state["program"]["regressor"]["optimizer"]["state"][0]["step"] > 0
        assert state["program"]["regressor"]["weight"].abs().sum() > 0
    differences = state_differences(state, final_state(defective)[1])
    assert any(d.startswith("model.") for d in differences)
