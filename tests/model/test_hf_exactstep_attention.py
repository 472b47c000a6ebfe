"""``attn_implementation = "exactstep"``: per-document attention for HF models (R3, U7).

* packed = separate: a packed batch (several documents per row, padding) under
  ``exactstep`` gives the per-document logits, the loss and every gradient of each
  document run alone through a separately built plain HF ``sdpa`` model with the
  same weights, and the hidden states of ``sdpa`` with the dense block mask (fp32,
  1e-5); Llama (GQA), Gemma, Qwen 3 (q/k norms), GPT-2 (learned positions), Gemma 3
  (``query_pre_attn_scalar``: a scaling other than ``1/sqrt(Dh)``). Negative
  controls: attention over the whole row leaks; Gemma 3's scaling dropped differs;
  HF's default ``head_dim ** -0.5``, one ulp off ``1/sqrt(Dh)`` in float64, costs no
  multiplication (it is 1 in float32);
* no ``[.., T, T]`` tensor is built in a training step (every operator's output
  recorded under a ``TorchDispatchMode``); negative control: under ``sdpa`` the
  recorder finds the dense mask; HF's search of ``position_ids`` for documents (a
  host sync) is never run; negative control: HF's own call runs it;
* HF's own calls without packed rows (a document alone, a padded 2D mask) give
  exactly ``sdpa``'s values; activation checkpointing reaches the visibility in its
  recomputation (gradients equal to without);
* ``model.attention = "auto"`` (the default) takes, per batch, the path the built-in
  decoder's cost model picks at the thread count in force: per document on one
  thread, the dense mask on two for rows of many small documents; both equal ``sdpa``;
* bad input, each one ``ModelError`` naming the fix: soft-capping, attention
  dropout, sinks, a model outside the attention interface, a row longer than a
  window, a mask or a missing visibility at the attention; the build-time probe
  refuses an ``exactstep`` whose documents leak.
"""

from __future__ import annotations

import copy
import math

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from equivalence import contract_tolerance, equivalence_error  # noqa: E402
from hf_equivalence import logits_error, run_packed, run_separately, separate_tolerance  # noqa: E402
from hf_support import COMMON, hf_config, hf_model  # noqa: E402
from model_batches import fill_rows, packed_batch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from exactstep.errors import ModelError  # noqa: E402
from exactstep.model import hf_attention  # noqa: E402
from exactstep.model.attention import attend, prepare_visibility, resolve_impl  # noqa: E402
from exactstep.model.config import ModelConfig  # noqa: E402
from exactstep.model.decoder import build_model  # noqa: E402

VOCAB = 64
TOL = 1e-5  # R3: fp32 (or fp32's own spread from float64, were it larger: contract_tolerance)
LEAK = 1e-3  # a negative control must move some value by more than this
DOC_LENGTHS = [[5, 9, 3], [12, 4], [1, 7]]  # no document fills a row of SEQ_LEN
SEQ_LEN = 18


def documents() -> list[list[list[int]]]:
    return fill_rows(DOC_LENGTHS, VOCAB, seed=1)


#: Gemma 3 scales queries by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``
GEMMA3 = {"model_type": "gemma3_text", **COMMON, "head_dim": 8, "query_pre_attn_scalar": 256}


def hidden_tolerance(dense, batch) -> float:
    """``TOL``, or twice the ``sdpa`` hidden states' own distance from float64."""
    with torch.no_grad():
        return contract_tolerance(TOL, [dense(batch)], [copy.deepcopy(dense).double()(batch)])


def pair(family: str | dict):
    """The same weights under ``exactstep`` and under ``sdpa`` (the reference)."""
    table = hf_config(family) if isinstance(family, str) else family
    ours, dense = (build_model(ModelConfig(source="hf", hf_config=table, attn_implementation=attn,
                                           attention="segments"),  # per document always
                               VOCAB, seed=3) for attn in ("exactstep", "sdpa"))
    assert ours.hf.config._attn_implementation == "exactstep"
    assert ours.initial_weights_sha256 == dense.initial_weights_sha256
    ours.train()
    dense.train()
    return ours, dense


