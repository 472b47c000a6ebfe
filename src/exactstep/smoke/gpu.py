"""The GPU smoke test: every CUDA path exercised once, with figures, in a few minutes.

``exactstep smoke gpu --json`` (``make gpu-smoke``) runs its checks (attention,
windows, sync audit, fp16 skip, resume, FSDP2 on an HF model, chunked CE, MFU) on one
CUDA device, and context parallel on two, one ``PASS`` / ``FAIL`` / ``SKIP`` line each;
any ``FAIL`` exits non-zero.
``--dry-run`` runs the same code on the CPU with tiny shapes so the test cannot rot.
Design and derivations: docs/design/bench.md#smokegpupy (R3, U1, U2, U4, U7, S5, L1, D4, 0x0A).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from exactstep.bench.attention import packed_rows, random_lengths
from exactstep.bench.step import random_packed_batch
from exactstep.errors import ConfigError
from exactstep.model.attention import attend, flex_mask_mod, prepare_visibility
from exactstep.model.config import LoRAConfig, ModelConfig
from exactstep.model.decoder import apply_rope, build_model, rope_tables
from exactstep.objective.config import ObjectiveConfig
from exactstep.parallel.agreement import distribute_engine
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.dcp_format import load_distributed_checkpoint, save_distributed_checkpoint
from exactstep.parallel.process_group import DistContext, free_port, new_host_group
from exactstep.parallel.wrap import shard_model
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

VOCAB, PAD = 259, 258
BF16_LOSS_RTOL = 0.05  # per-window loss of one implementation vs dense, 30 bf16 windows


@dataclass(frozen=True)
class Shapes:
    """Every size the checks use; ``GPU`` for the real run, ``DRY`` for the CPU."""

    attention: tuple[int, int, int, int]  # B, T, heads, head dim
    model: ModelConfig
    rows: int
    seq_len: int
    windows: int
    resume_windows: int  # straight; the resume starts at half of it
    ce: tuple[int, int, int]  # N, V, H
    mfu_model: ModelConfig
    mfu_rows: int
    mfu_seq_len: int
    peak_size: int  # square bf16 matmul for the peak
    context: tuple[int, int, int, int]  # B, T, heads, head dim of the context-parallel check


GPU = Shapes(
    attention=(8, 1024, 8, 64), model=ModelConfig(), rows=16, seq_len=256, windows=30,
    resume_windows=20, ce=(32768, 131072, 2048),
    mfu_model=ModelConfig(d_model=1024, n_layers=4, n_heads=32, d_ff=2752), mfu_rows=16,
    mfu_seq_len=1024, peak_size=8192, context=(2, 2048, 8, 64),
)
DRY = Shapes(
    attention=(2, 160, 2, 16), model=ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=48),
    rows=2, seq_len=32, windows=3, resume_windows=4, ce=(256, 1024, 32),
    mfu_model=ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=48), mfu_rows=2,
    mfu_seq_len=32, peak_size=256, context=(2, 256, 2, 16),
)


@dataclass
class Check:
    """One check's outcome: ``status`` PASS | FAIL | SKIP, figures, and why."""

    name: str
    status: str = "PASS"
    figures: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.status = "FAIL"
        self.notes.append(why)

    def not_run(self, why: str) -> None:
        """Part of the check needs CUDA: the rest ran; the output says what did not."""
        self.notes.append(f"not run here: {why}")

    def skip(self, why: str) -> None:
        """The whole check needs CUDA."""
        self.status = "SKIP"
        self.notes.append(why)

    def line(self, seconds: float) -> str:
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in self.figures.items())
        notes = "; ".join(self.notes)
        return (f"check {self.name}: {self.status} ({seconds:.1f} s)"
                + (f" {shown}" if shown else "") + (f" [{notes}]" if notes else ""))


@dataclass(frozen=True)
class Env:
    device: torch.device
    shapes: Shapes
    dry_run: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# --------------------------------------------------------------------------- entry


