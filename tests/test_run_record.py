"""What a run writes about itself: the manifest (S1), the ledger (U4, U5) and a warm
start's record (S4), each checked against values written here, not read back from
the code that wrote them.

The run trains on a corpus of one sentence repeated: every document is the same 10
tokens, so every row packs exactly three of them and every window's content is
known without replaying the sampler. That makes each ledger field a closed form:
``D`` is 12 documents x 9 targets, the loss is the smoothed cross entropy of that
one document under the weights published before the window, the gradient norm is
the norm of its gradient, and the learning rate is the cosine schedule of the
committed-update count. ``update.fail_window`` makes one window a skip.

Negative controls: a schedule that also counts the skipped window, a norm taken
after clipping, a warm start that kept the parent's optimizer or schedule, and
weights that were not loaded, each fail the check the run passes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform

import pytest
import torch
import torch.nn.functional as F
from run_support import (
    TINY,
    TINY_MODEL,
    VOCAB,
    alone,
    cosine_lr,
    ledger,
    model_from,
    set_args,
    tokens_of,
    tree_digests,
    write_texts,
)

import exactstep
from exactstep import ByteTokenizer, RunConfig, build_model, load_corpus
from exactstep.cli import main
from exactstep.data.config import DataConfig
from exactstep.state import latest_checkpoint, load_checkpoint
from exactstep.update.config import UpdateConfig
from exactstep.update.groups import resolve_groups

pytestmark = pytest.mark.slow

SENTENCE = "owl hoot"  # 8 bytes -> BOS + 8 + EOS = 10 tokens
DOC = tokens_of(SENTENCE)
N_DOCS, VAL_FRACTION = 63, 0.2  # 48 train documents: whole windows in every epoch
STEPS, FAIL_WINDOW = 6, 3
PEAK, WARMUP, FLOOR, CLIP, SMOOTHING = 0.01, 2, 0.2, 0.5, 0.1
ROWS, ACCUM = TINY["batch.rows"], 2
DOCS_PER_ROW = TINY["batch.seq_len"] // len(DOC)  # 3 (2 padding slots per row)
WINDOW_D = ROWS * ACCUM * DOCS_PER_ROW * (len(DOC) - 1)  # 108: the boundary target is not one
U4_FIELDS = ("window", "disposition", "cause", "lr", "D", "loss", "grad_norm", "tokens")

DECLARED = {
    "seed": 5, "data.val_fraction": VAL_FRACTION, **TINY,
    "batch.boundary": "ignore", "batch.positions": "continue", "batch.overlong": "truncate",
    "objective.reduction": "token_mean", "objective.smoothing": "uniform",
    "objective.label_smoothing": SMOOTHING,
    "update.accum": ACCUM, "update.optimizer": "adamw", "update.lr": PEAK,
    "update.schedule": "cosine", "update.clock": "updates", "update.warmup": WARMUP,
    "update.min_lr_ratio": FLOOR, "update.clip": CLIP, "update.weight_decay": 0.05,
    "update.beta2": 0.99, "update.fail_window": FAIL_WINDOW,
    "numerics.precision": "fp32", "numerics.init_scale": 1024.0, "parallel.bucket_mb": 7,
    "train.steps": STEPS, "train.eval_tokens": 64,
    "checkpoint.every": 1, "checkpoint.keep": STEPS + 1,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    source = write_texts(root / "same.jsonl", [SENTENCE] * N_DOCS)
    corpus = load_corpus(DataConfig(source=str(source), val_fraction=VAL_FRACTION))
    assert len(corpus.train) % (ROWS * ACCUM * DOCS_PER_ROW) == 0  # no short row at an epoch end
    out = root / "run"
    argv = ["train", "--no-progress", "--out", str(out), "--set", f"data.source={source}",
            *set_args(DECLARED)]
    assert main(argv) == 0
    return out, source, corpus


def raw_manifest(run_dir) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def independent_digest(body: dict) -> str:
    """S1 canonical JSON spelled out: sorted keys, compact separators, UTF-8, one newline."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256((text + "\n").encode()).hexdigest()


def smoothed_loss(logits, targets) -> torch.Tensor:
    return F.cross_entropy(logits, targets, label_smoothing=SMOOTHING)


