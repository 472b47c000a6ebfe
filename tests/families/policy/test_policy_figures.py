"""The policy window's ledger figures, and a LoRA policy's frozen-base reference (Q2, H4, U6).

- Entropy: each record's ``entropy_sum`` (from the sampler's own logits, no second
  forward) against an independent float64 computation: a whole-row forward of the same
  model over prompt + response, ``torch.distributions.Categorical(...).entropy()`` at the
  positions that drew each sampled token. Tolerance: the entropy's slope in the logits,
  ``sum_v p_v |log p_v + H|``, times a bound on how far two fp32 computations of the same
  logits (cached columns vs whole rows) may differ, ``2^-20 (1 + max |z|)`` (16 fp32
  ulps of the largest logit). Negative
  controls: the entropy of the next position's distribution, and of the tempered
  (temperature 2) distribution, are outside it.
- KL: the window's ``kl_k1`` / ``kl_k3`` (the mean per sampled token of ``log pi - log
  pi_ref`` and ``r - log r - 1``, ``r = pi_ref / pi``) against float64 forwards of both
  models; negative controls: k1 with its sign flipped, k3 with ``r`` inverted.
- Zero-advantage groups: with ``leave_one_out``, a group has every advantage 0 exactly
  when its rewards are equal; the count is checked against the groups whose journalled
  completions give equal rewards (the reward recomputed from the text). Negative
  control: with ``baseline = none`` only all-zero groups count, a different number.
- LoRA: over an HF model with ``model.lora`` and ``policy.kl`` (no ``policy.reference``),
  the reference is the policy's own base with peft's adapters disabled: its log-probs
  equal a separately built base model's bitwise, after windows that moved the adapters
  (negative control: the policy's own log-probs differ); the process holds one copy of
  the base (every parameter of the reference is the policy's, by ``data_ptr``, and no
  second tensor of the embedding's shape lives; negative control: a reference loaded as
  its own module is a second one); only adapters train (the optimizer's groups hold
  adapters only; every base tensor bitwise unchanged), and the manifest says
  ``base_without_adapters``.
"""

from __future__ import annotations

import gc
import json
import math
import textwrap
from dataclasses import replace

import pytest
import torch
from families.policy.test_policy_run import TINY_POLICY, window_of
from model.hf_support import hf_config

from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.generation.sampler import Continuation, prompt_batch
from exactstep.model.lora import adapter_names
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

CPU = torch.device("cpu")
PARITY = textwrap.dedent('''
    def parity(prompt, completion, reference):
        return float(sum(map(ord, completion)) % 2)
''')