#: one thread by default, the caller's count restored after (the auto test sets 1 and 2
#: itself); the tolerances are derived (``contract_tolerance``), not tied to the count
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ packed = separate


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen3", "gpt2",
                                    pytest.param(GEMMA3, id="gemma3")])
def test_packed_rows_equal_each_document_alone_through_plain_sdpa(family, monkeypatch):
    ours, dense = pair(family)
    rows = documents()
    separate = run_separately(dense, rows)  # HF's own sdpa forward, one document at a time
    packed = run_packed(ours, rows, SEQ_LEN)
    assert any(float(g.abs().max()) > 1e-4 for g in packed[2].values())  # not trivially 0
    tol = separate_tolerance(TOL, dense, rows, separate)
    assert equivalence_error(packed, separate) <= tol
    assert equivalence_error(packed, run_packed(dense, rows, SEQ_LEN)) <= tol  # dense mask
    batch = packed_batch(rows, SEQ_LEN)
    tol = hidden_tolerance(dense, batch)
    with torch.no_grad():
        assert float((ours(batch) - dense(batch)).abs().max()) <= tol  # hidden states
    # negative control: the same attention over whole rows lets documents see each other
    monkeypatch.setattr(hf_attention, "attend", lambda q, k, v, vis: F.scaled_dot_product_attention(
        q, k, v, is_causal=True))
    assert logits_error(run_packed(ours, rows, SEQ_LEN)[0], separate[0]) > LEAK


def test_a_scaling_other_than_the_default_is_applied(monkeypatch):
    """Gemma 3 scales queries by ``query_pre_attn_scalar ** -0.5`` (256), not by
    ``head_dim ** -0.5`` (8): dropping the scaling is caught."""
    ours, dense = pair(GEMMA3)
    layer = ours.hf.model.layers[0].self_attn
    assert layer.scaling == 256 ** -0.5 != 8 ** -0.5
    rows = documents()
    separate = run_separately(dense, rows)
    assert equivalence_error(run_packed(ours, rows, SEQ_LEN), separate) <= separate_tolerance(
        TOL, dense, rows, separate)
    undo = math.sqrt(8) * layer.scaling  # attend's 1/sqrt(Dh) of the queries, unscaled
    monkeypatch.setattr(hf_attention, "attend", lambda q, k, v, vis: attend(q / undo, k, v, vis))
    assert logits_error(run_packed(ours, rows, SEQ_LEN)[0], separate[0]) > LEAK


def test_the_default_scaling_spends_no_multiplication(monkeypatch):
    """HF's ``head_dim ** -0.5`` times ``sqrt(head_dim)`` is ``1 + 2**-52`` for a head
    dimension of 8 (and 32, 128): 1 in float32, so the queries reach ``attend``
    unmultiplied (the very tensor) and the output is bitwise that of no scaling.
    Negative control: Gemma 3's scaling multiplies them."""
    model = hf_model("llama", VOCAB, attn="exactstep")
    layer = model.hf.model.layers[0].self_attn
    assert layer.scaling == 8 ** -0.5 and layer.scaling * math.sqrt(8) != 1.0
    vis = prepare_visibility(packed_batch(documents(), SEQ_LEN), "segments", torch.device("cpu"))
    q, kv = torch.randn(3, 4, SEQ_LEN, 8), torch.randn(3, 4, SEQ_LEN, 8)
    seen = []
    monkeypatch.setattr(hf_attention, "attend",
                        lambda q, k, v, vis: seen.append(q) or attend(q, k, v, vis))
    outs = [hf_attention.attention(layer, q, kv, kv, None, scaling=scaling,
                                   exactstep_visibility=vis)[0]
            for scaling in (layer.scaling, None, 256 ** -0.5)]
    assert seen[0] is q and seen[1] is q and torch.equal(outs[0], outs[1])
    assert seen[2] is not q and not torch.equal(outs[2], outs[1])


# ----------------------------------------------------------------- no [B, 1, T, T] mask


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.shapes.append((str(func), tuple(value.shape)))
        return out


