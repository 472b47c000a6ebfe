"""Attention windows of Hugging Face models against packed rows (H1, R3).

A window (``sliding_window``, Llama 4's ``attention_chunk_size``, ...) limits what a
query sees *within its own document*; exactstep's 4D mask replaces the model's own,
so a window must either be realised in that mask from the per-document positions
or refused when a row could cross it. What is promised:

* a window the build-time probe crosses is realised, and packed rows then equal
  their documents alone (fp32, 1e-5) on rows longer than the window: Llama 4's
  chunked layers, Mistral's uniform sliding window (one mask), Gemma 2's
  alternating sliding and full layers (one mask per layer type); negative control:
  the same rows without the window in the mask differ (0.22 in the logits for
  this tiny Llama 4 at chunk 8);
* a window the model applies itself (GPT-Neo's local layers, by index inside the
  attention) passes the crossing probe unrealised and is neither realised nor
  refused; negative control: realised on every layer, it changes the global ones;
* a window the probe does not cross (longer than ``PROBE_WINDOW_LIMIT``), or that
  fails the crossing probe both ways, is refused when ``batch.seq_len`` exceeds it,
  naming the field and the fix; ``seq_len`` up to the window is accepted and exact;
* the probe's documents cross the model's windows: a realisation that drops the
  window is caught at build time (and falls back to the refusal);
* a position coupling that no mask can realise (Llama 4's attention temperature on
  its NoPE layers, a function of the row index) is refused from ``floor_scale`` on;
* the windows are read from any layer-type spelling (``sliding``/``local``/``chunk``
  in the name) or, without ``layer_types``, from the window fields themselves.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from equivalence import equivalence_error  # noqa: E402
from hf_equivalence import (  # noqa: E402
    logits_error,
    run_packed,
    run_separately,
    separate_tolerance,
)
from hf_support import COMMON, hf_config  # noqa: E402
from model_batches import fill_rows  # noqa: E402

import exactstep.model.hf as hf  # noqa: E402
from exactstep.errors import ModelError  # noqa: E402
from exactstep.model.config import ModelConfig  # noqa: E402
from exactstep.model.decoder import build_model  # noqa: E402

VOCAB = 64
TOL = 1e-5  # R3
LEAK = 1e-3
SEQ_LEN = 24
DOC_LENGTHS = [[11, 12], [3, 17], [22]]  # documents longer than the windows (8)

# chunk 8 on every layer but the last (Llama 4's NoPE layer); floor_scale far away
LLAMA4 = {**hf_config("llama4"), "num_hidden_layers": 3, "no_rope_layer_interval": 3,
          "attention_chunk_size": 8}
MISTRAL = {**hf_config("mistral"), "sliding_window": 8}
GEMMA2 = {"model_type": "gemma2", **COMMON, "head_dim": 8, "final_logit_softcapping": None,
          "sliding_window": 8}
GPT_NEO = {"model_type": "gpt_neo", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
           "attention_types": [[["global", "local"], 1]], "window_size": 8,
           "max_position_embeddings": 64, "resid_dropout": 0.0, "embed_dropout": 0.0,
           "attention_dropout": 0.0}


def build(table: dict, attn: str = "sdpa", seed: int = 3):
    return build_model(ModelConfig(source="hf", hf_config=table, attn_implementation=attn),
                       VOCAB, seed=seed)


def equivalence(model, rows=None, seq_len: int = SEQ_LEN) -> float:
    """packed = separate, as a fraction of its tolerance (R3's ``TOL``, or twice fp32's
    own spread from float64 where that is larger: ``separate_tolerance``)."""
    rows = rows or fill_rows(DOC_LENGTHS, VOCAB, seed=1)
    model.train()
    separate = run_separately(model, rows)
    return equivalence_error(run_packed(model, rows, seq_len), separate) / separate_tolerance(
        TOL, model, rows, separate)


def without_windows(model) -> float:
    """WRONG on purpose: the packed rows' logits with the model's windows left out of
    the mask (what the adapter did before), against the documents alone."""
    rows = fill_rows(DOC_LENGTHS, VOCAB, seed=1)
    model.realised, model.refusals = frozenset(), ()
    return logits_error(run_packed(model, rows, SEQ_LEN)[0], run_separately(model, rows)[0])


# ------------------------------------------------------------------ realised windows


@pytest.mark.parametrize("name, table, attn", [
    ("llama4 chunked, sdpa", LLAMA4, "sdpa"),
    ("llama4 chunked, eager", LLAMA4, "eager"),
    ("mistral sliding", MISTRAL, "sdpa"),
    ("gemma2 sliding and full, eager", GEMMA2, "eager"),
])
def test_a_window_the_probe_crosses_is_realised_and_packed_equals_separate(name, table, attn):
    model = build(table, attn)
    window = min(w.size for ws in model.windows.values() for w in ws)
    assert window == 8 and model.realised  # realised, not refused
    model.check_rows(SEQ_LEN)  # rows three times the window are accepted
    assert equivalence(model) <= 1
    # negative control: the same rows with the window left out of the mask differ
    assert without_windows(model) > LEAK


def test_a_chunk_at_least_the_row_is_accepted_and_exact():
    model = build({**LLAMA4, "attention_chunk_size": SEQ_LEN})
    model.check_rows(SEQ_LEN)
    assert equivalence(model) <= 1
    model.realised, model.refusals = frozenset(), ()  # nothing for the mask to add
    assert equivalence(model) <= 1


def test_a_window_the_model_applies_itself_is_neither_realised_nor_refused():
    """GPT-Neo applies its local window inside its attention, by index (exact for a
    packed document), on its local layers only; ``window_size`` carries no layer
    types, so the probe first tries it on every layer, sees the global layers change,
    and then finds the model exact without it."""
    model = build(GPT_NEO, "eager")
    assert model.windows == {None: (hf.Window("window_size", "sliding", 8),)}
    assert not model.realised and not model.refusals
    model.check_rows(SEQ_LEN)
    assert equivalence(model) <= 1
    # negative control: the window realised on every layer (global ones too) differs
    model.realised = frozenset(model.windows[None])
    rows = fill_rows(DOC_LENGTHS, VOCAB, seed=1)
    assert logits_error(run_packed(model, rows, SEQ_LEN)[0],
                        run_separately(model, rows)[0]) > LEAK


# ------------------------------------------------------------------ refused windows


@pytest.mark.parametrize("table, field", [(LLAMA4, "attention_chunk_size"),
                                          (MISTRAL, "sliding_window")])
def test_a_window_beyond_the_probe_is_refused_naming_the_field(monkeypatch, table, field):
    monkeypatch.setattr(hf, "PROBE_WINDOW_LIMIT", 4)  # as if the window were too long
    model = build(table)
    assert not model.realised
    with pytest.raises(ModelError) as info:
        model.check_rows(9)
    message = str(info.value)
    assert f"{field} = 8" in message and "batch.seq_len = 9" in message
    assert "lower batch.seq_len to at most 8" in message and len(message.splitlines()) == 1
    # negative control: rows up to the window are accepted and exact
    model.check_rows(8)
    assert equivalence(model, fill_rows([[3, 4], [8]], VOCAB, seed=2), 8) <= 1


def test_the_probe_crosses_the_windows_and_catches_a_realisation_that_drops_them(monkeypatch):
    """Negative control of the probe's sizing: a realisation that leaves the chunk out
    passes a probe of short documents, but not the crossing one, so the model falls
    back to refusing rows longer than the chunk."""
    monkeypatch.setattr(hf, "windowed", lambda visible, positions, windows: visible)
    model = build(LLAMA4)
    assert not model.realised
    with pytest.raises(ModelError, match="attention_chunk_size = 8"):
        model.check_rows(9)
    lengths = hf.probe_lengths(model, crossing=True)
    assert lengths is not None and max(lengths) > 8  # the probe's documents cross the chunk


def test_the_windows_a_config_declares_are_read_from_any_spelling():
    def config(**kw):
        return SimpleNamespace(model_type="x", **kw)

    def sizes(cfg):
        return {key: [(w.field, w.kind, w.size) for w in ws]
                for key, ws in hf.windows_of(cfg).items()}

    assert sizes(config(sliding_window=8, layer_types=["local_sliding", "full_attention"])) == {
        "local_sliding": [("sliding_window", "sliding", 8)]}
    assert sizes(config(attention_chunk_size=16,
                        layer_types=["chunked_attention", "full_attention"])) == {
        "chunked_attention": [("attention_chunk_size", "chunked", 16)]}
    assert sizes(config(sliding_window=8, layer_types=["full_attention"])) == {}  # unused
    assert sizes(config(sliding_window=8, use_sliding_window=False)) == {}
    assert sizes(config(sliding_window=8)) == {None: [("sliding_window", "sliding", 8)]}
    assert sizes(config(window_size=256, attention_chunk_size=None)) == {
        None: [("window_size", "sliding", 256)]}
    with pytest.raises(ModelError, match="layer type 'sliding_attention'.*no window size"):
        hf.windows_of(config(layer_types=["sliding_attention"]))


# ------------------------------------------------------------------ position couplings


def test_llama4_attention_temperature_is_refused_from_floor_scale():
    """Llama 4 scales the queries of its NoPE layers by a function of the row index
    (not of position_ids): from row index floor_scale - 1 on, a packed document
    differs from itself alone."""
    table = {**LLAMA4, "attention_chunk_size": None, "floor_scale": 12, "attn_scale": 1.0}
    model = build(table)
    with pytest.raises(ModelError) as info:
        model.check_rows(12)
    assert "floor_scale = 12" in str(info.value) and "attn_temperature_tuning" in str(info.value)
    model.check_rows(11)
    assert equivalence(model, fill_rows([[4, 6], [11]], VOCAB, seed=2), 11) <= 1
    # negative control: past floor_scale the packed rows do differ (the reason it is refused)
    untuned = build({**table, "attn_temperature_tuning": False})
    untuned.check_rows(SEQ_LEN)  # without the temperature nothing is refused
    assert equivalence(untuned) <= 1
    model.row_limits = ()
    rows = fill_rows(DOC_LENGTHS, VOCAB, seed=1)
    assert logits_error(run_packed(model, rows, SEQ_LEN)[0],
                        run_separately(model, rows)[0]) > LEAK