@pytest.fixture
def parity(tmp_path, monkeypatch):
    (tmp_path / "policy_parity.py").write_text(PARITY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "policy_parity:parity"


def setup(extra: dict):
    cfg = resolve(load_config(None, [f"{k}={v}" for k, v in {**TINY_POLICY, **extra}.items()]))
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    return cfg, parts, model


@torch.no_grad()
def position_logits(model, program, record) -> tuple[list[int], torch.Tensor]:
    """The sampled tokens of ``record`` and the float64 logits ``[n + 1, V]`` of the
    whole-row forward at the positions that drew them (and the one after)."""
    r = program.request(record["example"], None)
    tokens = list(record["token_ids"])
    row = torch.tensor([list(r.context) + tokens], dtype=torch.int64)
    model.eval()
    hidden = model(prompt_batch(row, None, 0))  # [1, L, H]
    start = len(r.context) - 1
    return tokens, model.logits(hidden[:, start:, :])[0].double()


def with_token_ids(program, batches, info):
    """The window's records, each with its sampled token ids (from the trajectory rows)."""
    rows = [b.labels[i][b.labels[i] != -100].tolist() for b in batches
            for i in range(b.labels.shape[0])]
    return [{**rec, "token_ids": ids} for rec, ids in zip(program.records, rows, strict=True)]


def test_the_entropy_is_of_each_sampled_tokens_distribution(parity):
    cfg, parts, model = setup({"policy.reward": parity, "policy.baseline": "leave_one_out"})
    program = parts.family.program(cfg, parts, model, CPU)
    batches, info = program.prepare(model, window_of(parts, [list(range(8))]), clock=0,
                                    window=0, device=CPU)
    records = with_token_ids(program, batches, info)
    errors = {"right": [], "next position": [], "tempered": []}
    tol = []
    for rec in records:
        tokens, z = position_logits(model, program, rec)
        n = len(tokens)
        logp = torch.log_softmax(z, -1)
        h = torch.distributions.Categorical(logits=z).entropy()  # [n + 1]
        slope = (logp.exp() * (logp + h[:, None]).abs()).sum(-1)
        bound = float((slope[:n] * 2.0 ** -20 * (1 + z[:n].abs().max(-1).values)).sum())
        tol.append(bound)
        errors["right"].append(abs(rec["entropy_sum"] - math.fsum(h[:n].tolist())))
        errors["next position"].append(abs(rec["entropy_sum"] - math.fsum(h[1:].tolist())))
        hot = torch.distributions.Categorical(logits=z[:n] / 2).entropy()
        errors["tempered"].append(abs(rec["entropy_sum"] - math.fsum(hot.tolist())))
    assert all(e <= t for e, t in zip(errors["right"], tol, strict=True))
    assert any(e > t for e, t in zip(errors["next position"], tol, strict=True))
    assert any(e > t for e, t in zip(errors["tempered"], tol, strict=True))
    tokens = sum(r["tokens"] for r in records)
    assert info["entropy_mean"] == math.fsum(r["entropy_sum"] for r in records) / tokens


def test_the_kl_figures_are_the_mean_k1_and_k3_per_sampled_token(parity):
    cfg, parts, model = setup({"policy.reward": parity})
    reference = parts.family.build_model(replace(cfg, seed=cfg.seed + 1),
                                         parts.tokenizer.vocab_size).eval()
    with torch.no_grad():  # a reference far from the policy: log-ratios of order 1
        for p in reference.parameters():
            p.mul_(4.0)
    program = parts.family.program(cfg, parts, model, CPU)
    program.policy = replace(program.policy, kl="k1", beta=0.1)
    program.reference = reference
    batches, info = program.prepare(model, window_of(parts, [list(range(8))]), clock=0,
                                    window=0, device=CPU)
    records = with_token_ids(program, batches, info)
    k1, k3, flipped, inverted, tol = [], [], [], [], 0.0
    for rec in records:
        tokens, z = position_logits(model, program, rec)
        _, zr = position_logits(reference, program, rec)
        idx = torch.tensor(tokens)[:, None]
        lp = torch.log_softmax(z[:len(tokens)], -1).gather(1, idx)[:, 0]
        lr = torch.log_softmax(zr[:len(tokens)], -1).gather(1, idx)[:, 0]
        k1 += (lp - lr).tolist()
        k3 += ((lr - lp).exp() - (lr - lp) - 1).tolist()
        flipped += (lr - lp).tolist()
        inverted += ((lp - lr).exp() - (lp - lr) - 1).tolist()
        # the sampler's fp32 logits (cached columns) against the whole rows' differ by
        # at most delta = 2^-20 (1 + max |z|) (16 fp32 ulps of the largest logit); a
        # log-softmax moves by at most 2 delta, and k3's slope in log pi is |1 - r|
        delta = 2.0 ** -20 * (1 + float(z.abs().max()))
        slope = 1 + float((lr - lp).exp().max())
        tol += 2 * delta * slope * len(tokens)
    n = len(k1)
    tol = tol / n  # the mean per sampled token
    want1, want3 = math.fsum(k1) / n, math.fsum(k3) / n
    assert abs(info["kl_k1"] - want1) <= tol and abs(info["kl_k3"] - want3) <= tol
    assert abs(info["kl_k1"] - math.fsum(flipped) / n) > tol  # negative controls
    assert abs(info["kl_k3"] - math.fsum(inverted) / n) > tol


def test_zero_advantage_groups_are_the_groups_of_equal_rewards(parity):
    cfg, parts, model = setup({"policy.reward": parity, "policy.baseline": "leave_one_out",
                               "generation.samples": 3})
    program = parts.family.program(cfg, parts, model, CPU)
    _, info = program.prepare(model, window_of(parts, [list(range(8)), list(range(8, 16))]),
                              clock=0, window=0, device=CPU)
    groups = [program.records[i:i + 3] for i in range(0, len(program.records), 3)]
    equal = sum(len({sum(map(ord, r["completion"])) % 2 for r in g}) == 1 for g in groups)
    assert info["groups"] == 16 and info["zero_advantage_groups"] == equal
    assert 0 < equal < 16  # both kinds present, so a count of all or none is caught
    # negative control: without a baseline the advantage is the reward itself, so only
    # the groups of all-zero rewards count; an equal-rewards count would be caught
    program.policy = replace(program.policy, baseline="none")
    _, info = program.prepare(model, window_of(parts, [list(range(8)), list(range(8, 16))]),
                              clock=0, window=0, device=CPU)
    zeros = sum(all(sum(map(ord, r["completion"])) % 2 == 0 for r in g) for g in groups)
    assert info["zero_advantage_groups"] == zeros != equal


# ------------------------------------------------------------------------- LoRA policy


LORA = {"model.source": "hf", "model.hf_config": json.dumps(hf_config("llama", vocab_size=259,
                                                                max_position_embeddings=256)),
        "model.lora.r": 4, "model.lora.alpha": 8, "model.lora.target_modules": "all-linear",
        "policy.kl": "k1", "policy.beta": 0.1, "update.lr": 0.05, "update.warmup": 0}


def embedding_copies(shape) -> int:
    """How many distinct storages the live tensors of ``shape`` hold (views and the
    state dict's entries share their parameter's)."""
    gc.collect()
    return len({o.untyped_storage().data_ptr() for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and not o.is_meta and tuple(o.shape) == shape})


@pytest.mark.slow
def test_a_lora_policy_refers_to_its_own_base_without_a_second_copy(parity):
    pytest.importorskip("peft")
    cfg, parts, model = setup({**LORA, "policy.reward": parity, "policy.baseline": "none"})
    assert parts.family.objective(cfg)["reference"] == "base_without_adapters"
    base_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    adapters = adapter_names(model)
    optimizer, _ = build_optimizer(model, cfg.update)
    in_groups = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_groups == {id(p) for n, p in model.named_parameters() if n in adapters}
    program = parts.family.program(cfg, parts, model, CPU)
    engine = UpdateEngine(model, optimizer, build_schedule(cfg.update, 3),
                          Precision(cfg.numerics, "cpu"), cfg.update, cfg.objective,
                          device="cpu", pad_id=parts.tokenizer.pad_id,
                          plan=parts.family.plan(cfg, 0), program=program)
    for w in range(3):
        ids = [list(range(4 * w, 4 * w + 4))]
        assert engine.run_window(window_of(parts, ids), w).outcome is Outcome.COMMITTED
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # the base stayed
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters()
               if "lora_B" in n)  # the adapters moved (B starts at 0)
    del base_before, after
    # one copy of the base: the reference's parameters are the policy's own storage
    ref_ptrs = {p.data_ptr() for m in program.reference.modules() for p in
                m.parameters(recurse=False)}
    assert ref_ptrs == {p.data_ptr() for p in model.parameters()}
    shape = tuple(model.head_weight.shape)
    own = len({p.untyped_storage().data_ptr() for p in model.parameters()
               if tuple(p.shape) == shape})  # the embedding, and the head when untied
    assert embedding_copies(shape) == own
    # its log-probs equal a separately built base model's (the same seed, no adapters)
    plain_cfg = replace(cfg, model=replace(cfg.model, lora=replace(cfg.model.lora, r=0)))
    base = parts.family.build_model(plain_cfg, parts.tokenizer.vocab_size).eval()
    assert embedding_copies(shape) == 2 * own  # negative control: a second copy is seen
    records = with_token_ids(program, *program.prepare(
        model, window_of(parts, [[20, 21]]), clock=3, window=3, device=CPU))
    moved = 0
    for rec in records:
        if not rec["token_ids"]:
            continue
        r = program.request(rec["example"], None)
        c = Continuation(tuple(rec["token_ids"]), (), False)
        theirs = program.reference_logprobs(r, c, CPU)
        tokens, z = position_logits(base, program, rec)
        _, zp = position_logits(model, program, rec)
        idx = torch.tensor(tokens)[:, None]
        want = torch.log_softmax(z[:len(tokens)].float().double(), -1).gather(1, idx)[:, 0]
        own = torch.log_softmax(zp[:len(tokens)], -1).gather(1, idx)[:, 0]
        assert max(abs(a - b) for a, b in zip(theirs, want.tolist(), strict=True)) <= \
            2.0 ** -40  # float64 log-softmax of the same fp32 logits
        moved += int(not torch.allclose(own, want, atol=1e-6, rtol=0))  # negative control
    assert moved > 0


