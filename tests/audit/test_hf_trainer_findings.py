"""Minimal reproductions of every FAIL that AUDIT.md claims for Hugging Face ``Trainer``.

Each test asserts what the declared contract wants and is marked ``xfail`` (not
strict) with the transformers version it was measured on: today it is an expected
failure; a release that changes the behaviour shows up as XPASS, a changed result,
without breaking the build. The stock ``Trainer`` runs here with its own dataloaders,
a tiny random-init ``LlamaForCausalLM`` built from a config (nothing downloaded).
The last tests are positive controls: what does pass, so a reproduction cannot pass
or fail for a reason of its own.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer's own requirement

from transformers import (  # noqa: E402
    DataCollatorForSeq2Seq,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from exactstep.audit.hf_trainer import tokenizer  # noqa: E402
from exactstep.audit.protocol import ProbeSpec  # noqa: E402

SPEC = ProbeSpec()
MEASURED = f"measured on transformers {transformers.__version__}; see AUDIT.md"


def finding(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=False, reason=f"{reason} ({MEASURED})")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def example(tokens: list[int], owned: list[bool] | None = None) -> dict:
    owned = owned if owned is not None else [False] + [True] * (len(tokens) - 1)
    return {"input_ids": tokens, "attention_mask": [1] * len(tokens),
            "labels": [t if o else -100 for t, o in zip(tokens, owned, strict=True)]}


def trainer(model, tmp_path, **overrides) -> Trainer:  # noqa: ANN001
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=2,
                per_device_eval_batch_size=1, learning_rate=0.01, weight_decay=0.1,
                num_train_epochs=1, report_to="none", save_strategy="no", use_cpu=True,
                logging_steps=1, disable_tqdm=True, remove_unused_columns=False,
                train_sampling_strategy="sequential")
    args.update(overrides)
    t = Trainer(model=model, args=TrainingArguments(**args),
                data_collator=DataCollatorForSeq2Seq(tokenizer(SPEC), padding=True))
    t.remove_callback(PrinterCallback)
    return t


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@finding("the default decay group includes the token embedding (only biases and norm "
         "weights are excluded), against the declared group of U6")
def test_the_embedding_is_not_decayed(tmp_path) -> None:
    model = tiny_llama()
    decayed = trainer(model, tmp_path).get_decay_parameter_names(model)
    assert "model.embed_tokens.weight" not in decayed


@finding("a window whose labels are all -100 still takes an optimizer step (weight "
         "decay moves the parameters) and logs a loss of 0.0 (L4)")
def test_a_window_without_targets_commits_nothing(tmp_path) -> None:
    model = tiny_llama()
    t = trainer(model, tmp_path, optim="adamw_torch")
    t.train_dataset = [example([1, 5, 6, 7], [False] * 4)] * 2
    before = params(model)
    t.train()
    logged = [e["loss"] for e in t.state.log_history if "loss" in e]
    assert all(torch.equal(before[n], p) for n, p in params(model).items())
    assert 0.0 not in logged


@finding("a step whose loss and gradients are NaN is applied (no skip without a loss "
         "scaler): the parameters become NaN (U4)")
def test_a_nonfinite_step_is_skipped(tmp_path) -> None:
    model = tiny_llama()
    t = trainer(model, tmp_path, learning_rate=0.5, weight_decay=0.0, optim="sgd")
    t.train_dataset = [example([1, 5, 6, 7, 8])] * 2
    before = params(model)
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: o * float("nan"))
    try:
        t.train()
    finally:
        hook.remove()
    assert all(torch.equal(before[n], p) for n, p in params(model).items())


def first_update_moves(model, tmp_path, warmup: int) -> bool:  # noqa: ANN001
    """One SGD update of ``constant_with_warmup``: did it change any parameter?"""
    t = trainer(model, tmp_path, learning_rate=0.5, weight_decay=0.0, optim="sgd",
                lr_scheduler_type="constant_with_warmup", warmup_steps=warmup)
    t.train_dataset = [example([1, 5, 6, 7, 8])] * 2
    before = params(model)
    t.train()
    return any(not torch.equal(before[n], p) for n, p in params(model).items())


@finding("the warmup starts at 0: with warmup_steps=N the first optimizer step is taken "
         "at lr 0 (update k at lr * k / N), one update behind the declared "
         "lr * (k + 1) / N, so the first update changes nothing under SGD (U5)")
def test_the_first_warmup_update_is_taken_at_a_nonzero_rate(tmp_path) -> None:
    assert first_update_moves(tiny_llama(), tmp_path, warmup=4)


@finding("Trainer.evaluate draws from the global torch RNG (its DataLoader seeds its "
         "iterator from it) and leaves the model in eval mode (E1)")
def test_evaluate_leaves_rng_and_mode_as_they_were(tmp_path) -> None:
    model = tiny_llama()
    t = trainer(model, tmp_path)
    model.train()
    rng = torch.get_rng_state()
    t.evaluate(eval_dataset=[example([1, 5, 6, 7, 8]), example([1, 9, 10])])
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training


@finding("eval_loss is a mean of per-batch mean losses, so exp(eval_loss) is not "
         "exp(total NLL / total tokens) when batches hold unequal token counts (L5)")
def test_eval_loss_is_the_token_mean(tmp_path) -> None:
    model = tiny_llama()
    rows = [example([1, 5, 6, 7, 8, 9, 10, 11, 12, 13]), example([1, 9, 10])]
    eval_loss = trainer(model, tmp_path).evaluate(eval_dataset=rows)["eval_loss"]
    nll, count = token_nll(model, rows)
    assert math.isclose(eval_loss, nll / count, rel_tol=1e-5)


@finding("with label_smoothing_factor set, evaluate() reports the smoothed loss (the "
         "label smoother runs in prediction_step too), not the gold NLL (L5)")
def test_eval_loss_is_gold_nll_when_training_smooths(tmp_path) -> None:
    model = tiny_llama()
    # the control's rows (equal batches, no weighting): that control passes unsmoothed
    rows = [example([1, 5, 6, 7, 8]), example([1, 9, 10, 11, 12])]
    t = trainer(model, tmp_path, label_smoothing_factor=0.2)
    eval_loss = t.evaluate(eval_dataset=rows)["eval_loss"]
    nll, count = token_nll(model, rows)
    assert math.isclose(eval_loss, nll / count, rel_tol=1e-5)


@finding("a finite loss with a non-finite gradient is stepped: no skip in fp32 (U4)")
def test_a_nonfinite_gradient_is_skipped(tmp_path) -> None:
    model = tiny_llama()
    t = trainer(model, tmp_path, learning_rate=0.5, weight_decay=0.0, optim="sgd")
    t.train_dataset = [example([1, 5, 6, 7, 8])] * 2
    before = params(model)
    hooks = [p.register_hook(lambda g: torch.full_like(g, float("nan")))
             for p in model.parameters()]
    try:
        t.train()
    finally:
        for hook in hooks:
            hook.remove()
    assert all(torch.equal(before[n], p) for n, p in params(model).items())


@finding("a packed row passed with a padding attention mask (what the padding "
         "collators produce) lets a document attend to the one before it (R2, R3)")
def test_a_packed_row_keeps_documents_apart_with_the_padding_mask() -> None:
    model = tiny_llama().eval()
    a, a2, b = [1, 5, 6, 7, 2], [1, 9, 10, 11, 2], [1, 12, 13, 14]
    with torch.no_grad():
        one = model(input_ids=torch.tensor([a + b]), attention_mask=torch.ones(1, 9,
                    dtype=torch.long)).logits[0, 5:]
        two = model(input_ids=torch.tensor([a2 + b]), attention_mask=torch.ones(1, 9,
                    dtype=torch.long)).logits[0, 5:]
    assert torch.equal(one, two)


# -- positive controls ------------------------------------------------------------------

def token_nll(model: torch.nn.Module, rows: list[dict]) -> tuple[float, int]:
    """Plain-PyTorch gold NLL sum and target count over rows (shifted once)."""
    nll, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            keep = labels != -100
            nll += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep],
                                                           reduction="sum"))
            count += int(keep.sum())
    return nll, count


def test_control_eval_loss_matches_the_token_mean_when_batches_are_equal(tmp_path) -> None:
    """With equal token counts per batch the mean of means is the token mean: the
    reproduction above fails for the weighting alone."""
    model = tiny_llama()
    rows = [example([1, 5, 6, 7, 8]), example([1, 9, 10, 11, 12])]
    eval_loss = trainer(model, tmp_path).evaluate(eval_dataset=rows)["eval_loss"]
    nll, count = token_nll(model, rows)
    assert math.isclose(eval_loss, nll / count, rel_tol=1e-5)


def flattened_b_logits(use_cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Document B's logits after two different documents A, in one flattened row."""
    model = tiny_llama().eval()
    a, a2, b = [1, 5, 6, 7, 2], [1, 9, 10, 11, 2], [1, 12, 13, 14]
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    with torch.no_grad():
        return tuple(model(input_ids=torch.tensor([x + b]), position_ids=pos,
                           use_cache=use_cache).logits[0, 5:] for x in (a, a2))


