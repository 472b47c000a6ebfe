"""LoRA adapters through ``peft`` on an HF causal LM (H4, U6, S1).

Only the adapters train: the optimizer's groups, the clip set and the decay set are
exactly the trainable unique parameters; a real run leaves every base tensor bitwise
unchanged (negative control: without LoRA the same run moves them). One window of
the engine equals an independent computation: HF's own logits of a copy of the same
model, ``F.cross_entropy`` summed and divided by the window's supervised tokens,
``clip_grad_norm_`` and ``torch.optim.AdamW`` on the copy's adapters.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hf_support import hf_config, perturb_saved_weight  # noqa: E402
from run_support import TINY, set_args, train_catching  # noqa: E402
from text_corpus import write_corpus  # noqa: E402
from update.test_real_stack import real_engine, window_batches  # noqa: E402
from update.update_support import IGNORE_INDEX, make_batch  # noqa: E402

from exactstep.cli import main  # noqa: E402
from exactstep.config import load_config  # noqa: E402
from exactstep.errors import ConfigError, ModelError  # noqa: E402
from exactstep.model.config import LoRAConfig, ModelConfig  # noqa: E402
from exactstep.model.decoder import build_model  # noqa: E402
from exactstep.run.finished_run import open_finished_run  # noqa: E402
from exactstep.update.config import UpdateConfig  # noqa: E402
from exactstep.update.disposition import Outcome  # noqa: E402
from exactstep.update.groups import resolve_groups  # noqa: E402

VOCAB = 13  # test_real_stack's batches
BYTE_VOCAB = 259  # the byte tokenizer's
LR, CLIP, DECAY = 1e-2, 1.0, 0.1
#: absolute, on parameters ~0.1 after a step of ~1e-2, where fp32 can promise it. AdamW's
#: first step is ``lr * g / (|g| + eps)``: where ``|g|`` nears ``eps`` its slope
#: ``lr / eps`` turns the gradient's last-bit rounding into a visible part of the step,
#: by an amount that depends on the CPU's kernels. There the yardstick is measured, not
#: chosen: the independent window in float64 (see ``adapter_errors``). SGD's is ``lr * g``.
TOLERANCE = {"adamw": 2e-6, "sgd": 1e-8}


def lora_llama(vocab: int, lora: LoRAConfig, **overrides) -> torch.nn.Module:
    cfg = ModelConfig(source="hf", hf_config=hf_config("llama", vocab_size=vocab, **overrides),
                      lora=lora)
    return build_model(cfg, vocab, seed=3)


def test_only_the_adapters_are_trainable_and_grouped():
    model = lora_llama(VOCAB, LoRAConfig(r=4, target_modules="q_proj,v_proj"),
                       tie_word_embeddings=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # q_proj 32 -> 32, v_proj 32 -> 16 (2 kv heads of 8), 2 layers, rank 4: r * (in + out)
    expected = 2 * (4 * (32 + 32) + 4 * (32 + 16))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected == 896
    groups = resolve_groups(model, UpdateConfig(weight_decay=DECAY))
    assert {row["name"] for row in groups.table} == trainable
    assert {id(p) for p in groups.parameters} == {
        id(p) for p in model.parameters() if p.requires_grad}
    assert [g["name"] for g in groups.param_groups] == ["decay"]  # adapters are matrices
    plain = resolve_groups(lora_llama(VOCAB, LoRAConfig(), tie_word_embeddings=True),
                           UpdateConfig(weight_decay=DECAY))
    assert plain.numel > groups.numel and plain.digest != groups.digest


def test_all_linear_targets_every_projection_but_not_the_head():
    model = lora_llama(VOCAB, LoRAConfig(r=2))
    adapted = {n.split(".lora_A.")[0].rsplit(".", 1)[-1]
               for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"}
    assert not model.head_weight.requires_grad


def test_a_head_or_missing_target_is_refused():
    with pytest.raises(ModelError, match="output head"):
        lora_llama(VOCAB, LoRAConfig(r=2, target_modules="q_proj,lm_head"))
    with pytest.raises(ModelError, match="target_modules"):
        lora_llama(VOCAB, LoRAConfig(r=2, target_modules="no_such_proj"))


@pytest.mark.parametrize("bad", [{"r": -1}, {"alpha": 0.0}, {"dropout": 1.0},
                                 {"dropout": -0.1}, {"target_modules": " , "}])
def test_lora_ranges_are_validated(bad):
    with pytest.raises(ConfigError, match="model.lora"):
        LoRAConfig(**bad)


def test_the_adapter_init_is_seeded_and_leaves_the_global_rng_alone():
    before = torch.get_rng_state()
    a = lora_llama(VOCAB, LoRAConfig(r=2)).state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    b = lora_llama(VOCAB, LoRAConfig(r=2)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("loaded", [False, True])
def test_the_adapter_dropout_draws_in_training_and_not_in_evaluation(tmp_path, loaded):
    """From ``hf_config`` or from ``model.path``: a built model trains (its modules in
    training mode), so the declared dropout draws until evaluation switches it off."""
    from model.test_hf_manifest import saved_llama

    from exactstep.eval import eval_mode

    if loaded:
        saved_llama(tmp_path / "llama")
        cfg = ModelConfig(source="hf", path=str(tmp_path / "llama"),
                          lora=LoRAConfig(r=4, dropout=0.5))
        model = build_model(cfg, BYTE_VOCAB, seed=3)
    else:
        model = lora_llama(BYTE_VOCAB, LoRAConfig(r=4, dropout=0.5))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.fill_(0.1)
    batch = make_batch([[1, 2, 3, 4, 5]], [[2, 3, 4, 5, 6]])
    assert not torch.equal(model(batch), model(batch))
    with eval_mode(model), torch.no_grad():
        assert torch.equal(model(batch), model(batch))


def independent_window(twin, batches, optimizer_name: str) -> None:
    """One window on ``twin`` (a PeftModel) by plain PyTorch: the token mean of HF's own
    logits over the window, global-norm clipping and ``torch.optim.AdamW`` or ``SGD``
    with ``UpdateConfig``'s defaults."""
    params = [p for p in twin.parameters() if p.requires_grad]
    defaults = UpdateConfig()
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=DECAY, eps=defaults.eps,
                                      betas=(defaults.beta1, defaults.beta2))
    else:
        optimizer = torch.optim.SGD(params, lr=LR, weight_decay=DECAY,
                                    momentum=defaults.momentum)
    tokens = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
    total = 0.0
    for b in batches:
        logits = twin(input_ids=b.input_ids, use_cache=False).logits  # [B, T, V]
        total = total + F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
    (total / tokens).backward()
    torch.nn.utils.clip_grad_norm_(params, CLIP)
    optimizer.step()


