"""R3 for Hugging Face models (H1): packed rows == documents run one by one.

For each family, under ``sdpa`` (a 4D block mask) and ``exactstep`` (per-document
attention with no mask, and the dense mask its ``model.attention = "auto"`` takes where
that is cheaper), a packed batch (several documents per row, positions reset,
padding at the tail) through exactstep's adapter gives the same per-document
logits, the same token-mean loss and the same parameter gradients (fp32, 1e-5)
as HF's *own* forward of each document alone (no mask, HF's default positions):
the reference never goes through the adapter.

Negative controls, in the same test: the same documents flattened by HF's own
``DataCollatorWithFlattening`` (position_ids only) and fed to the model as HF runs
it by default (the config's ``use_cache = True``) must leak (a measurable
difference), and the packed rows without exactstep's mask (and so with HF's
default positions) must differ. (transformers 5.x infers documents from
``position_ids`` when no mask and no cache is given, so the flattened rows happen
to be isolated with ``use_cache=False``; exactstep does not rely on that inference:
it always passes its own mask.) For GPT-2 (learned absolute positions) the packed row with the mask but
with positions counted along the row must differ too, which shows that
``position_ids`` reach ``wpe``. For ``eager``, the boolean form of the mask
(which the eager kernel adds to the scores as 0/1) must leak.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from equivalence import equivalence_error  # noqa: E402
from hf_equivalence import flat, logits_error, run_separately, separate_tolerance  # noqa: E402
from hf_equivalence import run_packed as packed_run  # noqa: E402
from hf_support import FAMILIES, hf_model  # noqa: E402
from model_batches import fill_rows, packed_batch  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

from exactstep.model.attention import dense_visibility_mask  # noqa: E402
from exactstep.model.hf import HFCausalLM  # noqa: E402

VOCAB = 64
TOL = 1e-5  # R3: fp32, 1e-5 (``separate_tolerance``: or fp32's own spread, were it larger)
LEAK = 1e-3  # a negative control must move some logit by more than this
DOC_LENGTHS = [[5, 9, 3], [12, 4], [1, 7]]  # three rows, last two padded
SEQ_LEN = 18


def documents() -> list[list[list[int]]]:
    return fill_rows(DOC_LENGTHS, VOCAB, seed=1)


def run_packed(model: HFCausalLM, rows, *, continue_positions: bool = False):
    return packed_run(model, rows, SEQ_LEN, continue_positions=continue_positions)


@torch.no_grad()
def collator_logits(model: HFCausalLM, rows) -> list[torch.Tensor]:
    """WRONG on purpose: HF's flattening collator (position_ids only), one long row,
    run with HF's default ``use_cache = True`` (the adapter switches the config off)."""
    docs = flat(rows)
    features = DataCollatorWithFlattening()([{"input_ids": d} for d in docs],
                                             return_tensors="pt")
    logits = model.hf(input_ids=features["input_ids"], position_ids=features["position_ids"],
                      use_cache=True).logits[0]  # [N, V]
    return list(logits.split([len(d) for d in docs]))


@torch.no_grad()
def maskless_logits(model: HFCausalLM, rows) -> list[torch.Tensor]:
    """WRONG on purpose: the packed rows handed over without a mask (HF's own call)."""
    batch = packed_batch(rows, SEQ_LEN)
    hidden = model.decoder(input_ids=batch.input_ids, use_cache=False).last_hidden_state
    logits = model.logits(hidden)  # [B, T, V]
    return [logits[b, s.start : s.stop] for b, row in enumerate(batch.segments) for s in row]


@pytest.mark.parametrize("attn", ["sdpa", "exactstep:segments", "exactstep:dense"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_rows_equal_documents_alone_and_hf_flattening_leaks(family, attn):
    attn, _, realised = attn.partition(":")  # exactstep: per document, or its dense mask
    model = hf_model(family, VOCAB, seed=3, attn=attn)
    assert model.hf.config._attn_implementation == attn
    if realised:
        model.attention = realised
    model.train()
    rows = documents()
    packed = run_packed(model, rows)
    separate = run_separately(model, rows)
    assert any(float(g.abs().max()) > 1e-4 for g in packed[2].values())  # not trivially 0
    assert equivalence_error(packed, separate) <= separate_tolerance(TOL, model, rows, separate)
    # negative controls: the check can see documents attending to each other
    assert logits_error(collator_logits(model, rows), separate[0]) > LEAK
    assert logits_error(maskless_logits(model, rows), separate[0]) > LEAK
    if family == "gpt2":  # learned absolute positions: position_ids must reach wpe
        assert logits_error(run_packed(model, rows, continue_positions=True)[0],
                            separate[0]) > LEAK


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eager_packed_rows_equal_documents_alone(family):
    model = hf_model(family, VOCAB, seed=5, attn="eager")
    assert model.hf.config._attn_implementation == "eager"
    model.train()
    rows = documents()
    separate = run_separately(model, rows)
    assert equivalence_error(run_packed(model, rows), separate) <= separate_tolerance(
        TOL, model, rows, separate)
    # negative control: the boolean mask (right for sdpa) leaks under eager
    model.attention_mask = lambda segment_ids, *_: dense_visibility_mask(segment_ids, causal=True)
    assert logits_error(run_packed(model, rows)[0], separate[0]) > LEAK