def square_tensors(model, batch) -> list[tuple[str, tuple[int, ...]]]:
    """Every operator output of a training step (forward, loss, backward) whose last
    two dimensions are ``T x T``."""
    T = batch.shape[1]
    with Shapes() as recorder:
        logits = model.logits(model(batch))
        F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100).backward()
    return [(op, shape) for op, shape in recorder.shapes if len(shape) >= 2 and shape[-2:] == (T, T)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_no_tensor_of_the_rows_square_is_built(family):
    ours, dense = pair(family)
    batch = packed_batch(documents(), SEQ_LEN)
    assert square_tensors(ours, batch) == []
    # negative control: the recorder sees sdpa's dense [B, 1, T, T] mask
    found = square_tensors(dense, batch)
    assert (len(DOC_LENGTHS), 1, SEQ_LEN, SEQ_LEN) in {shape for _, shape in found}


@torch.no_grad()
def test_auto_weighs_per_document_against_the_dense_mask_at_the_thread_count(monkeypatch):
    """16 rows of 256 holding documents of 4 tokens: at one thread per-document SDPA is
    cheaper, at two the dense mask (the built-in decoder's rule, ``resolve_impl``); the
    forward takes that path (seen at the attention) and equals ``sdpa``'s dense mask."""
    table = {**hf_config("llama"), "max_position_embeddings": 256}
    ours, dense = (build_model(ModelConfig(source="hf", hf_config=table, attn_implementation=attn),
                               VOCAB, seed=3) for attn in ("exactstep", "sdpa"))
    assert ours.attention == "auto"
    batch = packed_batch(fill_rows([[4] * 64] * 16, VOCAB, seed=2), 256)
    seen: list[str] = []
    real = hf_attention.attend
    monkeypatch.setattr(hf_attention, "attend",
                        lambda q, k, v, vis: seen.append(vis.impl) or real(q, k, v, vis))
    chosen = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        chosen[threads] = resolve_impl("auto", torch.device("cpu"), batch=batch, threads=threads)
        seen.clear()
        error = float((ours(batch) - dense(batch)).abs().max())
        assert set(seen) == {chosen[threads]}, threads
        assert error <= hidden_tolerance(dense, batch)
    assert chosen == {1: "segments", 2: "dense"}  # the test sees both paths


# ------------------------------------------------------------------ HF's own calls


def test_hf_calls_without_packed_rows_are_hf_sdpa_exactly():
    """Outside a packed forward (the probe's reference, an evaluation), the mask
    builder and the attention are HF's ``sdpa``: a document alone and a padded
    2D mask give bitwise the values of the ``sdpa`` model (the padding mask is not
    dropped)."""
    ours, dense = pair("llama")
    ours.eval()
    dense.eval()
    ids = torch.tensor([[3, 9, 4, 1, 7, 7], [5, 2, 8, 0, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        for kwargs in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}):
            mine = ours.hf(**kwargs, use_cache=False).logits
            theirs = dense.hf(**kwargs, use_cache=False).logits
            assert torch.equal(mine, theirs)
        unpadded = ours.hf(input_ids=ids, use_cache=False).logits
    # negative control: without the 2D mask the padded row's real tokens still agree
    # (causal), but its padding columns see the pad tokens differently: the mask mattered
    assert float((unpadded[1, 3:] - theirs[1, 3:]).abs().max()) > LEAK


def test_activation_checkpointing_recomputes_with_the_visibility():
    rows = documents()
    plain = hf_model("llama", VOCAB, seed=3, attn="exactstep")
    checkpointed = build_model(ModelConfig(source="hf", hf_config=hf_config("llama"),
                                           attn_implementation="exactstep",
                                           activation_checkpointing=True), VOCAB, seed=3)
    plain.train()
    checkpointed.train()
    a, b = run_packed(plain, rows, SEQ_LEN), run_packed(checkpointed, rows, SEQ_LEN)
    assert equivalence_error(a, b) == 0.0
    assert a[2].keys() == b[2].keys() and len(a[2]) > 0


# -------------------------------------------------------------------------- bad input


def build(table: dict, attn: str = "exactstep"):
    return build_model(ModelConfig(source="hf", hf_config=table, attn_implementation=attn),
                       VOCAB, seed=0)


@pytest.mark.parametrize("table, feature, fix", [
    ({"model_type": "gemma2", **COMMON, "head_dim": 8, "final_logit_softcapping": None},
     "attention logit soft-capping", "eager"),  # Gemma 2 has no sdpa
    ({**hf_config("llama"), "attention_dropout": 0.1}, "attention dropout", "sdpa"),
    ({"model_type": "gpt_oss", **COMMON, "head_dim": 8, "num_local_experts": 2,
      "num_experts_per_tok": 1}, "attention sinks", "eager"),
])
def test_a_feature_the_per_document_path_cannot_apply_is_one_model_error(table, feature, fix):
    with pytest.raises(ModelError) as info:
        build(table)
    message = str(info.value)
    assert feature in message and f"model.attn_implementation = '{fix}'" in message
    assert "\n" not in message


def test_a_model_outside_the_attention_interface_is_refused():
    table = {"model_type": "gpt_neo", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
             "attention_types": [[["global"], 2]], "max_position_embeddings": 64}
    with pytest.raises(ModelError, match="runs its own attention.*attn_implementation = 'eager'"):
        build(table)


def test_a_row_longer_than_a_window_is_refused_naming_sdpa():
    """exactstep realises no window: Mistral's sliding window of 8 is a refusal for
    rows longer than 8 (sdpa realises it); rows of 8 are exact."""
    model = build({**hf_config("mistral"), "sliding_window": 8})
    assert model.realised == frozenset() and [w.size for w in model.refusals] == [8]
    with pytest.raises(ModelError, match="sliding_window = 8.*model.attn_implementation = 'sdpa'"):
        model(packed_batch(fill_rows([[5, 9]], VOCAB), 14))
    model(packed_batch(fill_rows([[5, 3]], VOCAB), 8))


def test_the_attention_refuses_what_it_cannot_apply_and_a_missing_visibility():
    model = hf_model("llama", VOCAB, attn="exactstep")
    layer = model.hf.model.layers[0].self_attn
    batch = packed_batch(documents(), SEQ_LEN)
    vis = prepare_visibility(batch, "auto", torch.device("cpu"), head_dim=8)
    q = torch.randn(3, 4, SEQ_LEN, 8)
    kv = torch.randn(3, 2, SEQ_LEN, 8)
    out, weights = hf_attention.attention(layer, q, kv, kv, None, exactstep_visibility=vis)
    assert out.shape == (3, SEQ_LEN, 4, 8) and weights is None
    bad = [({"attention_mask": torch.ones(3, 1, SEQ_LEN, SEQ_LEN, dtype=torch.bool)}, "mask"),
           ({"dropout": 0.1}, "attention dropout"),
           ({"softcap": 30.0}, "soft-capping"),
           ({"s_aux": torch.zeros(4)}, "sinks")]
    for kwargs, what in bad:
        kwargs = {"attention_mask": None, **kwargs}
        with pytest.raises(ModelError, match=f"{what}.*model.attn_implementation = 'sdpa'"):
            hf_attention.attention(layer, q, kv, kv, exactstep_visibility=vis, **kwargs)
    with hf_attention.packed_forward(), pytest.raises(ModelError, match="keywords"):
        hf_attention.attention(layer, q, kv, kv, None)


def test_the_build_time_probe_refuses_a_leaking_exactstep(monkeypatch):
    """The probe runs for every backend: an ``exactstep`` whose attention spans the
    whole row is refused when the model is built."""
    monkeypatch.setattr(hf_attention, "attend", lambda q, k, v, vis: F.scaled_dot_product_attention(
        q, k, v, is_causal=True))
    with pytest.raises(ModelError, match="'exactstep' does not isolate packed documents"):
        hf_model("llama", VOCAB, attn="exactstep")


def test_a_packed_forward_never_searches_position_ids_for_documents(monkeypatch):
    """HF's ``find_packed_sequence_indices`` reads a device value (a host sync, U7);
    a packed forward under ``exactstep`` never calls it. Negative control: HF's own
    call with ``position_ids`` and no mask does."""
    import transformers.masking_utils as masking

    model = hf_model("llama", VOCAB, attn="exactstep")
    calls = []
    search = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices",
                        lambda position_ids: calls.append(1) or search(position_ids))
    batch = packed_batch(documents(), SEQ_LEN)
    with torch.no_grad():
        model(batch)
        assert calls == []
        model.hf(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    assert calls == [1]