def objective_and_norm(model_state) -> tuple[float, float]:
    """The window objective (every document of the window is DOC) and its gradient's
    global L2 norm over unique parameters, from the published weights."""
    model = model_from(model_state).train()
    hidden = model(alone(DOC))[0]  # [n, H]
    loss = smoothed_loss(hidden[:-1] @ model.head_weight.t(), torch.tensor(DOC[1:]))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return float(loss.detach()), float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def weights_at(run_dir, window: int):
    return load_checkpoint(run_dir / "checkpoints" / f"window-{window:08d}")[0]


def expected_lrs() -> list[float | None]:
    """Cosine of the committed-update count; the skipped window has none and does not
    advance the clock (U4, U5). Horizon = train.steps (update.decay_steps = 0)."""
    out, committed = [], 0
    for w in range(STEPS):
        if w == FAIL_WINDOW:
            out.append(None)
            continue
        out.append(cosine_lr(committed, peak=PEAK, warmup=WARMUP, horizon=STEPS, floor=FLOOR))
        committed += 1
    return out


def lr_matches(recorded: list, expected: list) -> bool:
    return all((r is None and e is None) or (r is not None and e is not None
                                               and r == pytest.approx(e, rel=1e-12))
               for r, e in zip(recorded, expected, strict=True))


# ----------------------------------------------------------------------------- manifest


def test_manifest_declares_every_s1_section_with_the_configured_values(run) -> None:
    run_dir, source, corpus = run
    raw = raw_manifest(run_dir)
    body = raw["manifest"]
    assert raw["digest"] == independent_digest(body)
    assert {"data", "representation", "batch", "objective", "update", "numerics",
            "parallel", "seeds", "code"} <= set(body)
    assert "progress" not in body  # progress lives beside the manifest (S1)

    data = body["data"]
    assert data["source"] == corpus.source and str(source) in data["source"]
    assert data["fingerprint"] == corpus.fingerprint
    assert (data["train_documents"], data["val_documents"]) == (len(corpus.train), len(corpus.val))
    assert "split" in data
    rep = body["representation"]
    assert rep["special_ids"] == {"bos": 256, "eos": 257, "pad": 258}
    assert rep["tokenizer_hash"] == ByteTokenizer().fingerprint()

    declared = {key: value for key, value in DECLARED.items() if "." in key}
    # most declarations differ from the defaults, so a manifest of defaults fails here
    defaults = RunConfig().to_dict()
    changed = [k for k, v in declared.items() if defaults[k.split(".")[0]][k.split(".")[1]] != v]
    assert len(changed) >= 15, changed
    for key, value in declared.items():
        section, name = key.split(".")
        if section in ("batch", "objective", "update", "numerics", "parallel"):
            assert body[section][name] == value, key
    objective = body["objective"]
    assert (objective["family"], objective["shift_owner"], objective["ignore_index"]) == (
        "causal_lm", "collator", -100)
    assert objective["ownership"]

    update_cfg = UpdateConfig(**{k.split(".")[1]: v for k, v in declared.items()
                                 if k.startswith("update.")})
    digest = resolve_groups(build_model(TINY_MODEL, VOCAB, seed=0), update_cfg).digest
    assert body["update"]["group_digest"] == digest
    other = dataclasses.replace(update_cfg, decay_embeddings=True)  # negative control
    assert resolve_groups(build_model(TINY_MODEL, VOCAB, seed=0), other).digest != digest

    assert body["parallel"]["world_size"] == 1
    assert body["seeds"] == {"seed": DECLARED["seed"]}
    assert body["code"] == {"exactstep": exactstep.__version__,
                            "torch": torch.__version__.split("+")[0],
                            "python": platform.python_version()}
    # every checkpoint was written under this manifest (S2)
    _, parts = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert parts["progress"]["manifest_digest"] == raw["digest"]


# ----------------------------------------------------------------------------- ledger


def test_ledger_has_one_line_per_window_with_the_u4_fields(run) -> None:
    run_dir, _, _ = run
    lines = ledger(run_dir)
    assert [r["window"] for r in lines] == list(range(STEPS))
    for r in lines:
        assert set(U4_FIELDS) <= set(r)  # other fields (e.g. a gold NLL) may follow
        assert r["D"] == WINDOW_D and r["tokens"] == WINDOW_D
    dispositions = [(r["disposition"], r["cause"]) for r in lines]
    assert dispositions == [("COMMITTED", None)] * FAIL_WINDOW + [
        ("SKIPPED_NONFINITE", "INJECTED_FAULT")] + [("COMMITTED", None)] * (STEPS - FAIL_WINDOW - 1)
    assert lines[FAIL_WINDOW]["grad_norm"] == "nan" and lines[FAIL_WINDOW]["lr"] is None