def adapter_errors(ours: dict, theirs: dict, exact: dict, optimizer: str
                   ) -> list[tuple[str, float, float]]:
    """``(name, error, tolerance)`` for each adapter tensor where ``ours`` is further
    from ``theirs`` than its tolerance. Both are fp32 roundings of one computation whose
    float64 result is ``exact``; if ours rounds no worse than the independent fp32 one,
    ``|ours - theirs| <= |ours - exact| + |theirs - exact| <= 2 |theirs - exact|``
    (triangle inequality, max-abs per tensor). The tolerance is the larger of that and
    ``TOLERANCE``."""
    far = []
    for name, value in ours.items():
        if ".lora_" in name:
            rounding = float((theirs[name].double() - exact[name]).abs().max())
            tolerance = max(TOLERANCE[optimizer], 2 * rounding)
            error = float((value - theirs[name]).abs().max())
            if error > tolerance:
                far.append((name, error, tolerance))
    return far


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_one_window_equals_an_independent_step_on_the_adapters(optimizer):
    """Negative control: the engine's window at a learning rate 1% off is far from the
    same independent step (every adapter), under the same derived tolerances."""
    model = lora_llama(VOCAB, LoRAConfig(r=4, alpha=8.0))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():  # B starts at 0 (A's gradient would be 0): start elsewhere
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    twin, exact, control = copy.deepcopy(model.hf), copy.deepcopy(model.hf).double(), \
        copy.deepcopy(model)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    engine = real_engine(model, lr=LR, clip=CLIP, weight_decay=DECAY, optimizer=optimizer)
    batches = window_batches()
    assert engine.run_window(batches, 0).outcome == Outcome.COMMITTED
    independent_window(twin, batches, optimizer)
    independent_window(exact, batches, optimizer)  # the same window in float64

    ours = {k.removeprefix("hf."): v for k, v in model.state_dict().items()}
    theirs = twin.state_dict()
    assert ours.keys() == theirs.keys()
    assert adapter_errors(ours, theirs, exact.state_dict(), optimizer) == []
    moved = 0
    for name, value in ours.items():
        if ".lora_" in name:
            moved += not torch.equal(value, start["hf." + name])
        else:  # the base: bitwise unchanged in both
            assert torch.equal(value, start["hf." + name]) and torch.equal(theirs[name], value)
    assert moved == 28  # A and B of 7 projections in 2 layers

    off = real_engine(control, lr=LR * 1.01, clip=CLIP, weight_decay=DECAY,
                      optimizer=optimizer)
    assert off.run_window(batches, 0).outcome == Outcome.COMMITTED
    wrong = {k.removeprefix("hf."): v for k, v in control.state_dict().items()}
    assert len(adapter_errors(wrong, theirs, exact.state_dict(), optimizer)) == 28


