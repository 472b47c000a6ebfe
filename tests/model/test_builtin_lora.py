"""LoRA adapters through ``peft`` on the built-in decoder (H4, U6, S2, S4, S5).

Only the adapters train: the optimizer's groups, the clip set and the decay set are
exactly the trainable unique parameters, and the model keeps its class, forward and
head. One window of the engine equals an independent computation: the plain decoder
run with weights ``W + (alpha / r) B A`` formed by hand, ``F.cross_entropy`` summed
over the window and divided by its supervised tokens, ``clip_grad_norm_`` (the
gradients the optimizer steps on), then ``torch.optim.AdamW`` on ``A`` and ``B``. A real run leaves every base tensor bitwise
unchanged (negative control: without LoRA it moves them), checkpoints the adapters
only, refuses to resume onto another base, resumes bitwise after SIGKILLs and exports
a merged Llama that plain transformers loads with the same logits.
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from equivalence import gamma, matmul_bound  # noqa: E402
from run_support import TINY, set_args, train_catching  # noqa: E402
from text_corpus import write_corpus  # noqa: E402
from update.test_compile import TOLERANCE, relative  # noqa: E402
from update.test_real_stack import real_engine, window_batches  # noqa: E402
from update.update_support import IGNORE_INDEX  # noqa: E402

from exactstep.cli import main  # noqa: E402
from exactstep.config import load_config  # noqa: E402
from exactstep.errors import ConfigError, ModelError  # noqa: E402
from exactstep.model.config import LoRAConfig, ModelConfig  # noqa: E402
from exactstep.model.decoder import Decoder, build_model  # noqa: E402
from exactstep.model.hf import weights_digest  # noqa: E402
from exactstep.update.config import UpdateConfig  # noqa: E402
from exactstep.update.disposition import Outcome  # noqa: E402
from exactstep.update.groups import resolve_groups  # noqa: E402

VOCAB = 13  # test_real_stack's batches
BYTE_VOCAB = 259  # the byte tokenizer's
LR, CLIP, DECAY = 1e-2, 1.0, 0.1
SMALL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 24}
LINEAR = {"qkv": (16, 48), "out": (16, 16), "gate_up": (16, 48), "down": (24, 16)}


def lora_decoder(lora: LoRAConfig, vocab: int = VOCAB, **overrides) -> Decoder:
    return build_model(ModelConfig(**{**SMALL, **overrides}, lora=lora), vocab, seed=3)


def test_only_the_adapters_are_trainable_and_grouped():
    """U6 under H4: the trainable parameters are the adapters of every block linear
    layer (``all-linear``: never the head), the groups (hence the clip and decay sets)
    are exactly they; the class and the tied head stay. Negative control: without
    LoRA the groups hold the base."""
    for tie in (True, False):
        model = lora_decoder(LoRAConfig(r=4), tie_embeddings=tie)
        assert type(model) is Decoder
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
        assert adapted == set(LINEAR)
        assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
        expected = 2 * sum(4 * (i + o) for i, o in LINEAR.values())  # r * (in + out), 2 layers
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected == 1600
        assert not model.head_weight.requires_grad
        assert (model.head_weight is model.embed.weight) == tie
        groups = resolve_groups(model, UpdateConfig(weight_decay=DECAY))
        assert {row["name"] for row in groups.table} == trainable
        assert {id(p) for p in groups.parameters} == {
            id(p) for p in model.parameters() if p.requires_grad}
        assert [g["name"] for g in groups.param_groups] == ["decay"]  # adapters are matrices
    plain = resolve_groups(lora_decoder(LoRAConfig()), UpdateConfig(weight_decay=DECAY))
    assert plain.numel == lora_decoder(LoRAConfig()).num_parameters() > groups.numel


def test_named_targets_and_refusals():
    model = lora_decoder(LoRAConfig(r=2, target_modules="qkv,down"))
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1]
            for n, p in model.named_parameters() if p.requires_grad} == {"qkv", "down"}
    with pytest.raises(ModelError, match="output head"):
        lora_decoder(LoRAConfig(r=2, target_modules="qkv,head"), tie_embeddings=False)
    with pytest.raises(ModelError, match="output head"):  # tied: the embedding is the head
        lora_decoder(LoRAConfig(r=2, target_modules="embed"))
    with pytest.raises(ModelError, match="target_modules.*linear layers are down, gate_up"):
        lora_decoder(LoRAConfig(r=2, target_modules="q_proj"))


def test_lora_is_accepted_for_the_decoder_and_refused_where_no_adapter_goes():
    """The configuration takes LoRA on the built-in decoder now; the encoder-decoder
    and two-stream models refuse it with one ``ConfigError`` naming the key."""
    from exactstep.model.encdec import EncoderDecoder
    from exactstep.model.permutation import TwoStreamDecoder

    cfg = ModelConfig(**SMALL, lora=LoRAConfig(r=2))
    assert cfg.lora.enabled
    for cls in (EncoderDecoder, TwoStreamDecoder):
        with pytest.raises(ConfigError, match=r"^model\.lora\.r = 2 .*set model\.lora\.r = 0$"):
            cls(cfg, VOCAB)
        cls(ModelConfig(**SMALL), VOCAB)  # negative control: without LoRA it builds


def test_the_adapter_init_is_seeded_and_leaves_the_global_rng_alone():
    before = torch.get_rng_state()
    a = lora_decoder(LoRAConfig(r=2)).state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    b = lora_decoder(LoRAConfig(r=2)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = build_model(ModelConfig(**SMALL, lora=LoRAConfig(r=2)), VOCAB, seed=4).state_dict()
    name = "layers.0.attn.qkv.lora_A.default.weight"
    assert not torch.equal(a[name], other[name])  # the seed decides the init
    base = build_model(ModelConfig(**SMALL), VOCAB, seed=3).state_dict()
    assert all(torch.equal(a[k.replace(".weight", ".base_layer.weight")
                             if k.rsplit(".", 2)[-2] in LINEAR else k], v)
               for k, v in base.items())  # the base is the model built without LoRA


def adamw(start: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
          ) -> dict[str, torch.Tensor]:
    """``torch.optim.AdamW`` (``UpdateConfig``'s defaults) stepped once on ``grads``
    from ``start``, in their dtype."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in start.items()}
    defaults = UpdateConfig()
    optimizer = torch.optim.AdamW(list(leaves.values()), lr=LR, weight_decay=DECAY,
                                  eps=defaults.eps, betas=(defaults.beta1, defaults.beta2))
    for k, leaf in leaves.items():
        leaf.grad = grads[k].to(leaf.dtype).clone()
    optimizer.step()
    return {k: v.detach() for k, v in leaves.items()}


def independent_window(model: Decoder, batches, lora: LoRAConfig, dtype=torch.float32
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One window by plain PyTorch: the decoder without adapters, run (``functional_call``)
    with each adapted weight replaced by ``W + (alpha / r) B @ A`` from leaf tensors
    ``A``, ``B``; the token mean of the window's cross-entropy, ``clip_grad_norm_`` and
    ``torch.optim.AdamW`` (``UpdateConfig``'s defaults) on the ``A``s and ``B``s, all in
    ``dtype``. Returns the clipped gradients and the stepped adapters under the model's
    names."""
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    plain = build_model(ModelConfig(**SMALL), VOCAB, seed=3).to(dtype)  # same base, no peft
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in state.items()
              if ".lora_" in k}
    scale = lora.alpha / lora.r

    def weights() -> dict[str, torch.Tensor]:
        out = {}
        for name in plain.state_dict():
            layer = name.removesuffix(".weight")
            a = leaves.get(f"{layer}.lora_A.default.weight")
            if a is None:
                out[name] = state[name]
            else:
                b = leaves[f"{layer}.lora_B.default.weight"]
                out[name] = state[f"{layer}.base_layer.weight"] + scale * (b @ a)
        return out

    tokens = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
    total = 0.0
    for batch in batches:
        w = weights()
        hidden = torch.func.functional_call(plain, w, (batch,))  # [B, T, H]
        logits = F.linear(hidden, w["embed.weight"])  # [B, T, V], the tied head
        total = total + F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
    (total / tokens).backward()
    torch.nn.utils.clip_grad_norm_(list(leaves.values()), CLIP)
    grads = {k: v.grad.clone() for k, v in leaves.items()}
    return grads, adamw(state_of(leaves), grads)


def state_of(leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in leaves.items()}


def far_gradients(ours: dict, theirs: dict, bounds: dict) -> list[str]:
    return [k for k in theirs if relative(ours[k], theirs[k]) > bounds[k]]


def test_one_window_equals_an_independent_step_on_the_adapters():
    """In two parts, so that no tolerance has to absorb AdamW's first step ``lr g /
    (|g| + eps)``, whose slope ``lr / eps`` at ``g = 0`` turns the last-bit rounding of a
    gradient near ``eps`` into a visible part of a step. (1) The gradients the engine's
    optimizer steps on equal the independent window's within ``TOLERANCE`` (H5's 1e-5
    relative to each tensor's largest entry), or within twice the independent fp32
    gradients' own distance from the same window in float64 where that is larger
    (``W x + s B (A x)`` against ``(W + s B A) x`` differ in rounding only). (2) The
    adapters are ``torch.optim.AdamW``'s step on exactly those gradients, taken in float64,
    to fp32's rounding of the step: ``gamma(16) (|theta| + lr)`` (the decay, the two
    moments, their bias corrections, the square root, ``+ eps``, the quotient, the
    scaled subtraction: fewer than 16 roundings of quantities at most ``|theta|`` and
    ``lr``). Negative control: the independent window with the scale halved
    (``alpha / r = 1``) fails (1) on every adapter."""
    lora = LoRAConfig(r=4, alpha=8.0)
    model = lora_decoder(lora)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():  # B starts at 0 (A's gradient would be 0): start elsewhere
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    batches = window_batches()
    their_grads, _ = independent_window(model, batches, lora)
    exact_grads, _ = independent_window(model, batches, lora, torch.float64)
    engine = real_engine(model, lr=LR, clip=CLIP, weight_decay=DECAY)
    names = {id(p): n for n, p in model.named_parameters()}
    seen: list[dict[str, torch.Tensor]] = []
    engine.optimizer.register_step_pre_hook(lambda opt, *_: seen.append(
        {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]}))
    assert engine.run_window(batches, 0).outcome == Outcome.COMMITTED
    # the clip set (U3, U6) is the adapters, and no base tensor got a gradient
    assert {id(p) for p in engine.parameters} == {
        id(p) for p in model.parameters() if p.requires_grad}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    ours = model.state_dict()
    (grads,) = seen
    assert set(grads) == set(their_grads) == {k for k in ours if ".lora_" in k}
    bounds = {k: max(TOLERANCE, 2 * relative(their_grads[k], exact_grads[k])) for k in grads}
    assert far_gradients(grads, their_grads, bounds) == []  # (1)
    stepped = adamw({k: start[k].double() for k in grads}, grads)  # (2)
    for k, want in stepped.items():
        assert ((ours[k].double() - want).abs() <= gamma(16) * (want.abs() + LR)).all(), k
    assert all(not torch.equal(ours[k], start[k]) for k in grads)  # every adapter moved
    assert all(torch.equal(ours[k], start[k]) for k in ours if k not in grads)  # base: bitwise
    # negative control: the independent window with the scale halved (alpha / r = 1)
    with torch.no_grad():
        for k, v in start.items():
            model.state_dict()[k].copy_(v)
    unscaled, _ = independent_window(model, batches, LoRAConfig(r=4, alpha=4.0))
    assert far_gradients(grads, unscaled, bounds) == list(grads)


def test_activation_checkpointing_with_lora_recomputes_and_changes_nothing():
    """H5 with H4 on the built-in decoder: one window with adapter dropout 0.25 and every
    block recomputed ends bitwise where the window without recomputation ends (the
    dropout masks replayed); the recomputation happened (an adapted layer runs twice
    per microbatch, once without). Negative control: other dropout draws (another
    seed of the global stream) end elsewhere, so the masks matter."""
    ends, calls = {}, {}
    for checkpointing, seed in ((False, 0), (True, 0), ("other draws", 1)):
        model = lora_decoder(LoRAConfig(r=4, dropout=0.25),
                             activation_checkpointing=checkpointing is True)
        with torch.no_grad():  # B away from 0, so the dropout on A's input matters
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.fill_(0.05)
        count = [0]
        model.layers[0].attn.qkv.register_forward_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        torch.manual_seed(seed)
        engine = real_engine(model, lr=LR, clip=CLIP, weight_decay=DECAY)
        assert engine.run_window(window_batches(), 0).outcome == Outcome.COMMITTED
        ends[checkpointing] = {k: v.clone() for k, v in model.state_dict().items()}
        calls[checkpointing] = count[0]
    assert calls == {False: 3, True: 6, "other draws": 3}
    assert ends[False].keys() == ends[True].keys()
    assert all(torch.equal(ends[False][k], ends[True][k]) for k in ends[False])
    assert not all(torch.equal(ends[False][k], ends["other draws"][k]) for k in ends[False])


def test_the_checkpoint_state_is_the_adapters_and_loads_back_only_whole():
    """S2 under H4: ``checkpoint_state`` is the trainable tensors; loading it onto a fresh
    model restores them, and a state lacking an adapter or carrying a stranger is
    refused (negative controls). Without LoRA it is the whole state dict."""
    model = lora_decoder(LoRAConfig(r=2, target_modules="qkv"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.fill_(0.5)
    state = model.checkpoint_state()
    assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(state) == 4
    fresh = lora_decoder(LoRAConfig(r=2, target_modules="qkv"))
    fresh.load_checkpoint_state(state)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    lacking = dict(state)
    lacking.pop(sorted(lacking)[0])
    with pytest.raises(ModelError, match="1 adapter tensor"):
        fresh.load_checkpoint_state(lacking)
    with pytest.raises(ModelError, match="1 unexpected"):
        fresh.load_checkpoint_state({**state, "stranger": torch.zeros(1)})
    plain = lora_decoder(LoRAConfig())
    with pytest.raises(ModelError, match="holds no LoRA adapters"):  # a plain model's state
        fresh.load_checkpoint_state(plain.state_dict())
    assert plain.checkpoint_state().keys() == plain.state_dict().keys()
    assert plain.describe() is None  # the manifest of a run without LoRA is unchanged


# ------------------------------------------------------------------------ a real run


def run_args(corpus: Path, lora: dict) -> dict:
    return {**TINY, "data.source": corpus, "train.steps": 3, "update.warmup": 0,
            "update.weight_decay": DECAY, "train.eval_tokens": 32, "train.threads": 1,
            **{f"model.lora.{k}": v for k, v in lora.items()}}


def trained_run(tmp_path: Path, lora: dict) -> tuple[dict, dict, dict, Path]:
    """The initial state, the state of the very model the run trained (caught as it is
    built: a LoRA checkpoint holds no base to compare), the manifest and the run."""
    import exactstep.families.causal.family as causal

    corpus, run = tmp_path / "docs.jsonl", tmp_path / "run"
    write_corpus(corpus)
    pairs = run_args(corpus, lora)
    model = train_catching(causal, "build_model", ["train", "--out", str(run), "--no-progress",
                                              *set_args(pairs)])
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = load_config(overrides=[f"{k}={v}" for k, v in pairs.items()])
    initial = build_model(cfg.model, BYTE_VOCAB, seed=cfg.seed).state_dict()
    manifest = json.loads((run / "manifest.json").read_text())["manifest"]
    return initial, trained, manifest, run


def checkpoint_model(run: Path) -> dict:
    from exactstep.state.safetensors_format import load_checkpoint
    from exactstep.state.store import latest_checkpoint

    return load_checkpoint(latest_checkpoint(run / "checkpoints"))[0]


@pytest.mark.slow
def test_a_real_run_moves_only_the_adapters_and_exports_merged(tmp_path):
    """Every base tensor bitwise unchanged, the adapters moved; the manifest pins the
    base by the digest of the model built without LoRA; the checkpoint holds the
    adapters as trained, and the finished run reopens to the trained model."""
    from exactstep.run.finished_run import open_finished_run

    initial, trained, manifest, run = trained_run(tmp_path, {"r": 4, "alpha": 8.0,
                                                             "dropout": 0.1})
    assert initial.keys() == trained.keys()
    base = [k for k in initial if ".lora_" not in k]
    adapters = [k for k in initial if ".lora_B." in k]
    assert base and len(adapters) == 4
    assert all(torch.equal(initial[k], trained[k]) for k in base)
    assert all(not torch.equal(initial[k], trained[k]) for k in adapters)
    cfg = load_config(overrides=[f"model.{k}={v}" for k, v in
                                 {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32}.items()])
    plain = build_model(cfg.model, BYTE_VOCAB, seed=manifest["config"]["seed"])
    section = manifest["model"]
    assert section["source"] == "builtin"
    assert section["lora"]["base_weights_sha256"] == weights_digest(plain)
    # rank 4, 1 layer, r * (in + out): qkv 16 -> 48, out 16 -> 16, gate_up 16 -> 64, down 32 -> 16
    assert section["lora"]["adapter_parameters"] == 4 * (64 + 32 + 80 + 48) == 896
    assert manifest["config"]["model"]["lora"]["r"] == 4
    stored = checkpoint_model(run)  # the adapters only (S2, H4), as trained
    assert set(stored) == {k for k in initial if ".lora_" in k}
    assert all(torch.equal(stored[k], trained[k]) for k in stored)
    with open_finished_run(run) as finished:  # the base rebuilt, the adapters loaded
        reopened = finished.model.state_dict()
    assert all(torch.equal(reopened[k], trained[k]) for k in trained)
    check_merged_export(run, tmp_path, trained, scale=8.0 / 4)


def check_merged_export(run: Path, tmp_path: Path, trained: dict, scale: float) -> None:
    """``exactstep export`` writes the merged model as a Llama: its q projection is
    ``W + s B A`` formed here by hand, and plain transformers' logits equal the trained
    model's. Negative control: the base exported without the adapters fails the
    export's own handoff check and nothing is published. ``--adapter`` is refused."""
    from transformers import AutoModelForCausalLM

    from exactstep.artifacts import export as export_module
    from exactstep.errors import ExportError
    from exactstep.eval import eval_mode
    from exactstep.rows.batch import single_segment_batch
    from exactstep.run.finished_run import open_finished_run

    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    passport = json.loads((out / "passport.json").read_text())
    assert passport["adapters"] == "merged" and passport["architecture"] == "LlamaForCausalLM"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert not any("lora" in k for k in hf.state_dict())
    layer = "layers.0.attn.qkv"
    W, B, A = (trained[f"{layer}.{k}.weight"] for k in ("base_layer", "lora_B.default",
                                                         "lora_A.default"))
    by_hand = W + scale * (B @ A)
    q = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    # both round W + s B A (inner length r) in fp32: twice gamma(r) s |B| |A| for the
    # product and two more roundings of the sum
    bound = 2 * (scale * matmul_bound(B, A) + gamma(2) * (W.double().abs() + scale * (
        B.double().abs() @ A.double().abs())))
    assert ((q.double() - by_hand[:16].double()).abs() <= bound[:16]).all()
    assert not torch.equal(q, trained[f"{layer}.base_layer.weight"][:16])
    ids = torch.tensor([[256, 72, 101, 108, 108, 111, 32, 111, 119, 108]])
    with open_finished_run(run) as finished:
        model = finished.model
        with torch.no_grad(), eval_mode(model):  # adapter dropout off
            expected = model.logits(model(single_segment_batch(ids)))
            error = float((hf(input_ids=ids).logits - expected).abs().max())
    assert error <= passport["check"]["tolerance"], error  # H3's, as the export derived it
    dropped = tmp_path / "dropped"
    with pytest.MonkeyPatch.context() as mp:  # the adapters left out instead of merged
        mp.setattr(export_module, "merged_state", lambda model: {
            k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()
            if ".lora_" not in k})
        with pytest.raises(ExportError, match="logits differ"):
            export_module.export_run(run, dropped)
    assert not dropped.exists()
    with pytest.raises(ConfigError, match="export it merged"):
        export_module.export_run(run, tmp_path / "adapter", adapter=True)


@pytest.mark.slow
def test_without_lora_the_same_run_moves_the_base(tmp_path):  # negative control
    initial, trained, manifest, run = trained_run(tmp_path, {})
    assert "model" not in manifest
    moved = [k for k in initial if not torch.equal(initial[k], trained[k])]
    assert "layers.0.attn.qkv.weight" in moved
    assert set(checkpoint_model(run)) == set(initial)  # the whole model


# ---------------------------------------------------------- resume (S4, S5)


@pytest.mark.slow
def test_a_changed_base_refuses_resume_naming_its_digest(tmp_path, capfd):
    """The base is rebuilt from the seed on resume; built differently (one weight
    changed), the resume is refused naming the base digest (negative control: as
    built before, it resumes)."""
    corpus, run = tmp_path / "docs.jsonl", tmp_path / "run"
    write_corpus(corpus)
    pairs = {**run_args(corpus, {"r": 2}), "train.steps": 2}
    assert main(["train", "--out", str(run), "--no-progress", *set_args(pairs)]) == 0
    assert main(["resume", str(run), "--no-progress"]) == 0  # negative control
    original = Decoder.init_weights

    def changed(self, generator=None):
        original(self, generator)
        with torch.no_grad():
            self.layers[0].attn.out.weight.view(-1)[0] += 1.0

    capfd.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Decoder, "init_weights", changed)
        assert main(["resume", str(run), "--no-progress"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: ") and "model.lora.base_weights_sha256" in err, err


@pytest.mark.slow
def test_killed_and_resumed_lora_run_with_dropout_is_bitwise_identical_s5(tmp_path):
    """Straight = SIGKILLed twice and resumed, bitwise (the adapters' dropout masks come
    from the checkpointed RNG streams); a resume without the data cursor differs in
    the adapters and nowhere in the base (which no checkpoint holds)."""
    from families.test_family_kill_resume import FamilyHarness, bitwise_lineage, final_state

    from exactstep.state.compare import state_differences

    straight, defective, manifest = bitwise_lineage(
        FamilyHarness(tmp_path, {"model.lora.r": 4, "model.lora.dropout": 0.25}))
    state_a = final_state(straight)[1]
    assert manifest["config"]["model"]["lora"]["dropout"] == 0.25
    assert state_a["model"] and all(".lora_" in k for k in state_a["model"])  # adapters only
    differences = state_differences(state_a, final_state(defective)[1])
    assert any(d.startswith("model.") and ".lora_" in d for d in differences)
    assert not any(d.startswith("model.") and ".lora_" not in d for d in differences)


@pytest.mark.slow
def test_a_warm_start_into_lora_from_a_plain_run_is_refused(tmp_path, capfd):
    """A LoRA run's base is rebuilt from the seed on every resume, so a warm start that
    would put a plain run's weights under new adapters is refused (one error line,
    nothing written); the way the message names works: the parent exported, adapters
    trained on the export as an HF model."""
    corpus = tmp_path / "docs.jsonl"
    write_corpus(corpus)
    pairs = {**run_args(corpus, {}), "train.steps": 2}
    parent, child = tmp_path / "parent", tmp_path / "child"
    assert main(["train", "--out", str(parent), "--no-progress", *set_args(pairs)]) == 0
    capfd.readouterr()
    assert main(["resume", str(parent), "--warm-start", str(child), "--no-progress",
                 "--set", "model.lora.r=2"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: the checkpoint holds no LoRA adapters") and "model.path" in err
    assert not child.exists()
    exported = tmp_path / "exported"
    assert main(["export", str(parent), "--out", str(exported)]) == 0
    on_export = {**pairs, "model.source": "hf", "model.path": exported, "model.lora.r": 2}
    assert main(["train", "--out", str(child), "--no-progress", *set_args(on_export)]) == 0