def test_ledger_lr_is_the_closed_form_schedule_of_committed_updates(run) -> None:
    run_dir, _, _ = run
    recorded = [r["lr"] for r in ledger(run_dir)]
    assert lr_matches(recorded, expected_lrs())
    # negative control: a schedule advanced on every window (the skip included)
    by_window = [None if w == FAIL_WINDOW else
                 cosine_lr(w, peak=PEAK, warmup=WARMUP, horizon=STEPS, floor=FLOOR)
                 for w in range(STEPS)]
    assert not lr_matches(recorded, by_window)


def test_ledger_loss_and_grad_norm_are_the_window_objective(run) -> None:
    """Window w ran at the weights published after window w - 1 (checkpoint.every = 1);
    its loss is the smoothed token mean and its norm the pre-clip gradient norm."""
    run_dir, _, _ = run
    lines = ledger(run_dir)
    clipped_somewhere = False
    for w in range(1, STEPS):
        loss, norm = objective_and_norm(weights_at(run_dir, w))
        assert lines[w]["loss"] == pytest.approx(loss, rel=1e-5), w
        if w == FAIL_WINDOW:
            continue
        assert lines[w]["grad_norm"] == pytest.approx(norm, rel=1e-4), w
        clipped_somewhere |= norm > CLIP
        # negative control: the norm after clipping is another number whenever clipping bit
        if norm > CLIP:
            assert lines[w]["grad_norm"] != pytest.approx(min(norm, CLIP), rel=1e-4)
    assert clipped_somewhere


# ----------------------------------------------------------------------------- warm start


def test_warm_start_takes_the_weights_only_and_records_its_parent(run, tmp_path) -> None:
    """``exactstep resume RUN --warm-start NEW`` (S4): NEW starts from RUN's latest
    weights with a fresh optimizer, schedule and counters, records its parent, and
    leaves every byte of RUN as it was."""
    run_dir, _, _ = run
    before = tree_digests(run_dir)
    parent_name = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    parent_weights, parent_parts = load_checkpoint(run_dir / "checkpoints" / parent_name)
    new = tmp_path / "new"
    assert main(["resume", str(run_dir), "--warm-start", str(new), "--no-progress",
                 "--set", "train.steps=2"]) == 0
    assert tree_digests(run_dir) == before

    body = raw_manifest(new)["manifest"]
    assert body["parent"] == {"run_dir": str(run_dir), "checkpoint": parent_name,
                              "manifest_digest": raw_manifest(run_dir)["digest"]}
    assert raw_manifest(new)["digest"] != raw_manifest(run_dir)["digest"]  # a new run

    _, first = load_checkpoint(new / "checkpoints" / "window-00000001")
    fresh = {"steps": {1.0}, "scheduler": {"updates": 1, "tokens": WINDOW_D},
             "counters": {"committed": 1, "skipped": 0, "no_objective": 0,
                          "microbatches": ACCUM, "tokens": WINDOW_D}}
    assert fresh == state_summary(first)
    assert first["progress"]["next_window"] == 1
    assert first["progress"]["manifest_digest"] == raw_manifest(new)["digest"]
    # negative control: carrying the parent's optimizer, schedule or counters shows
    assert all(state_summary(parent_parts)[k] != v for k, v in fresh.items())

    lines = ledger(new)
    assert [r["window"] for r in lines] == [0, 1]
    assert lines[0]["lr"] == pytest.approx(
        cosine_lr(0, peak=PEAK, warmup=WARMUP, horizon=2, floor=FLOOR), rel=1e-12)
    # the first window ran at the parent's weights, not at a fresh initialisation
    loss, _ = objective_and_norm(parent_weights)
    assert lines[0]["loss"] == pytest.approx(loss, rel=1e-5)
    init = build_model(TINY_MODEL, VOCAB, seed=DECLARED["seed"]).state_dict()
    assert lines[0]["loss"] != pytest.approx(objective_and_norm(init)[0], rel=1e-3)


def state_summary(parts: dict) -> dict:
    """Optimizer step counts, schedule clocks and window counters of a checkpoint."""
    steps = {float(s["step"]) for s in parts["optimizer"]["state"].values()}
    return {"steps": steps, "scheduler": dict(parts["scheduler"]),
            "counters": {k: parts["counters"][k] for k in
                         ("committed", "skipped", "no_objective", "microbatches", "tokens")}}
