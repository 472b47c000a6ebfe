"""The masked-LM family's held-out figures (``families.mlm.family.mlm_score``, E1).

A copying model (its prediction at a column is the token the column shows) has a
known accuracy by action: 0 at masked columns (it answers the mask id), 1 at kept
ones, and at random ones exactly the fraction whose random token hit the original.
The unigram answer is the most frequent training byte, counted here with a Counter.
The evaluation leaves every RNG stream and the model's mode as it found them.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from mlm_reference import IGNORE_INDEX, MASK
from torch import nn

from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.families.mlm.family import mlm_score
from exactstep.rows.stream import eval_batches
from exactstep.run.report import format_summary

VOCAB = 260


class CopyModel(nn.Module):
    """Hidden state = one-hot of the input; head = identity: predicts what it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Parameter(torch.eye(VOCAB))
        self.dropout = nn.Dropout(0.5)  # would draw from torch's stream in train mode

    @property
    def head_weight(self) -> torch.Tensor:
        return self.head

    def forward(self, batch):
        return self.dropout(F.one_hot(batch.input_ids, VOCAB).float())


def parts_for(tmp_path, eval_tokens: int):
    texts = [f"the {i}th example, zz{i % 7}: spam and eggs" for i in range(60)]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    cfg = resolve(load_config(None, ["objective.family=mlm", f"data.source={corpus}",
                                     "data.val_fraction=0.3", "batch.seq_len=48",
                                     "batch.rows=4", f"train.eval_tokens={eval_tokens}",
                                     "mlm.replace_mask=0.4", "mlm.replace_random=0.3"]))
    return cfg, open_family(cfg)


def test_a_copying_model_scores_what_it_can_see(tmp_path):
    cfg, parts = parts_for(tmp_path, eval_tokens=10_000)  # every held-out target
    model = CopyModel().train()
    rng_before = torch.get_rng_state()
    out = mlm_score(model, parts, cfg, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng_before) and model.training  # E1
    batches = list(eval_batches(parts.data.val, cfg.batch, pad_id=parts.tokenizer.pad_id,
                                compiler=parts.compiler))
    shown, labels = (torch.cat([getattr(b, k).reshape(-1) for b in batches])
                     for k in ("input_ids", "labels"))
    supervised = labels != IGNORE_INDEX
    masked = supervised & (shown == MASK)
    assert out["masked_targets"] == int(supervised.sum()) > 50
    assert out["masked_targets_mask"] == int(masked.sum()) > 0
    assert out["masked_accuracy_mask"] == 0.0
    assert out["masked_accuracy_keep"] == 1.0
    other = supervised & ~masked
    hit = int((shown[other] == labels[other]).sum())  # kept, or a random draw that hit
    assert out["masked_accuracy"] == hit / int(supervised.sum())
    counts = Counter(b for ex in parts.data.train for b in ex.tokens.tolist() if b < 256)
    top = max(sorted(counts), key=counts.__getitem__)
    assert out["unigram_answer"] == top
    assert out["unigram_accuracy"] == int((labels[supervised] == top).sum()) / int(
        supervised.sum())


def test_the_budget_is_the_validators(tmp_path):
    """With ``train.eval_tokens`` smaller than the split, the figures cover the same
    batches as ``eval.evaluate``: whole batches until the budget is reached."""
    cfg, parts = parts_for(tmp_path, eval_tokens=20)
    out = mlm_score(CopyModel(), parts, cfg, torch.device("cpu"))
    first = next(iter(eval_batches(parts.data.val, cfg.batch, pad_id=parts.tokenizer.pad_id,
                                   compiler=parts.compiler)))
    assert out["masked_targets"] == first.num_targets() >= 20


def test_the_summary_prints_the_masked_accuracy():
    summary = {"windows": {"committed": 1, "skipped_nonfinite": 0, "no_objective": 0},
               "supervised_tokens": 3, "wall_s": 1.0, "heldout_loss": 2.0, "heldout_tokens": 9,
               "heldout_bytes": 9, "heldout_perplexity": 7.4, "heldout_bits_per_byte": 2.9,
               "unigram_bits_per_byte": 4.5, "bpb_ratio_to_unigram": 0.64, "data": {},
               "masked_accuracy": 0.5, "masked_targets": 9, "masked_accuracy_mask": 0.25,
               "unigram_accuracy": 0.125}
    assert "masked accuracy     0.500 on 9 held-out selected tokens ([mask] only: 0.250; " \
           "unigram 0.125)" in format_summary(summary)