def run(quick: bool, dry_run: bool = False) -> dict:
    """Run every check; returns the figures (``ok`` is False when one failed).

    Without ``dry_run`` a CUDA device is required (``ConfigError`` otherwise).
    ``quick`` is accepted for the ``bench`` convention and changes nothing: the GPU
    shapes are already sized for minutes.
    """
    env = environment(dry_run)
    figures: dict = {"device": device_name(env.device), "dry_run": dry_run,
                     "torch": torch.__version__}
    statuses = {}
    for name, check in CHECKS:
        result, seconds = run_check(name, check, env)
        print(result.line(seconds), file=sys.stderr, flush=True)
        statuses[name] = result.status
        figures.update({f"{name}_{k}": v for k, v in result.figures.items()})
        figures[f"{name}_seconds"] = seconds
        if result.notes:
            figures[f"{name}_notes"] = "; ".join(result.notes)
    figures["checks"] = statuses
    figures["ok"] = all(status != "FAIL" for status in statuses.values())
    return figures


def environment(dry_run: bool) -> Env:
    if dry_run:
        return Env(torch.device("cpu"), DRY, True)
    if not torch.cuda.is_available():
        raise ConfigError("smoke gpu needs a CUDA device; run 'exactstep smoke gpu --dry-run' "
                          "to exercise the same code on the CPU")
    return Env(torch.device("cuda", torch.cuda.current_device()), GPU, False)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


def run_check(name: str, check: Callable[[Env, Check], None], env: Env) -> tuple[Check, float]:
    """Run one check; an exception is a FAIL with its first line (traceback on stderr)."""
    result = Check(name)
    start = time.perf_counter()
    try:
        with fp32_matmul(torch.get_float32_matmul_precision()):  # a run may set it globally
            check(env, result)
    except Exception as exc:  # noqa: BLE001 - a smoke test reports every failure and goes on
        traceback.print_exc(file=sys.stderr)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result.fail(f"{type(exc).__name__}: {first}")
    finally:
        if env.cuda:
            torch.cuda.synchronize()
    return result, time.perf_counter() - start


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def synchronize(env: Env) -> None:
    if env.cuda:
        torch.cuda.synchronize()


def timed(env: Env, fn: Callable[[], object]) -> float:
    synchronize(env)
    start = time.perf_counter()
    fn()
    synchronize(env)
    return time.perf_counter() - start


@contextlib.contextmanager
def fp32_matmul(mode: str) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(mode)`` inside, the previous mode after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(mode)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# ----------------------------------------------------------------------- attention


def attention_outputs(batch, impl: str, env: Env, grad: bool) -> list[torch.Tensor]:
    """Output (and q, k, v gradients when ``grad``) of ``impl`` on fixed inputs."""
    B, T, nH, Dh = env.shapes.attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, nH, T, Dh, generator=g).to(env.device).requires_grad_(grad)
               for _ in range(3))
    upstream = torch.randn(B, nH, T, Dh, generator=g).to(env.device)
    on_device = batch.to(env.device)
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU FlexAttention warns that it is unfused
        out = attend(q, k, v, prepare_visibility(on_device, impl, env.device, head_dim=Dh))
    if not grad:
        return [out.detach()]
    (out * upstream).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def max_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=False))