# ------------------------------------------------------------------------ a real run


def run_args(corpus: Path, lora: dict) -> dict:
    rows = {k: v for k, v in TINY.items() if not k.startswith("model.")}
    table = json.dumps(hf_config("llama", vocab_size=BYTE_VOCAB))
    return {**rows, "data.source": corpus, "model.source": "hf", "model.hf_config": table,
            "train.steps": 3, "update.warmup": 0, "update.weight_decay": DECAY,
            "train.eval_tokens": 32, "train.threads": 1,
            **{f"model.lora.{k}": v for k, v in lora.items()}}


def trained_and_initial(tmp_path: Path, lora: dict) -> tuple[dict, dict, dict, Path]:
    """The initial state, the state of the very model the run trained (caught as it is
    built: a LoRA checkpoint holds no base to compare), the manifest's model section."""
    import exactstep.model.decoder as decoder_module

    corpus, run = tmp_path / "docs.jsonl", tmp_path / "run"
    write_corpus(corpus)
    pairs = run_args(corpus, lora)
    model = train_catching(decoder_module, "build_hf_model", ["train", "--out", str(run), "--no-progress",
                                              *set_args(pairs)])
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = load_config(overrides=[f"{k}={v}" for k, v in pairs.items()])
    initial = build_model(cfg.model, BYTE_VOCAB, seed=cfg.seed).state_dict()
    section = json.loads((run / "manifest.json").read_text())["manifest"]["model"]
    return initial, trained, section, run


def checkpoint_model(run: Path) -> dict:
    from exactstep.state.safetensors_format import load_checkpoint
    from exactstep.state.store import latest_checkpoint

    return load_checkpoint(latest_checkpoint(run / "checkpoints"))[0]


@pytest.mark.slow
def test_a_real_run_moves_only_the_adapters(tmp_path):
    initial, trained, section, run = trained_and_initial(
        tmp_path, {"r": 4, "alpha": 8.0, "dropout": 0.1})
    assert initial.keys() == trained.keys()
    base = [k for k in initial if ".lora_" not in k]
    adapters = [k for k in initial if ".lora_B." in k]
    assert base and adapters
    assert all(torch.equal(initial[k], trained[k]) for k in base)
    assert all(not torch.equal(initial[k], trained[k]) for k in adapters)
    lora = section["lora"]
    assert lora["base_weights_sha256"] == section["initial_weights_sha256"]
    # rank 4, 2 layers, r * (in + out): q, o 32 -> 32; k, v 32 -> 16; gate, up, down 32 <-> 64
    assert lora["adapter_parameters"] == 2 * 4 * (2 * 64 + 2 * 48 + 3 * 96) == 4096
    stored = checkpoint_model(run)  # the adapters only (S2, H4), as trained
    assert set(stored) == {k for k in initial if ".lora_" in k}
    assert all(torch.equal(stored[k], trained[k]) for k in stored)
    with open_finished_run(run) as finished:  # the base rebuilt, the adapters loaded
        reopened = finished.model.state_dict()
    assert all(torch.equal(reopened[k], trained[k]) for k in trained)
    check_merged_export(run, tmp_path, initial)
    check_adapter_export(run, tmp_path)