def test_control_flattened_documents_are_kept_apart_by_position_ids() -> None:
    """``DataCollatorWithFlattening``'s inputs (per-document position_ids, no mask)
    isolate the documents without the KV cache, as in training: the padding-mask
    reproduction is about the mask."""
    one, two = flattened_b_logits(use_cache=False)
    assert torch.equal(one, two)


@finding("with the KV cache on (use_cache=True, the config's default outside training) "
         "the same flattened inputs are not isolated: position_ids alone do not start a "
         "new document (R3)")
def test_flattened_documents_stay_apart_with_the_cache_on() -> None:
    one, two = flattened_b_logits(use_cache=True)
    assert torch.equal(one, two)


def resumed_and_straight(tmp_path, ignore_data_skip: bool) -> tuple[dict, dict]:  # noqa: ANN001
    """Parameters after 4 steps over 12 distinct rows in the Trainer's own random order
    (2 rows a step): straight, and 2 steps + ``resume_from_checkpoint`` + 2 more (a
    constant rate: the linear default would decay to 0 at each run's own ``max_steps``)."""
    data = [example([1] + [3 + (5 * i + j) % 13 for j in range(6)]) for i in range(12)]

    def run(out: str, max_steps: int, resume: str | None = None) -> dict:
        model = tiny_llama()
        t = trainer(model, tmp_path / out, optim="sgd", learning_rate=0.5, weight_decay=0.0,
                    lr_scheduler_type="constant", max_steps=max_steps, save_strategy="steps", save_steps=1,
                    train_sampling_strategy="random", ignore_data_skip=ignore_data_skip)
        t.train_dataset = data
        t.train(resume_from_checkpoint=resume)
        return params(model)

    straight = run("straight", 4)
    run("resumed", 2)
    return run("resumed", 4, str(tmp_path / "resumed" / "checkpoint-2")), straight


@finding("with ignore_data_skip=True (documented: faster, not the same results) a "
         "resumed run restarts its epoch at the first batch: it trains again on the "
         "batches before the checkpoint instead of the next ones (S2)")
def test_a_run_resumed_with_ignore_data_skip_continues_its_data(tmp_path) -> None:
    resumed, straight = resumed_and_straight(tmp_path, ignore_data_skip=True)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


def test_control_a_resumed_run_skips_the_batches_it_trained(tmp_path) -> None:
    """The default (``ignore_data_skip=False``) resumes bitwise: the reproduction above
    fails for the option alone."""
    resumed, straight = resumed_and_straight(tmp_path, ignore_data_skip=False)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


def test_control_the_first_update_moves_without_a_warmup(tmp_path) -> None:
    """Without a warmup the same single update changes the parameters: the warmup
    reproduction above fails for the rate alone."""
    assert first_update_moves(tiny_llama(), tmp_path, warmup=0)