def check_attention(env: Env, result: Check) -> None:
    B, T, _, _ = env.shapes.attention
    batch = packed_rows(random_lengths(random.Random(0), B, T, 16, T // 2), T)
    with fp32_matmul("highest"):  # an fp32 comparison, not TF32
        reference = attention_outputs(batch, "dense", env, grad=True)
        segments = attention_outputs(batch, "segments", env, grad=True)
        result.figures["segments_max_error"] = max_error(segments, reference)
        if env.cuda:
            first = time.perf_counter()
            flex = attention_outputs(batch, "flex", env, grad=True)
            synchronize(env)
            result.figures["flex_first_call_s"] = time.perf_counter() - first
            result.figures["flex_max_error"] = max_error(flex, reference)
        else:
            flex = attention_outputs(batch, "flex", env, grad=False)
            result.figures["flex_forward_max_error"] = max_error(flex, reference[:1])
            result.not_run("FlexAttention backward and compile (need CUDA)")
    if result.figures["segments_max_error"] > 1e-5:
        result.fail("per-document SDPA differs from dense by more than 1e-5")
    flex_error = result.figures.get("flex_max_error", result.figures.get("flex_forward_max_error"))
    if flex_error > 1e-4:
        result.fail("FlexAttention differs from dense by more than 1e-4")


# ------------------------------------------------------------------------- windows


def make_engine(env: Env, model_cfg: ModelConfig, precision: str, *, seed: int = 0,
                fail_window: int = -1) -> UpdateEngine:
    update = UpdateConfig(lr=3e-3, schedule="constant", warmup=0, clip=1.0,
                          fail_window=fail_window)
    model = build_model(model_cfg, VOCAB, seed=seed).to(env.device)
    optimizer, _ = build_optimizer(model, update)
    return UpdateEngine(model, optimizer, build_schedule(update, 1000),
                        Precision(NumericsConfig(precision=precision, init_scale=1024.0),
                                  env.device),
                        update, ObjectiveConfig(), device=env.device, pad_id=PAD)


def host_batches(env: Env, count: int, rows: int | None = None, seq_len: int | None = None,
                 docs: int = 4) -> list:
    gen = torch.Generator().manual_seed(1)
    rows, seq_len = rows or env.shapes.rows, seq_len or env.shapes.seq_len
    return [random_packed_batch(gen, rows, seq_len, docs=docs) for _ in range(count)]


def run_timed_windows(env: Env, engine: UpdateEngine, batches: list) -> tuple[list, float]:
    """One window per batch; the dispositions and the seconds they took (device-synced)."""
    synchronize(env)
    start = time.perf_counter()
    records = [engine.run_window([b], w) for w, b in enumerate(batches)]
    synchronize(env)
    return records, time.perf_counter() - start


def check_windows(env: Env, result: Check) -> None:
    batches = host_batches(env, env.shapes.windows)
    tokens = sum(b.input_ids.numel() for b in batches)
    losses = {}
    for impl in ("auto", "segments", "dense"):
        engine = make_engine(env, replace(env.shapes.model, attention=impl), "bf16")
        engine.run_window([batches[0]], 0)  # warm-up (compile, lazy initialisation)
        engine = make_engine(env, replace(env.shapes.model, attention=impl), "bf16")
        records, seconds = run_timed_windows(env, engine, batches)
        losses[impl] = [r.loss for r in records]
        result.figures[f"{impl}_tokens_per_s"] = tokens / seconds
    if not env.cuda:
        result.notes.append("auto is segments on the CPU")
    worst = max(abs(a - d) / abs(d) for impl in ("auto", "segments")
                for a, d in zip(losses[impl], losses["dense"], strict=True))
    result.figures["max_loss_rel_diff"] = worst
    if worst > BF16_LOSS_RTOL:
        result.fail(f"ledger losses differ from dense by more than {BF16_LOSS_RTOL:g} (relative)")


# ---------------------------------------------------------------------- sync audit


def count_syncs(fn: Callable[[], object]) -> int:
    """Synchronising CUDA calls made by ``fn`` (``torch.cuda.set_sync_debug_mode``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_sync_audit(env: Env, result: Check) -> None:
    if not env.cuda:
        result.skip("needs CUDA (torch.cuda.set_sync_debug_mode)")
        return
    batches = host_batches(env, 3)
    for impl in ("segments", "auto"):
        engine = make_engine(env, replace(env.shapes.model, attention=impl), "bf16")
        for w in range(2):  # warm-up: compile, optimizer state, pinned-memory pool
            engine.run_window([batches[w]], w)
        synchronize(env)
        result.figures[f"{impl}_syncs"] = count_syncs(lambda e=engine: e.run_window([batches[2]], 2))
        if result.figures[f"{impl}_syncs"] != 1:
            result.fail(f"{impl}: {result.figures[f'{impl}_syncs']} synchronising calls per "
                        "window, expected 1 (the finite decision)")
    control = count_syncs(lambda: torch.arange(8).to(env.device))  # pageable, blocking
    result.figures["blocking_copy_syncs"] = control
    if control < 1:
        result.fail("the detector missed a blocking host-to-device copy")


# ------------------------------------------------------------------------ fp16 skip


def check_fp16_skip(env: Env, result: Check) -> None:
    batches = host_batches(env, 4)
    engine = make_engine(env, env.shapes.model, "fp16", fail_window=2)
    scales, outcomes, same_params = [], [], None
    for w, batch in enumerate(batches):
        before = [p.detach().clone() for p in engine.parameters]
        scales.append(engine.precision.current_scale())
        outcomes.append(engine.run_window([batch], w).outcome)
        if w == 2:
            same_params = all(torch.equal(a, p.detach()) for a, p in zip(before, engine.parameters,
                                                                           strict=True))
    scales.append(engine.precision.current_scale())
    result.figures["outcomes"] = ",".join(o.value for o in outcomes)
    result.figures["scale_before_skip"] = scales[2]
    result.figures["scale_after_skip"] = scales[3]
    expected = [Outcome.COMMITTED, Outcome.COMMITTED, Outcome.SKIPPED_NONFINITE, Outcome.COMMITTED]
    if outcomes != expected:
        result.fail("the injected window was not the only skipped one")
    if scales[3] != scales[2] / 2:
        result.fail("the loss scale did not halve on the skipped window")
    if not same_params:
        result.fail("the skipped window changed parameters")


# --------------------------------------------------------------------------- resume


def write_corpus(path: Path, n: int = 400) -> Path:
    words = "the quick brown fox jumps over a lazy dog while seven owls watch".split()
    lines = [json.dumps({"text": " ".join(words[(i * 7 + j * 3) % len(words)]
                                          for j in range(4 + i % 23))}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def resume_config(env: Env, corpus: Path):
    from exactstep.config import load_config

    m = env.shapes.model
    steps = env.shapes.resume_windows
    pairs = {
        "seed": 3, "data.source": corpus, "data.val_fraction": 0.1,
        "train.device": env.device.type, "train.steps": steps, "train.eval_tokens": 256,
        "train.progress": "false", "checkpoint.every": steps // 2, "checkpoint.keep": 3,
        "batch.rows": env.shapes.rows, "batch.seq_len": env.shapes.seq_len,
        "model.d_model": m.d_model, "model.n_layers": m.n_layers, "model.n_heads": m.n_heads,
        "model.d_ff": m.d_ff, "update.warmup": 2,
    }
    return load_config(overrides=[f"{k}={v}" for k, v in pairs.items()])


def final_state(run_dir: Path) -> tuple:
    from exactstep.state import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    weights, parts = load_checkpoint(path)
    return path.name, weights, parts, (run_dir / "ledger.jsonl").read_text()


def check_resume(env: Env, result: Check) -> None:
    from exactstep.run.continuation import resume
    from exactstep.run.runner import train
    from exactstep.state import state_differences
    from exactstep.state.checkpointer import checkpoint_name
    from exactstep.state.manifest import read_manifest

    steps = env.shapes.resume_windows
    with tempfile.TemporaryDirectory(prefix="exactstep-gpu-smoke-") as tmp:
        root = Path(tmp)
        cfg = resume_config(env, write_corpus(root / "corpus.jsonl"))
        straight, resumed = root / "straight", root / "resumed"
        with contextlib.redirect_stdout(sys.stderr):  # run summaries; stdout is the JSON
            train(cfg, straight, progress=False)
            shutil.copytree(straight, resumed)
            shutil.rmtree(resumed / "checkpoints" / checkpoint_name(steps))  # the middle stays
            middle = resumed / "checkpoints" / checkpoint_name(steps // 2)
            resume(resumed, from_checkpoint=middle, progress=False)
        a, b = final_state(straight), final_state(resumed)
        numerics = read_manifest(straight).body["numerics"]
    differences = state_differences(list(a[1:3]), list(b[1:3]))
    result.figures["windows"] = f"{steps} straight vs {steps // 2} + resume"
    result.figures["precision"] = f"{numerics['precision']} (resolved from auto)"
    result.figures["differences"] = len(differences)
    if a[0] != b[0]:
        result.fail(f"final checkpoints differ in name: {a[0]} vs {b[0]}")
    if differences:
        result.fail(f"final states differ at {', '.join(differences[:5])}")
    if a[3] != b[3]:
        result.fail("the ledgers differ")


# ------------------------------------------------------------------- FSDP2, HF model

#: a tiny Llama built from its config (no download); positions cover the GPU rows
FSDP_HF_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 512, "vocab_size": VOCAB}
FSDP_TOLERANCE = 1e-5  # D5: fp32, absolute on every parameter


@contextlib.contextmanager
def one_rank_job(env: Env) -> Iterator[DistContext]:
    """A process group of this one process (nccl on CUDA, gloo on the CPU), so FSDP2,
    its collectives and torch.distributed.checkpoint run their own code; left after."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if env.cuda else "gloo"
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, timeout=timeout,
                            device_id=env.device if env.cuda else None)
    try:
        yield DistContext(rank=0, world_size=1, local_rank=0, device=env.device,
                          backend=backend, host_group=new_host_group(timeout), timeout_s=120.0)
    finally:
        dist.destroy_process_group()


def hf_engine(env: Env, lora: bool, precision: str, ctx: DistContext | None = None
              ) -> UpdateEngine:
    """The engine over ``FSDP_HF_CONFIG`` (LoRA r = 8 on every linear layer when
    ``lora``), sharded by ``shard_model`` when ``ctx`` is given. Eager attention: its
    CUDA kernels are deterministic (fp32 SDPA's memory-efficient backward is not), so
    the resumed window can be compared bitwise."""
    cfg = ModelConfig(source="hf", hf_config=FSDP_HF_CONFIG, attn_implementation="eager",
                      lora=LoRAConfig(r=8 if lora else 0))
    model = build_model(cfg, VOCAB, seed=0).to(env.device)
    parallel = ParallelConfig(strategy="fsdp")
    if ctx is not None:
        model = shard_model(model, ctx, parallel, precision=precision)
    update = UpdateConfig(lr=3e-3, schedule="constant", warmup=0, clip=1.0)
    optimizer, _ = build_optimizer(model, update)
    engine = UpdateEngine(model, optimizer, build_schedule(update, 1000),
                          Precision(NumericsConfig(precision=precision), env.device),
                          update, ObjectiveConfig(), device=env.device, pad_id=PAD)
    return engine if ctx is None else distribute_engine(engine, ctx, parallel)


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` whole (FSDP2 holds ``DTensor`` shards)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def check_fsdp_hf(env: Env, result: Check) -> None:
    """D4, D5, S7 on an HF model, whole and with LoRA: FSDP2 units per decoder layer and
    at the root; the sharded windows equal the unsharded ones (fp32, 1e-5); a DCP
    checkpoint loaded into a fresh sharded engine continues bitwise for one window;
    bf16 (parameters gathered in bf16) keeps the fp32 losses to ``BF16_LOSS_RTOL``."""
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        result.skip("needs the [hf] extra (transformers, peft)")
        return
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if dist.is_initialized():
        result.skip("this process already belongs to a process group")
        return
    batches = host_batches(env, env.shapes.windows)
    *first, last = batches
    layers = FSDP_HF_CONFIG["num_hidden_layers"]
    losses: dict[str, list[float]] = {}
    with one_rank_job(env) as ctx, tempfile.TemporaryDirectory(prefix="exactstep-fsdp-") as tmp:
        for lora in (False, True):
            tag = "lora" if lora else "full"
            plain, sharded = hf_engine(env, lora, "fp32"), hf_engine(env, lora, "fp32", ctx)
            units = sum(isinstance(m, FSDPModule) for m in sharded.model.modules())
            for name, engine in (("plain", plain), ("sharded", sharded)):
                losses[f"{tag}_{name}"] = [engine.run_window([b], w).loss
                                           for w, b in enumerate(first)]
            reference, full = gathered(plain.model), gathered(sharded.model)
            diff = max((full[k] - v).abs().max().item() for k, v in reference.items())
            save_distributed_checkpoint(Path(tmp) / tag, "window", model=sharded.model,
                                        optimizer=sharded.optimizer, common={},
                                        rank_state={"rng": None, "data": None}, ctx=ctx, keep=1)
            fresh = hf_engine(env, lora, "fp32", ctx)
            load_distributed_checkpoint(Path(tmp) / tag / "window", model=fresh.model,
                                        optimizer=fresh.optimizer, ctx=ctx)
            fresh.schedule.load_state_dict(sharded.schedule.state_dict())
            for engine in (sharded, fresh):
                engine.run_window([last], len(first))
            resumed = gathered(fresh.model)
            mismatched = [k for k, v in gathered(sharded.model).items()
                          if not torch.equal(v, resumed[k])]
            result.figures[f"{tag}_units"] = units
            result.figures[f"{tag}_max_abs_diff"] = diff
            if units != layers + 1:
                result.fail(f"{tag}: {units} FSDP2 units, not {layers} decoder layers + the root")
            if diff > FSDP_TOLERANCE:
                result.fail(f"{tag}: sharded parameters differ from unsharded by {diff:.3g}")
            if mismatched:
                result.fail(f"{tag}: the resumed window differs at {', '.join(mismatched[:3])}")
        bf16 = hf_engine(env, False, "bf16", ctx)
        bf16_losses = [bf16.run_window([b], w).loss for w, b in enumerate(first)]
    worst = max(abs(a - b) / abs(b)
                for a, b in zip(bf16_losses, losses["full_plain"], strict=True))
    result.figures["bf16_max_loss_rel_diff"] = worst
    if worst > BF16_LOSS_RTOL:
        result.fail(f"bf16 losses differ from fp32 by more than {BF16_LOSS_RTOL:g} (relative)")
    if not env.cuda:
        result.notes.append("one gloo rank on the CPU; nccl on CUDA")


# ----------------------------------------------------------------------- chunked CE


def ce_inputs(env: Env):
    N, V, H = env.shapes.ce
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen).to(env.device).requires_grad_(True)
    weight = (torch.randn(V, H, generator=gen) * 0.02).to(env.device).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=gen).to(env.device)
    return hidden, weight, labels


def ce_steps(hidden, weight, labels, device_type: str) -> dict[str, Callable[[], None]]:
    from exactstep.objective import microbatch_terms

    cfg = ObjectiveConfig()
    coeff = torch.ones(1, labels.shape[0], device=labels.device)

    def naive() -> None:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            logits = hidden @ weight.T  # [N, V] bf16
        F.cross_entropy(logits.float(), labels, reduction="sum").backward()

    def fused() -> None:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            numerator, _ = microbatch_terms(hidden[None], weight, labels[None], coeff, cfg,
                                            pad_id=None)
        numerator.backward()

    return {"naive": naive, "fused": fused}


def peak_extra_bytes(env: Env, step: Callable[[], None]) -> int:
    synchronize(env)
    torch.cuda.reset_peak_memory_stats(env.device)
    base = torch.cuda.memory_allocated(env.device)
    step()
    synchronize(env)
    return torch.cuda.max_memory_allocated(env.device) - base


def check_chunked_ce(env: Env, result: Check) -> None:
    hidden, weight, labels = ce_inputs(env)
    steps = ce_steps(hidden, weight, labels, env.device.type)
    times = {}
    for name, step in steps.items():
        hidden.grad = weight.grad = None
        step()  # warm-up
        hidden.grad = weight.grad = None
        if env.cuda:
            try:
                result.figures[f"{name}_peak_extra_gib"] = peak_extra_bytes(env, step) / 2**30
            except torch.OutOfMemoryError:
                result.figures[f"{name}_peak_extra_gib"] = "OOM"
                continue
            hidden.grad = weight.grad = None
        times[name] = min(timed(env, step) for _ in range(3))
    N, V, H = env.shapes.ce
    result.figures["shape"] = f"N {N}, V {V}, H {H}, bf16"
    if "naive" in times:
        result.figures["time_ratio"] = times["fused"] / times["naive"]
    if env.cuda and isinstance(result.figures.get("naive_peak_extra_gib"), float):
        result.figures["memory_ratio"] = (result.figures["fused_peak_extra_gib"]
                                          / result.figures["naive_peak_extra_gib"])
    if not env.cuda:
        result.not_run("peak memory (needs CUDA allocator statistics)")


# ------------------------------------------------------------------------------ MFU


def flops_per_token(cfg: ModelConfig, vocab: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 per weight of every
    matmul (blocks and head) and 6 * d_model * T per layer for causal attention
    (QK^T and AV, 2 * T * d each forward, half of the pairs)."""
    d, f, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    block = 4 * d * d + 3 * d * f  # qkv (3d^2) + out (d^2) + gate/up (2df) + down (df)
    return 6.0 * (L * block + vocab * d) + 6.0 * L * d * seq_len


def matmul_peak(env: Env) -> float:
    """Best bf16 FLOP/s of a square matmul on this device, measured now."""
    n = env.shapes.peak_size
    a = torch.randn(n, n, device=env.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=env.device, dtype=torch.bfloat16)
    torch.mm(a, b)
    best = min(timed(env, lambda: torch.mm(a, b)) for _ in range(5))
    return 2.0 * n**3 / best


def check_mfu(env: Env, result: Check) -> None:
    cfg = env.shapes.mfu_model
    T = env.shapes.mfu_seq_len
    batches = host_batches(env, 4, rows=env.shapes.mfu_rows, seq_len=T, docs=1)
    engine = make_engine(env, cfg, "bf16")
    engine.run_window([batches[0]], 0)  # warm-up
    _, seconds = run_timed_windows(env, engine, batches[1:])
    tokens = sum(b.input_ids.numel() for b in batches[1:])
    achieved = flops_per_token(cfg, VOCAB, T) * tokens / seconds
    peak = matmul_peak(env)
    result.figures["model"] = f"d_model {cfg.d_model}, {cfg.n_layers} layers, T {T}"
    result.figures["tokens_per_s"] = tokens / seconds
    result.figures["achieved_tflops"] = achieved / 1e12
    result.figures["peak_bf16_tflops"] = peak / 1e12
    result.figures["mfu"] = achieved / peak
    if not env.cuda:
        result.notes.append("CPU figures; the default size, not 8x, in a dry run")


# ----------------------------------------------------------------- context parallel

CP_RANKS = 2  # context-parallel ranks of the check (one device each on CUDA)
CP_ROPE_THETA = 10000.0
# planted wrong variants the check's rule must fail: a rank whose own keys stand in for
# the gathered ones, one that attends within its shard only, one that rotates by rank
# 0's positions (unsharded position_ids)
CP_CONTROLS = ("own_keys", "isolated", "rank0_positions")


def check_context_parallel(env: Env, result: Check) -> None:
    """0x0A, R2, R3: PyTorch's context parallel for FlexAttention (``_ContextParallel``:
    every rank all-gathers the keys and values, ``_context_parallel_shard`` rewrites
    the block mask to its query shard) keeps exactstep's packed-document visibility,
    with RoPE from the sharded ``position_ids``: on ``CP_RANKS`` ranks each query shard's
    output (and, on CUDA, the q/k/v gradients) is within ``2 * |one process - f64| + floor``
    of the float64 dense reference. Negative controls (``CP_CONTROLS``), measured by
    the same rule and required to fail it: shards that ignore the other shards' keys
    (two ways) and unsharded positions. Needs one CUDA device per rank (NCCL refuses
    two ranks on one device, gloo has no CUDA all-gather); the dry run is gloo on the
    CPU, forward only (FlexAttention has no CPU backward)."""
    import torch.multiprocessing as mp

    if env.cuda and torch.cuda.device_count() < CP_RANKS:
        result.skip(f"needs {CP_RANKS} CUDA devices, one per context-parallel rank; "
                    f"found {torch.cuda.device_count()}")
        return
    with tempfile.TemporaryDirectory(prefix="exactstep-cp-") as tmp:
        mp.start_processes(context_parallel_rank, args=(free_port(), env.dry_run, tmp),
                           nprocs=CP_RANKS, join=True, start_method="spawn")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(CP_RANKS)]
    for key in ranks[0]:
        result.figures[key] = max(figures[key] for figures in ranks)
    for name in ("output", "grad"):
        if f"{name}_error" not in result.figures:
            continue
        if result.figures[f"{name}_error"] > result.figures[f"{name}_tolerance"]:
            result.fail(f"the context-parallel {name} differs from one process by more than "
                        "twice one process's own error")
        for control in CP_CONTROLS:
            if result.figures[f"{control}_{name}_error"] <= result.figures[f"{name}_tolerance"]:
                result.fail(f"the {control} control passes the {name} check: it cannot fail")
    if not env.cuda:
        result.not_run("the backward (FlexAttention needs CUDA for it) and NCCL")


def context_parallel_rank(rank: int, port: int, dry_run: bool, out: str) -> None:
    """One rank of ``check_context_parallel``: writes its figures to ``out/rank{rank}.json``."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import (
        _context_parallel_shard,
        _ContextParallel,
    )
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.set_num_threads(1)
    env = environment(dry_run)
    device = torch.device("cuda", rank) if env.cuda else env.device
    if env.cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if env.cuda else "gloo", rank=rank, world_size=CP_RANKS,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=300))
    try:
        mesh = init_device_mesh(device.type, (CP_RANKS,), mesh_dim_names=("cp",))
        B, T, nH, Dh = env.shapes.context
        grad = env.cuda
        # documents cross the shard boundaries; positions restart in every document
        batch = packed_rows(random_lengths(random.Random(0), B, T, 16, T // 2), T).to(device)
        gen = torch.Generator().manual_seed(0)
        qkv = torch.randn(B, T, 3, nH, Dh, generator=gen, dtype=torch.float64).to(device)
        upstream = torch.randn(B, nH, T, Dh, generator=gen, dtype=torch.float64).to(device)
        flex = torch.compile(flex_attention) if env.cuda else flex_attention

        def attention(qkv_rows, positions, attend_rows):
            cos, sin = rope_tables(positions, Dh, CP_ROPE_THETA)
            q, k, v = (t.transpose(1, 2) for t in apply_rope(qkv_rows, cos, sin).unbind(2))
            return attend_rows(q, k, v)

        def run(qkv_rows, positions, attend_rows, rows_upstream):
            leaf = qkv_rows.detach().clone().requires_grad_(grad)
            with torch.set_grad_enabled(grad), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # CPU FlexAttention warns that it is unfused
                y = attention(leaf, positions, attend_rows)
                if grad:
                    (y * rows_upstream.to(y.dtype)).sum().backward()
            return y.detach(), (leaf.grad if grad else None)

        def dense(q, k, v):
            return attend(q, k, v, prepare_visibility(batch, "dense", device))

        mask_mod = flex_mask_mod(batch, device)
        whole_mask = create_block_mask(mask_mod, B, None, T, T, device=device.type)

        def whole_flex(q, k, v):
            return flex(q, k, v, block_mask=whole_mask)

        exact = run(qkv, batch.position_ids, dense, upstream)
        one = run(qkv.float(), batch.position_ids, whole_flex, upstream)

        class FlexCore(torch.nn.Module):
            def forward(self, q, k, v, block_mask):
                return flex(q, k, v, block_mask=block_mask)

        core = parallelize_module(FlexCore(), mesh, _ContextParallel(
            seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
        # contiguous shards (no load balancer: PyTorch's per-document one needs every
        # document length divisible by 2 * ranks); the block mask is rebuilt per shard
        qkv_local, positions, upstream_local, local_mask = _context_parallel_shard(
            mesh, [qkv.float(), batch.position_ids, upstream, whole_mask], [1, 1, 2, 2])
        shard = T // CP_RANKS

        def own(t, dim):  # this rank's columns of a whole-sequence tensor
            return t.narrow(dim, rank * shard, shard)

        def cp(q, k, v):
            return core(q, k, v, local_mask)

        def own_keys(q, k, v):  # WRONG: its own keys stand in for the gathered ones
            n = CP_RANKS
            return flex(q, torch.cat([k] * n, dim=2), torch.cat([v] * n, dim=2),
                        block_mask=local_mask)

        def isolated(q, k, v):  # WRONG: sees only its own shard's keys
            local = create_block_mask(
                lambda b, h, qi, ki: mask_mod(b, h, qi + rank * shard, ki + rank * shard),
                B, None, shard, shard, device=device.type)
            return flex(q, k, v, block_mask=local)

        runs = {"": run(qkv_local, positions, cp, upstream_local),
                "own_keys_": run(qkv_local, positions, own_keys, upstream_local),
                "isolated_": run(qkv_local, positions, isolated, upstream_local),
                # WRONG: rank 0's positions on every rank (unsharded position_ids)
                "rank0_positions_": run(qkv_local, batch.position_ids[:, :shard], cp,
                                        upstream_local)}
        figures = {}
        for index, name, dim in ((0, "output", 2), (1, "grad", 1)):
            if exact[index] is None:
                continue
            reference = own(exact[index], dim)
            one_error = float((own(one[index], dim).double() - reference).abs().max())
            floor = torch.finfo(torch.float32).eps * float(reference.abs().max())  # one ulp
            figures[f"one_process_{name}_error"] = one_error
            figures[f"{name}_tolerance"] = 2 * one_error + floor
            for prefix, outcome in runs.items():
                figures[f"{prefix}{name}_error"] = float(
                    (outcome[index].double() - reference).abs().max())
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


CHECKS: tuple[tuple[str, Callable[[Env, Check], None]], ...] = (
    ("attention", check_attention),
    ("windows", check_windows),
    ("sync_audit", check_sync_audit),
    ("fp16_skip", check_fp16_skip),
    ("resume", check_resume),
    ("fsdp_hf", check_fsdp_hf),
    ("chunked_ce", check_chunked_ce),
    ("mfu", check_mfu),
    ("context_parallel", check_context_parallel),
)


if __name__ == "__main__":
    print(json.dumps(run(quick=False, dry_run="--dry-run" in sys.argv), default=str))