# ------------------------------------------------------- a head wider than the tokenizer


def test_a_head_wider_than_the_tokenizer_samples_its_padded_rows_and_journals_them(parity):
    """An HF model whose vocabulary (1,024 rows) is padded past the byte tokenizer's
    259 ids (as the Qwen-shaped demo's 151,936) samples from its own softmax over every
    row; the window trains, and a padded id reaches the reward and the journal as
    ``<id:N>`` text, never dropped (the journal's ids stay the drawn ones). Negative
    control: the tokenizer's own decode refuses those ids."""
    from exactstep.errors import DataError

    wide = {"model.source": "hf", "model.hf_config": json.dumps(
        hf_config("llama", vocab_size=1024, max_position_embeddings=256))}
    cfg, parts, model = setup({**wide, "policy.reward": parity, "policy.baseline": "none"})
    program = parts.family.program(cfg, parts, model, CPU)
    optimizer, _ = build_optimizer(model, cfg.update)
    engine = UpdateEngine(model, optimizer, build_schedule(cfg.update, 1),
                          Precision(cfg.numerics, "cpu"), cfg.update, cfg.objective,
                          device="cpu", pad_id=parts.tokenizer.pad_id,
                          plan=parts.family.plan(cfg, 0), program=program)
    seen = []
    prepare = program.prepare
    program.prepare = lambda *a, **kw: seen.append(prepare(*a, **kw)) or seen[-1]
    disposition = engine.run_window(window_of(parts, [[0, 1]]), 0)
    assert disposition.outcome in (Outcome.COMMITTED, Outcome.NO_OBJECTIVE)
    batches, _ = seen[0]
    drawn = [int(t) for b in batches for t in b.labels[b.meta["policy"].sampled].tolist()]
    padded = [t for t in drawn if t >= parts.tokenizer.vocab_size]
    assert padded, "a random 1,024-row head draws its padded rows"
    text = "".join(r["completion"] for r in program.records)
    assert all(f"<id:{t}>" in text for t in padded)
    assert text.count("<id:") == len(padded)  # one per drawn padded id (stop ids excluded)
    with pytest.raises(DataError):
        parts.tokenizer.decode(padded[:1])