def check_merged_export(run: Path, tmp_path: Path, initial: dict) -> None:
    """``exactstep export`` of a LoRA run writes the merged model, which plain
    transformers loads as the base class (the export's own handoff check compared its
    logits with the trained model's, H3). Negative control: the adapters dropped
    instead of merged (``unload``) fail that check and nothing is published."""
    from exactstep.artifacts import export as export_module
    from exactstep.errors import ExportError

    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    passport = json.loads((out / "passport.json").read_text())
    assert passport["adapters"] == "merged" and passport["architecture"] == "LlamaForCausalLM"
    assert passport["check"]["max_abs_logit_diff"] <= passport["check"]["tolerance"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert not any("lora" in k for k in hf.state_dict())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(hf.state_dict()[q],
                           initial[f"hf.base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    dropped = tmp_path / "dropped"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_module, "hf_model_of", lambda model: copy.deepcopy(model.hf).unload())
        with pytest.raises(ExportError, match="logits differ"):
            export_module.export_run(run, dropped)
    assert not dropped.exists()


@pytest.mark.slow
def test_without_lora_the_same_run_moves_the_base(tmp_path):  # negative control
    initial, trained, section, run = trained_and_initial(tmp_path, {})
    with pytest.raises(ConfigError, match="--adapter writes LoRA adapters"):
        from exactstep.artifacts import export as export_module
        export_module.export_run(run, tmp_path / "adapter", adapter=True)
    assert "lora" not in section
    moved = [k for k in initial if not torch.equal(initial[k], trained[k])]
    assert "hf.model.layers.0.self_attn.q_proj.weight" in moved
    assert set(checkpoint_model(run)) == set(initial)  # the whole model


# ---------------------------------------------------------- manifest and resume (S1, S4, S5)


@pytest.mark.slow
def test_a_changed_base_refuses_resume_naming_its_digest(tmp_path, capfd):
    """The base comes from ``model.path``; one weight changed there after the run and the
    resume is refused naming the base digest (negative control: untouched, it resumes)."""
    from model.test_hf_manifest import saved_llama

    model_dir, run, corpus = tmp_path / "llama", tmp_path / "run", tmp_path / "docs.jsonl"
    saved_llama(model_dir)
    write_corpus(corpus)
    pairs = {**run_args(corpus, {"r": 2}), "model.path": model_dir, "train.steps": 2}
    del pairs["model.hf_config"]
    assert main(["train", "--out", str(run), "--no-progress", *set_args(pairs)]) == 0
    section = json.loads((run / "manifest.json").read_text())["manifest"]["model"]
    assert section["lora"]["base_weights_sha256"] == section["initial_weights_sha256"]
    assert main(["resume", str(run), "--no-progress"]) == 0  # negative control
    perturb_saved_weight(model_dir)
    capfd.readouterr()
    assert main(["resume", str(run), "--no-progress"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: ") and "model.lora.base_weights_sha256" in err, err


LORA_RUN = {"model.source": "hf", "model.hf_config": json.dumps(hf_config("llama")),
            "model.lora.r": 4, "model.lora.dropout": 0.25}


@pytest.mark.slow
def test_killed_and_resumed_lora_run_with_dropout_is_bitwise_identical_s5(tmp_path):
    """Straight = SIGKILLed twice and resumed, bitwise (the adapters' dropout masks come
    from the checkpointed RNG streams); a resume without the data cursor differs."""
    from families.test_family_kill_resume import FamilyHarness, bitwise_lineage, final_state

    from exactstep.state.compare import state_differences

    straight, defective, manifest = bitwise_lineage(FamilyHarness(tmp_path, LORA_RUN))
    state_a = final_state(straight)[1]
    assert manifest["config"]["model"]["lora"]["dropout"] == 0.25
    differences = state_differences(state_a, final_state(defective)[1])
    assert any(d.startswith("model.") and ".lora_" in d for d in differences)
    assert not any(d.startswith("model.") and ".lora_" not in d for d in differences)


def check_adapter_export(run: Path, tmp_path: Path) -> None:
    """``exactstep export --adapter`` writes a PEFT adapter directory holding only the
    adapters; peft loads it onto the base built again without LoRA, and the logits
    equal the trained model's. Negative control: adapters written with ``lora_B``
    zeroed fail the export's own check and nothing is published."""
    import peft
    from safetensors.torch import load_file, save_file

    from exactstep.artifacts import export as export_module
    from exactstep.errors import ExportError
    from exactstep.eval import eval_mode
    from exactstep.rows.batch import single_segment_batch

    out = tmp_path / "adapter"
    assert main(["export", str(run), "--out", str(out), "--adapter"]) == 0
    passport = json.loads((out / "passport.json").read_text())
    assert passport["adapters"] == "peft" and len(passport["base_weights_sha256"]) == 64
    tensors = load_file(out / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert not (out / "model.safetensors").exists()
    assert main(["export", "verify", str(out)]) == 0  # every digest the passport lists
    with open_finished_run(run) as finished:
        cfg, trained = finished.cfg, finished.model
        base_cfg = ModelConfig(source="hf", hf_config=cfg.model.hf_config)
        base = build_model(base_cfg, BYTE_VOCAB, seed=cfg.seed).hf
        loaded = peft.PeftModel.from_pretrained(base, out).eval()
        ids = torch.tensor([[1, 72, 101, 108, 108, 111]])
        with torch.no_grad(), eval_mode(trained):  # adapter dropout off
            expected = trained.logits(trained(single_segment_batch(ids)))
            error = float((loaded(input_ids=ids).logits - expected).abs().max())
    assert error <= 1e-5, error

    def zeroed(tmp, model, tokenizer, template):
        written = export_module_write(tmp, model, tokenizer, template)
        weights = {k: (torch.zeros_like(v) if ".lora_B." in k else v)
                   for k, v in load_file(tmp / "adapter_model.safetensors").items()}
        save_file(weights, tmp / "adapter_model.safetensors")
        return written

    export_module_write = export_module.write_adapter
    bad = tmp_path / "bad_adapter"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_module, "write_adapter", zeroed)
        with pytest.raises(ExportError, match="adapters on the base give logits"):
            export_module.export_run(run, bad, adapter=True)
    assert not bad.exists()


def test_activation_checkpointing_with_lora_recomputes_and_changes_nothing():
    """H5 with H4: one window with adapter dropout 0.25 and every block recomputed ends
    bitwise where the window without recomputation ends (dropout masks replayed); the
    recomputation happened (an adapted layer runs twice per microbatch, once without)."""
    ends, calls = {}, {}
    for checkpointing in (False, True):
        cfg = ModelConfig(source="hf", hf_config=hf_config("llama", vocab_size=VOCAB),
                          lora=LoRAConfig(r=4, dropout=0.25),
                          activation_checkpointing=checkpointing)
        model = build_model(cfg, VOCAB, seed=3)
        with torch.no_grad():  # B away from 0, so the dropout on A's input matters
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.fill_(0.05)
        count = [0]
        layer = model.hf.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
        layer.register_forward_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        torch.manual_seed(0)
        engine = real_engine(model, lr=LR, clip=CLIP, weight_decay=DECAY)
        assert engine.run_window(window_batches(), 0).outcome == Outcome.COMMITTED
        ends[checkpointing] = {k: v.clone() for k, v in model.state_dict().items()}
        calls[checkpointing] = count[0]
    assert calls == {False: 3, True: 6}
    assert ends[False].keys() == ends[True].keys()
    assert all(torch.equal(ends[False][k], ends[True][k]) for k in ends[False])


def test_the_checkpoint_state_is_the_adapters_and_loads_back_only_whole():
    """S2 under H4: ``checkpoint_state`` is the trainable tensors; loading it onto a fresh
    model restores them, and a state lacking an adapter or carrying a stranger is
    refused (negative controls)."""
    model = lora_llama(VOCAB, LoRAConfig(r=2, target_modules="q_proj"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.fill_(0.5)
    state = model.checkpoint_state()
    assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad}
    fresh = lora_llama(VOCAB, LoRAConfig(r=2, target_modules="q_proj"))
    fresh.load_checkpoint_state(state)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    lacking = dict(state)
    lacking.pop(sorted(lacking)[0])
    with pytest.raises(ModelError, match="1 adapter tensor"):
        fresh.load_checkpoint_state(lacking)
    with pytest.raises(ModelError, match="1 unexpected"):
        fresh.load_checkpoint_state({**state, "hf.stranger": torch.zeros(1)})
