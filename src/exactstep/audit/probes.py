"""The conformance probes (A1): one observation each, one contract each.

A probe builds the target from a ``ProbeSpec``, feeds it probe data, observes it and
compares with an expectation it computes itself (``reference``), returning a
``Measure``; ``run_probe`` turns any exception into that probe's ``ERROR``, never an
audit crash. fp32 updates must agree with the reference to ``RTOL``.
Design and derivations: docs/design/audit.md#auditprobespy (A1).
"""

from __future__ import annotations

import functools
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from exactstep.audit import data
from exactstep.audit import reference as ref
from exactstep.audit.protocol import Microbatch, ProbeSpec, TrainingStep

RTOL = 1e-4  # fp32 update vs the plain-torch update, relative to the largest change
AMP_RTOL = 2e-2  # a loop may run fp16 autocast under a loss scale (U2)
SPEC = ProbeSpec()
PASS, FAIL, NA, ERROR = "PASS", "FAIL", "N/A", "ERROR"


class NotApplicable(Exception):
    """The target cannot show this property (the reason is the message)."""


class TargetFault(Exception):
    """The target raised, never stepped or returned non-finite values."""


@dataclass
class Measure:
    passed: bool
    expected: str
    observed: str
    expected_values: list[float] = field(default_factory=list)
    observed_values: list[float] = field(default_factory=list)
    fix: str | None = None  # a FAIL's own diagnosis, in place of the probe's general one


@dataclass(frozen=True)
class Probe:
    name: str
    contract: str
    fix: str  # what is wrong and how to fix it, for a FAIL
    measure: Callable[[TrainingStep], Measure]


@dataclass
class Result:
    probe: str
    contract: str
    status: str
    expected: str
    observed: str
    fix: str | None = None
    seconds: float = 0.0
    expected_values: list[float] = field(default_factory=list)
    observed_values: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def run_probe(probe: Probe, step: TrainingStep) -> Result:
    """Run one probe; every failure of the target is this probe's ERROR."""
    started = time.perf_counter()
    try:
        m = probe.measure(step)
        status = PASS if m.passed else FAIL
        result = Result(probe.name, probe.contract, status, m.expected, m.observed,
                        None if m.passed else (m.fix or probe.fix), 0.0, m.expected_values,
                        m.observed_values)
    except NotApplicable as exc:
        result = Result(probe.name, probe.contract, NA, "-", f"not applicable: {exc}")
    except Exception as exc:  # the target's failure, reported per probe (A1)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result = Result(probe.name, probe.contract, ERROR, "-",
                        f"{type(exc).__name__}: {message}"[:300])
    result.seconds = round(time.perf_counter() - started, 3)
    return result


# -- observation helpers ----------------------------------------------------------------

def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def train(step: TrainingStep, microbatches: Sequence[Microbatch]) -> list[float | None]:
    logs = step.train(list(microbatches))
    return list(logs) if logs is not None else []


def check_logs(logs: Sequence[float | None]) -> None:
    bad = [v for v in logs if v is not None and not math.isfinite(float(v))]
    if bad:
        raise TargetFault(f"the loop logged a non-finite loss ({bad[0]})")


def deviation(before: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
              observed: dict[str, torch.Tensor]) -> tuple[float, list[float], list[float]]:
    """Largest |observed - expected| change relative to the largest expected change,
    and per-parameter change norms (expected, observed) for the plot.

    Raises ``TargetFault`` for non-finite parameters or for a step that changed
    nothing where a change was due (the target never steps)."""
    names = list(before)
    for n in names:
        if not torch.isfinite(observed[n]).all():
            raise TargetFault(f"parameter {n!r} is non-finite after train()")
    d_exp = {n: expected[n] - before[n] for n in names}
    d_obs = {n: observed[n] - before[n] for n in names}
    scale = max(float(d.abs().max()) for d in d_exp.values())
    moved = max(float(d.abs().max()) for d in d_obs.values())
    if scale > 0 and moved == 0:
        raise TargetFault("train() changed no parameter: the loop never stepped")
    err = max(float((d_obs[n] - d_exp[n]).abs().max()) for n in names) / max(scale, 1e-30)
    return (err, [float(d_exp[n].norm()) for n in names],
            [float(d_obs[n].norm()) for n in names])


def update_probe(step: TrainingStep, spec: ProbeSpec, microbatches: Sequence[Microbatch],
                 *, reference_microbatches: Sequence[Microbatch] | None = None,
                 rtol: float = RTOL) -> Measure:
    """Build, compute the plain-SGD reference update, train, compare."""
    step.build(spec)
    before = ref.snapshot(step.module)
    expected = ref.reference_sgd(step, reference_microbatches or microbatches, spec)
    check_logs(train(step, microbatches))
    after = ref.snapshot(step.module)
    err, e, o = deviation(before, expected, after)
    observed = f"deviation {err:.2e}"
    if err > rtol:
        observed += diagnosis(step, spec, reference_microbatches or microbatches, before,
                              after, rtol)
    return Measure(err <= rtol, f"update within {rtol:.0e} of the reference", observed, e, o)


def diagnosis(step: TrainingStep, spec: ProbeSpec, microbatches: Sequence[Microbatch],
              before: dict, after: dict, rtol: float) -> str:
    """``"; matches <a known wrong update>"`` when the observed update is one of them
    (a wrong alignment, an unclipped update, each computed the same plain way from the
    same start), or ``"; the update is c x the reference ..."`` when it is the
    reference's update scaled by one constant; else ``""``."""
    for label, align in ref.WRONG_ALIGNMENTS.items():
        try:
            wrong = ref.reference_sgd(step, microbatches, spec, start=before, align=align)
        except (RuntimeError, ValueError):
            continue
        if deviation(before, wrong, after)[0] <= rtol:
            return f"; matches {label}"
    if spec.clip > 0:
        unclipped = ref.reference_sgd(step, microbatches, replace(spec, clip=0.0), start=before)
        if deviation(before, unclipped, after)[0] <= rtol:
            return "; matches an unclipped update (the clip was never applied)"
    expected = ref.reference_sgd(step, microbatches, spec, start=before)
    factor = scale_factor(before, expected, after)
    if factor is not None:
        return (f"; the update is {factor:.3g}x the reference: a denominator (or the rate) "
                "is off by that factor")
    return ""


def scale_factor(before: dict, expected: dict, observed: dict,
                 tol: float = 1e-3) -> float | None:
    """``c`` when the observed change is ``c`` times the expected one (within ``tol`` of
    the largest change) and ``c`` is not 1; else ``None``."""
    e = torch.cat([(expected[n] - before[n]).flatten() for n in before]).double()
    o = torch.cat([(observed[n] - before[n]).flatten() for n in before]).double()
    if float(e.abs().max()) == 0 or float(o.abs().max()) == 0:
        return None
    c = float(o @ e / (e @ e))
    if abs(c - 1.0) <= 1e-2 or float((o - c * e).abs().max()) > tol * float((c * e).abs().max()):
        return None
    return c


# -- data of the probes -----------------------------------------------------------------

def plain_rows(seed: int = 1, n: int = 2, length: int = 8, spec: ProbeSpec = SPEC) -> Microbatch:
    """Equal-length rows, one document each, no EOS and no padding."""
    g = gen(seed)
    return data.single([data.text(g, length, spec) for _ in range(n)], spec)


# -- the probes -------------------------------------------------------------------------

def shift(step: TrainingStep) -> Measure:
    return update_probe(step, SPEC, [plain_rows()])


def eos_target(step: TrainingStep) -> Measure:
    g = gen(2)
    mb = data.single([data.text(g, 8, SPEC, eos=True) for _ in range(2)], SPEC)
    return update_probe(step, SPEC, [mb])


def padding(step: TrainingStep) -> Measure:
    g = gen(3)
    mb = data.single([data.text(g, n, SPEC) for n in (10, 4, 7)], SPEC, length=12)
    return update_probe(step, SPEC, [mb])


def accumulation(step: TrainingStep) -> Measure:
    g = gen(4)
    long = data.single([data.text(g, 10, SPEC)], SPEC)
    short = data.single([data.text(g, 3, SPEC) for _ in range(2)], SPEC)
    return update_probe(step, replace(SPEC, accum=2), [long, short])


def remainder(step: TrainingStep) -> Measure:
    mbs = [plain_rows(seed=10 + i, n=1, length=6) for i in range(3)]
    return update_probe(step, replace(SPEC, accum=2), mbs)


LOGGING = replace(SPEC, accum=2)
LOG_RTOL = 1e-4  # a log rounded to 4 decimals (as Trainer's was) still passes


def logging_windows() -> list[list[Microbatch]]:
    """Two windows of two microbatches with unequal target counts (8 and 6, 10 and 2):
    a mean of microbatch means or one micro-step's mean is not the window's token mean."""
    return [[plain_rows(seed=96, n=1, length=9), plain_rows(seed=97, n=2, length=4)],
            [plain_rows(seed=98, n=2, length=6), plain_rows(seed=99, n=1, length=3)]]


def logged_loss(step: TrainingStep) -> Measure:
    """The loss ``train`` logs for each committed window equals the window's declared
    token mean (U1, U4's ledger loss) at the parameters the window was evaluated at,
    within ``LOG_RTOL``; then the same under a loss scale of 1024 (logged unscaled),
    unless the target cannot scale (that half N/A, said). Window 2's expectation is
    taken at the target's own parameters after window 1 (a fresh build trained on
    window 1), so a wrong update is not blamed on the log."""
    m = logged_under(step, LOGGING)
    if not m.passed:
        return m
    try:
        scaled = logged_under(step, replace(LOGGING, loss_scale=1024.0))
    except NotApplicable as exc:
        m.observed += f"; under a loss scale: not applicable ({exc})"
        return m
    scaled.observed = f"{m.observed}; under a loss scale of 1024: {scaled.observed}"
    scaled.expected = f"{m.expected}, unscaled under a loss scale"
    return scaled


def logged_under(step: TrainingStep, spec: ProbeSpec) -> Measure:
    windows = logging_windows()
    step.build(spec)
    expected = [ref.window_loss(step, windows[0], spec)]
    logs = train(step, [mb for window in windows for mb in window])
    if all(v is None for v in logs):
        raise NotApplicable("train() logs no loss (None for every window)")
    step.build(spec)
    check_logs(train(step, windows[0]))
    expected.append(ref.window_loss(step, windows[1], spec))
    want = [value for value, _ in expected]
    declared = ("each window's token-mean loss " + ", ".join(f"{v:.6f}" for v in want)
                + f" (within {LOG_RTOL:.0e} relative)")
    if len(logs) != len(windows) or any(v is None for v in logs):
        return Measure(False, declared, f"logged {list(logs)} for {len(windows)} committed "
                       "windows", want, [])
    check_logs(logs)
    got = [float(v) for v in logs]
    errs = [abs(o - e) / abs(e) for o, e in zip(got, want, strict=True)]
    observed = "logged " + ", ".join(f"{v:.6f}" for v in got)
    if max(errs) > LOG_RTOL:
        observed += log_diagnosis(got, expected, spec)
    return Measure(max(errs) <= LOG_RTOL, declared, observed, want, got)


def log_diagnosis(got: Sequence[float], expected: Sequence[tuple[float, list]],
                  spec: ProbeSpec) -> str:
    """``"; matches <a known wrong log>"`` when every logged value is one of them."""
    scale = spec.loss_scale or 1.0
    wrong = {
        "the last micro-step's mean (nanoGPT's loss.item() * accum)":
            lambda v, parts: parts[-1][0] / parts[-1][1],
        "a mean of the microbatches' means": lambda v, parts: sum(
            s / n for s, n in parts) / len(parts),
        f"the loss still multiplied by the loss scale ({scale:g})": lambda v, parts: v * scale,
        "the window's loss sum, not its mean": lambda v, parts: sum(s for s, _ in parts),
        f"the loss divided by the accumulation count ({spec.accum})":
            lambda v, parts: v / spec.accum,
        "the first micro-step's mean": lambda v, parts: parts[0][0] / parts[0][1],
    }
    for label, value in wrong.items():
        if all(abs(o - value(v, parts)) <= LOG_RTOL * abs(value(v, parts))
               for o, (v, parts) in zip(got, expected, strict=True)):
            return f"; matches {label}"
    return ""


def schedule_clock(step: TrainingStep) -> Measure:
    """Two windows of two equal microbatches under a warmup of 4: the updates are taken
    at the declared ``lr_at(0)``, ``lr_at(1)`` (lr/4, lr/2): the schedule counts
    committed updates (U5). A FAIL names the known wrong schedule it matches."""
    spec = replace(SPEC, accum=2, warmup=4)
    mbs = [plain_rows(seed=50 + i, n=1, length=6) for i in range(4)]
    m = update_probe(step, spec, mbs)
    if not m.passed:
        m.observed += schedule_diagnosis(step, spec, mbs)
    return m


def schedule_diagnosis(step: TrainingStep, spec: ProbeSpec,
                       mbs: Sequence[Microbatch]) -> str:
    """``"; matches <a known wrong schedule>"`` for the update ``train`` makes from a
    fresh build, or ``""``."""
    wrong = {
        "a microbatch clock (update k at lr(k * accum))": lambda k: spec.lr_at(k * spec.accum),
        "a warmup counted from 0 (update k at lr(k - 1) = lr * k / warmup: the first at "
        "lr 0)": lambda k: spec.lr * min(1.0, k / spec.warmup),
        "a schedule one update ahead (update k at lr(k + 1): the scheduler stepped before "
        "the optimizer)": lambda k: spec.lr_at(k + 1),
    }
    step.build(spec)
    before = ref.snapshot(step.module)
    expected = {label: ref.reference_sgd(step, mbs, spec, lr_at=lr) for label, lr in
                wrong.items()}
    train(step, mbs)
    after = ref.snapshot(step.module)
    for label, params in expected.items():
        if deviation(before, params, after)[0] <= RTOL:
            return f"; matches {label}"
    return ""


WORLD = 2  # ranks of the data-parallel probe (gloo, one host)
DDP_TIMEOUT_S = 60.0


def ddp_token_mean(step: TrainingStep) -> Measure:
    """Two ranks with unequal target counts (18 and 3) take one window of two
    microbatches each: the update must be one process's over the four microbatches as
    one window (D5, D1). Two micro-steps per rank put DDP's ``no_sync`` in play: a
    reduction that never runs (ranks diverge) or runs on the wrong values fails."""
    if not getattr(step, "data_parallel", False):
        raise NotApplicable("the target does not declare data-parallel training "
                            "(TrainingStep.data_parallel)")
    g = gen(40)
    ranks = [[data.single([data.text(g, 10, SPEC)], SPEC) for _ in range(2)],
             [data.single([data.text(g, n, SPEC)], SPEC) for n in (2, 3)]]
    spec = replace(SPEC, accum=2)
    step.build(spec)
    before = ref.snapshot(step.module)
    expected = ref.reference_sgd(step, [mb for rank in ranks for mb in rank],
                                 replace(spec, accum=2 * WORLD))
    observed = run_ranks(step, spec, ranks)
    for rank, params in enumerate(observed[1:], start=1):
        if any(not torch.equal(params[n], observed[0][n]) for n in params):
            return Measure(False, "every rank holds the same parameters",
                           f"rank {rank}'s parameters differ from rank 0's")
    err, e, o = deviation(before, expected, observed[0])
    return Measure(err <= RTOL, f"update within {RTOL:.0e} of one process over the "
                   "global window", f"deviation {err:.2e}", e, o)


def run_ranks(step: TrainingStep, spec: ProbeSpec,
              microbatches: Sequence[Sequence[Microbatch]]) -> list[dict[str, torch.Tensor]]:
    """Each rank ``r`` (a forked process in a gloo group) builds ``step`` from ``spec``
    and trains on ``microbatches[r]``; their parameters afterwards, by rank.

    A rank that raises, or a job that exceeds ``DDP_TIMEOUT_S``, is a ``TargetFault``
    naming the rank's error."""
    return run_job(rank_worker, len(microbatches),
                   (step, spec, [list(r) for r in microbatches]))


def run_job(worker: Callable[..., None], world: int, args: tuple) -> list:
    """``worker(rank, world, port, *args, out)`` in ``world`` forked processes of one
    gloo job (``spawn`` where fork is missing); what each rank saved to ``out/RANK.pt``,
    by rank. A rank that raises, or a job past ``DDP_TIMEOUT_S``, is a
    ``TargetFault`` naming the rank's error."""
    import torch.multiprocessing as mp

    from exactstep.parallel.process_group import free_port

    with tempfile.TemporaryDirectory(prefix="exactstep-audit-ranks-") as tmp:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        if method == "fork":
            warm_ddp()
        job = mp.start_processes(worker, args=(world, free_port(), *args, tmp), nprocs=world,
                                 join=False, start_method=method)
        deadline = time.monotonic() + DDP_TIMEOUT_S
        try:
            while not job.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TargetFault(f"the {world} ranks did not finish within "
                                      f"{DDP_TIMEOUT_S:g} s (a collective never matched)")
        except mp.ProcessRaisedException as exc:
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            raise TargetFault(f"a rank raised: {lines[-1].strip()}") from None
        except mp.ProcessExitedException as exc:
            raise TargetFault(f"a rank died: {exc}") from None
        finally:
            for process in job.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(Path(tmp) / f"{r}.pt") for r in range(world)]


@functools.cache
def warm_ddp() -> None:
    """Construct DDP once in this process (a world-1 gloo group, torn down after), so
    forked ranks inherit what DDP imports on first use (seconds) instead of each
    importing it again. Skipped inside a job that already has a process group."""
    import torch.distributed as dist

    from exactstep.parallel.process_group import free_port

    if dist.is_initialized():
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    finally:
        dist.destroy_process_group()


def rank_worker(rank: int, world: int, port: int, step: TrainingStep, spec: ProbeSpec,
                microbatches: list[list[Microbatch]], out: str) -> None:
    """One rank of ``run_ranks``: join the group, build, train, publish parameters."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=DDP_TIMEOUT_S))
    try:
        step.build(spec)
        check_logs(train(step, microbatches[rank]))
        torch.save(ref.snapshot(step.module), Path(out) / f"{rank}.pt")
        dist.barrier()  # no rank tears the group down under a peer's pending gloo work
    finally:
        dist.destroy_process_group()


def packed_documents(step: TrainingStep) -> Measure:
    g = gen(5)
    a, b, c, d = (data.text(g, n, SPEC) for n in (5, 6, 7, 4))
    packed = data.microbatch([[a, b], [c, d]], SPEC)
    unpacked = data.single([a, b, c, d], SPEC)
    return update_probe(step, SPEC, [packed], reference_microbatches=[unpacked])


def cross_document_attention(step: TrainingStep) -> Measure:
    step.build(SPEC)
    g = gen(6)
    mb = data.microbatch([[data.text(g, 5, SPEC), data.text(g, 6, SPEC)]], SPEC)
    in_a = (mb.documents == 1) & (mb.positions > 0)
    moved = data.replace_tokens(mb, in_a, g, SPEC)
    change = (logits_of(step, moved) - logits_of(step, mb)).abs().amax(-1)[0]  # [L]
    b_cols = mb.documents[0] == 2
    if float(change[~b_cols].max()) == 0.0:
        raise TargetFault("perturbing document A did not change A's logits")
    leak = float(change[b_cols].max())
    return Measure(leak <= 1e-6, "B's logits move 0 when A changes",
                   f"B's logits moved {leak:.2e}", [0.0] * int(b_cols.sum()),
                   [float(v) for v in change[b_cols]])


def logits_of(step: TrainingStep, mb: Microbatch) -> torch.Tensor:
    """Eval-mode logits of whole rows, ``[B, L, V]``; non-finite ones are a fault."""
    with ref.eval_mode(step.module), torch.no_grad():
        out = step.logits(mb.tokens, mb.positions, mb.documents)
    if not torch.isfinite(out).all():
        raise TargetFault("logits() returned non-finite values")
    return out


def causal_attention(step: TrainingStep) -> Measure:
    step.build(SPEC)
    mb = plain_rows(seed=22, n=1, length=10)
    later = torch.zeros_like(mb.owned)
    later[0, 6:] = True
    change = (logits_of(step, data.replace_tokens(mb, later, gen(23), SPEC))
              - logits_of(step, mb)).abs().amax(-1)[0]  # [L]
    if float(change[6:].max()) == 0.0:
        raise TargetFault("perturbing tokens 6.. did not change their own logits")
    leak = float(change[:6].max())
    return Measure(leak <= 1e-6, "logits of tokens 0-5 move 0 when tokens 6.. change",
                   f"they moved {leak:.2e}", [0.0] * 6, [float(v) for v in change[:6]])


def chat_rows(seed: int) -> Microbatch:
    g = gen(seed)
    return data.single([data.chat(g, 4, 3, SPEC), data.chat(g, 3, 4, SPEC)], SPEC)


def chat_ownership(step: TrainingStep) -> Measure:
    return update_probe(step, SPEC, [chat_rows(7)])


def prompt_visible(step: TrainingStep) -> Measure:
    mb = chat_rows(7)
    last_prompt = ~mb.owned & torch.roll(mb.owned, -1, dims=1)
    prompt = (mb.positions > 0) & ~mb.owned & ~last_prompt  # the answers must see these
    moved = data.replace_tokens(mb, prompt, gen(8), SPEC)
    deltas = []
    for batch in (mb, moved):
        step.build(SPEC)
        before = ref.snapshot(step.module)
        check_logs(train(step, [batch]))
        after = ref.snapshot(step.module)
        deltas.append(torch.cat([(after[n] - before[n]).flatten() for n in before]))
    scale = float(deltas[0].abs().max())
    if scale == 0:
        raise TargetFault("train() changed no parameter: the loop never stepped")
    diff = float((deltas[1] - deltas[0]).abs().max()) / scale
    return Measure(diff > 1e-3, "the update changes when the prompt changes (> 1e-3)",
                   f"relative change {diff:.2e}")


def label_smoothing(step: TrainingStep) -> Measure:
    spec = replace(SPEC, label_smoothing=0.3,
                   smoothing_convention=getattr(step, "smoothing_convention", "harvard"))
    g = gen(9)
    mb = data.single([data.text(g, 8, spec), data.text(g, 5, spec)], spec, length=8)
    m = update_probe(step, spec, [mb])
    m.expected = f"{spec.smoothing_convention} smoothing: " + m.expected
    return m


def clip_spec(step: TrainingStep, spec: ProbeSpec, window: Sequence[Microbatch]) -> None:
    step.build(spec)
    grads, _ = ref.window_gradient(step, window, spec)
    norm = float(torch.stack([g.norm() for g in grads.values()]).norm())
    if norm < 10 * spec.clip:
        raise RuntimeError(f"the probe's gradient norm {norm:.2e} is too small to clip")


def clip_global_norm(step: TrainingStep) -> Measure:
    """A rate large enough that the clipped step (norm ``lr * clip`` = 0.05) dwarfs fp32
    rounding: at ``lr`` 0.5 the largest change of one parameter was about 8e-5, so one
    ulp of a weight of 0.2 (1.5e-8) was already 2e-4 of it, a FAIL of rounding alone."""
    spec = replace(SPEC, clip=1e-3, lr=50.0)
    mb = plain_rows(seed=11)
    clip_spec(step, spec, [mb])
    return update_probe(step, spec, [mb])


def scaled_clip(step: TrainingStep) -> Measure:
    """A window of two equal microbatches under one loss scale: unscaled once, at the
    close (U2), then clipped (U3); unscaling after the first micro-step adds scaled
    gradients to unscaled ones."""
    spec = replace(SPEC, clip=1e-3, loss_scale=1024.0, accum=2)
    window = [plain_rows(seed=11), plain_rows(seed=24)]
    clip_spec(step, spec, window)
    return update_probe(step, spec, window, rtol=AMP_RTOL)


ADAMW = replace(SPEC, optimizer="adamw", lr=0.01, weight_decay=0.1, eps=1e-3)


def adamw_observation(step: TrainingStep) -> tuple[dict, dict[str, bool], dict[str, float]]:
    """One AdamW step; per parameter, which declared form (decayed or not) is closer to
    the observed change and how far it is from it (relative to the largest change)."""
    mb = plain_rows(seed=12)
    step.build(ADAMW)
    before = ref.snapshot(step.module)
    grads, _ = ref.window_gradient(step, [mb], ADAMW)
    check_logs(train(step, [mb]))
    after = ref.snapshot(step.module)
    forms = {flag: ref.adamw_first_step(before, grads, ADAMW, dict.fromkeys(before, flag))
             for flag in (True, False)}
    deviation(before, forms[True], after)  # non-finite / never stepped -> ERROR
    scale = max(float((forms[False][n] - before[n]).abs().max()) for n in before)
    closest, err = {}, {}
    for n in before:
        e = {f: float((after[n] - forms[f][n]).abs().max()) / scale for f in forms}
        closest[n] = e[True] < e[False]
        err[n] = min(e.values())
    return before, closest, err


def adamw_decoupled(step: TrainingStep) -> Measure:
    _, _, err = adamw_observation(step)
    worst = max(err.values())
    return Measure(worst <= RTOL, f"AdamW step theta(1 - lr wd) - lr g/(|g|+eps) "
                   f"within {RTOL:.0e}", f"deviation {worst:.2e}")


def decay_groups(step: TrainingStep) -> Measure:
    _, closest, err = adamw_observation(step)
    if max(err.values()) > RTOL:
        raise NotApplicable("the update is not a decoupled AdamW step (see adamw_decoupled)")
    declared = ref.decays(step, plain_rows(seed=12))
    wrong = sorted(n for n in declared if declared[n] != closest[n])
    return Measure(not wrong, "decay on matrices only (no norms, biases, tables the forward "
                   "reads as embeddings)",
                   "as declared" if not wrong else "wrong decay on " + ", ".join(wrong))


def prefix_runs(step: TrainingStep, spec: ProbeSpec,
                windows: Sequence[Microbatch]) -> list[dict[str, torch.Tensor]]:
    """The parameters at the start and after each of ``windows`` (one microbatch each,
    ``accum`` 1): window ``k``'s state comes from a fresh build and one ``train`` call
    over the first ``k`` windows, as a user runs the loop (a loop whose ``train``
    restarts its schedule or optimizer per call is observed over one call)."""
    states = []
    for k in range(1, len(windows) + 1):
        step.build(spec)
        if k == 1:
            states.append(ref.snapshot(step.module))
        check_logs(train(step, windows[:k]))
        states.append(ref.snapshot(step.module))
    return states


ADAMW_STEPS = replace(ADAMW, betas=(0.8, 0.9))  # unequal, non-default: both moments show


def first_step_decay(step: TrainingStep, before: dict, first: dict,
                     window: Microbatch) -> tuple[dict[str, bool], set[str]]:
    """Per parameter, whether the observed first update is the decayed AdamW form
    (``decay_groups`` owns the grouping, so ``adamw_steps`` follows the target's), and
    the parameters whose two forms coincide there (zero-initialized norm biases: their
    decay shows only later), given the declared group."""
    ref.restore(step.module, before)
    grads, _ = ref.window_gradient(step, [window], ADAMW_STEPS)
    forms = {flag: ref.adamw_first_step(before, grads, ADAMW_STEPS,
                                        dict.fromkeys(before, flag)) for flag in (True, False)}
    declared = ref.decays(step, window)
    decay, unseen = {}, set()
    for n in before:
        e = {f: float((first[n] - forms[f][n]).abs().max()) for f in forms}
        decay[n] = declared[n] if e[True] == e[False] else e[True] < e[False]
        if e[True] == e[False]:
            unseen.add(n)
    return decay, unseen


def adamw_steps(step: TrainingStep) -> Measure:
    """Four AdamW windows (betas (0.8, 0.9), weight decay 0.1): the parameters after
    each window against ``torch.optim.AdamW`` from the same initial parameters, driven
    by the reference gradients (U6). Past the first update the betas, the step count
    and the bias correction no longer cancel. The decay group is the one the first
    update shows; the parameters it cannot show are tried decayed and not, as one."""
    windows = [plain_rows(seed=70 + i) for i in range(4)]
    states = prefix_runs(step, ADAMW_STEPS, windows)
    decay, unseen = first_step_decay(step, states[0], states[1], windows[0])
    groupings = [decay] + ([{**decay, **{n: not decay[n] for n in unseen}}] if unseen else [])
    errs: list[float] = []
    for grouping in groupings:
        ref.restore(step.module, states[0])
        expected = ref.reference_adamw(step, windows, ADAMW_STEPS, grouping)
        e = [deviation(states[0], x, o)[0] for x, o in zip(expected, states[1:], strict=True)]
        if not errs or max(e) < max(errs):
            errs = e
    observed = "deviation after each window: " + ", ".join(f"{e:.1e}" for e in errs)
    if max(errs) > RTOL:
        observed += adamw_diagnosis(step, windows, states, groupings[0])
    return Measure(max(errs) <= RTOL, f"each of {len(windows)} AdamW updates (betas "
                   f"{ADAMW_STEPS.betas}) within {RTOL:.0e} of torch.optim.AdamW",
                   observed, [0.0] * len(errs), errs)


def adamw_diagnosis(step: TrainingStep, windows: Sequence[Microbatch], states: list[dict],
                    grouping: dict[str, bool]) -> str:
    """``"; matches <a known wrong AdamW>"`` (``reference.ADAMW_VARIANTS``) or ``""``."""
    ref.restore(step.module, states[0])
    declared = ref.decays(step, windows[0])
    for variant, label in ref.ADAMW_VARIANTS.items():
        for decay in ([grouping, declared] if declared != grouping else [grouping]):
            ref.restore(step.module, states[0])
            expected = ref.reference_adamw(step, windows, ADAMW_STEPS, decay, variant=variant)
            if all(deviation(states[0], x, o)[0] <= RTOL
                   for x, o in zip(expected, states[1:], strict=True)):
                return f"; matches {label}"
    return ""


AFTER_WARMUP = replace(SPEC, warmup=2)


def schedule_after_warmup(step: TrainingStep) -> Measure:
    """Four SGD windows under a warmup of 2: each update ``k``, taken from the target's
    own parameters before it, is ``lr_k`` times the reference gradient there; the
    updates past warm-up (``k >= warmup``) must be at ``lr_at(k) = lr`` (U5). The
    warm-up's own updates are ``schedule_clock``'s; every observed rate is reported."""
    spec = AFTER_WARMUP
    windows = [plain_rows(seed=80 + i, n=1, length=6) for i in range(4)]
    states = prefix_runs(step, spec, windows)
    observed, errs, deltas, gradients = [], [], [], []
    for k, window in enumerate(windows):
        before, after = states[k], states[k + 1]
        if any(not torch.isfinite(v).all() for v in after.values()):
            raise TargetFault("a parameter is non-finite after train()")
        ref.restore(step.module, before)
        grads, _ = ref.window_gradient(step, [window], spec)
        delta = {n: after[n] - before[n] for n in grads}
        deltas.append(delta)
        gradients.append(grads)
        norm2 = sum(float((g * g).sum()) for g in grads.values())
        observed.append(-sum(float((delta[n] * grads[n]).sum()) for n in grads) / norm2)
        scale = spec.lr_at(k) * max(float(g.abs().max()) for g in grads.values())
        errs.append(max(float((delta[n] + spec.lr_at(k) * grads[n]).abs().max())
                        for n in grads) / scale)
    if all(torch.equal(states[0][n], states[-1][n]) for n in states[0]):
        raise TargetFault("train() changed no parameter: the loop never stepped")
    declared = [spec.lr_at(k) for k in range(len(windows))]
    late = range(spec.warmup, len(windows))
    passed = all(errs[k] <= RTOL for k in late)
    text = ("rates " + ", ".join(f"{v + 0.0:.4g}" for v in observed) + "; deviation of "
            f"updates {late.start}..{late.stop - 1}: " + ", ".join(f"{errs[k]:.1e}" for k in late))
    if not passed and momentum_matches(spec, deltas, gradients):
        text += f"; matches SGD with momentum {MOMENTUM:g} (declared: plain SGD)"
    return Measure(passed, f"updates {late.start}..{late.stop - 1} at lr {spec.lr:g} (declared "
                   f"rates {', '.join(f'{v:g}' for v in declared)}), within {RTOL:.0e}",
                   text, declared, observed)


MOMENTUM = 0.9  # torch.optim.SGD's momentum as users set it


def momentum_matches(spec: ProbeSpec, deltas: list[dict], gradients: list[dict]) -> bool:
    """Whether every update ``k`` is ``-lr(k) * b_k`` with ``b_k = 0.9 b_{k-1} + g_k``
    (``torch.optim.SGD(momentum=0.9)``), ``g_k`` the gradient at the target's parameters."""
    buffer: dict[str, torch.Tensor] = {}
    for k, (delta, grads) in enumerate(zip(deltas, gradients, strict=True)):
        buffer = {n: g if k == 0 else MOMENTUM * buffer[n] + g for n, g in grads.items()}
        scale = spec.lr_at(k) * max(float(b.abs().max()) for b in buffer.values())
        if max(float((delta[n] + spec.lr_at(k) * buffer[n]).abs().max())
               for n in delta) > RTOL * scale:
            return False
    return True


SKIP = replace(SPEC, warmup=4)
MARK = 3  # the one content token of the marked window the injections recognise


def marked_window(spec: ProbeSpec = SPEC) -> Microbatch:
    """Two rows ``BOS MARK x 8``: a window recognisable by its token ids wherever the
    loop looks them up (no other probe window has a row of one repeated token)."""
    return repeated_rows(MARK, spec, length=9)


class Injector(TorchDispatchMode):
    """Watches every lookup in a table of the vocabulary's size (``aten.embedding``,
    integer indexing: ``nn.Embedding``, ``F.embedding``, ``W[ids]``): ``marked`` is
    whether the last one read the marked window's ids. ``nan_forward``: that lookup's
    output becomes NaN (a non-finite loss); otherwise the parameters' gradient hooks
    (``poison_gradients``) return NaN while ``marked`` (a finite loss, a non-finite
    gradient). ``fired`` counts the values made NaN."""

    def __init__(self, vocab_size: int, nan_forward: bool) -> None:
        super().__init__()
        self.vocab_size, self.nan_forward = vocab_size, nan_forward
        self.marked, self.fired = False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        ids = ref.lookup_ids(func, args)
        if ids is None or args[0].shape[0] != self.vocab_size:
            return out
        content = ids[ids > SPEC.eos_id]
        self.marked = content.numel() >= 8 and bool((content == MARK).all())
        if self.marked and self.nan_forward and out.is_floating_point():
            self.fired += 1
            return out * float("nan")
        return out


def poison_gradients(step: TrainingStep, injector: Injector) -> list:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not injector.marked:
            return grad
        injector.fired += 1
        return torch.full_like(grad, float("nan"))

    return [p.register_hook(hook) for _, p in ref.named_parameters(step.module)]


def injected_train(step: TrainingStep, windows: Sequence[Microbatch],
                   injection: str | None, vocab_size: int) -> tuple[list, int]:
    """``train(windows)`` in one call with ``injection`` (``"forward"``, ``"gradient"``
    or ``None``) active for the marked window; the logs and how often it fired."""
    if injection is None:
        return train(step, windows), 1
    injector = Injector(vocab_size, nan_forward=injection == "forward")
    handles = poison_gradients(step, injector) if injection == "gradient" else []
    try:
        with injector:
            logs = train(step, windows)
    finally:
        for handle in handles:
            handle.remove()
    return logs, injector.fired


def skipped_window(step: TrainingStep, spec: ProbeSpec, bad: Microbatch,
                   injection: str | None, what: str) -> Measure:
    """A window that must be skipped (``what``; U4, U5, L4), observed three ways from
    fresh builds: the loop's own updates on good windows; the bad window alone must
    change nothing and log no finite loss; the bad window then the good ones, in one
    ``train`` call, must end where the loop's own good updates end (the skip advanced
    no schedule, moment or counter). Comparing with the loop itself keeps a wrong update
    rule the update probes' finding. The good run is one window, or two when the loop's
    first update is at rate 0 (a warm-up counted from 0)."""
    step.build(spec)
    before = ref.snapshot(step.module)
    logs, fired = injected_train(step, [bad], injection, spec.vocab_size)
    if not fired:
        raise NotApplicable("the injected NaN never reached the loop: no table of the "
                            "vocabulary's size was read with the marked window's ids")
    changed = [n for n, v in ref.snapshot(step.module).items() if not torch.equal(before[n], v)]
    if changed:
        return Measure(False, f"the window with {what} changes nothing",
                       f"{len(changed)} parameters changed")
    logged = [float(v) for v in logs if v is not None and math.isfinite(float(v))]
    if logged:
        return Measure(False, f"the window with {what} logs no loss (or marks it skipped)",
                       f"it logged {logged[0]:.6g} as a committed window's loss")
    goods = [plain_rows(seed=15)]
    step.build(spec)
    if moved(before, ref.snapshot(step.module)):
        raise TargetFault("two builds of one spec differ: build() must seed the model")
    check_logs(train(step, goods))
    own = ref.snapshot(step.module)
    if not moved(before, own):
        goods.append(plain_rows(seed=16))
        step.build(spec)
        check_logs(train(step, goods))
        own = ref.snapshot(step.module)
        if not moved(before, own):
            raise TargetFault("train() changed no parameter: the loop never stepped")
    step.build(spec)
    logs, _ = injected_train(step, [bad, *goods], injection, spec.vocab_size)
    check_logs(logs[1:])
    after = ref.snapshot(step.module)
    if not moved(before, after):
        return Measure(False, f"after the window with {what} the next good window updates",
                       "the next good window changed nothing: the skipped window's gradient "
                       "was not cleared (zero the gradients on a skip)")
    err, e, o = deviation(before, own, after)
    ratio = sum(o) / max(sum(e), 1e-30)
    observed = f"then x{ratio:.3f} of the loop's own update, deviation {err:.2e}"
    ahead = spec.lr_at(1) / spec.lr_at(0)
    if err > RTOL and len(goods) == 1 and abs(ratio - ahead) <= 1e-3 * ahead:
        observed += "; matches a schedule advanced by the skipped window (lr(1), not lr(0))"
    return Measure(err <= RTOL, f"the window with {what} is skipped (nothing changed or "
                   "logged) and the next update is the loop's own first one, at lr(0)",
                   observed, e, o)


def zero_target_window(step: TrainingStep) -> Measure:
    """A window without a supervised target under AdamW with weight decay (a step with
    zero gradients would still decay and move the moments): nothing changes, nothing is
    logged; then, under a warm-up of 4, it must not advance the schedule (L4, U5)."""
    g = gen(13)
    tokens, _ = data.chat(g, 4, 0, SPEC)
    mb = data.single([(tokens, torch.zeros(len(tokens), dtype=torch.bool))] * 2, SPEC)
    step.build(ADAMW)
    before = ref.snapshot(step.module)
    logs = train(step, [mb])
    after = ref.snapshot(step.module)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    logged = [v for v in logs if v is not None]
    if changed or logged:
        return Measure(False, "no parameter changes, no loss logged",
                       f"{len(changed)} parameters changed, logged {logged}")
    return skipped_window(step, SKIP, mb, None, "no supervised target")


def nonfinite_skip(step: TrainingStep) -> Measure:
    """The marked window's forward made non-finite at its table lookup (U4)."""
    return skipped_window(step, SKIP, marked_window(), "forward", "a non-finite loss")


SKIP_SCALED = replace(SKIP, loss_scale=1024.0)


def nonfinite_gradient(step: TrainingStep) -> Measure:
    """The marked window with a finite loss and NaN gradients (a hook on every
    parameter), under a loss scaler as an overflow gives (U4, U5): a skip decided from
    the loss alone lets ``GradScaler.step`` skip the update while the loop still
    advances its schedule and logs. A target without a loss scaler runs it unscaled."""
    try:
        step.build(SKIP_SCALED)
        spec = SKIP_SCALED
    except NotApplicable:
        spec = SKIP
    return skipped_window(step, spec, marked_window(), "gradient",
                          "a finite loss and a non-finite gradient")


DROPOUT = replace(SPEC, dropout=0.5)


def require_dropout(step: TrainingStep) -> None:
    mb = plain_rows()
    inputs = (mb.tokens, mb.positions, mb.documents)
    modes = [(m, m.training) for m in step.module.modules()]
    step.module.train()
    try:
        with torch.no_grad():
            differ = not torch.equal(step.logits(*inputs), step.logits(*inputs))
    finally:
        for m, training in modes:
            m.training = training
    if not differ:
        raise NotApplicable("the model has no dropout (two train-mode forwards agree)")


def train_mode(step: TrainingStep) -> Measure:
    step.build(DROPOUT)
    require_dropout(step)
    step.build(DROPOUT)
    mb = plain_rows(seed=16)
    before = ref.snapshot(step.module)
    expected = ref.reference_sgd(step, [mb], DROPOUT)  # the eval-mode (no dropout) update
    check_logs(train(step, [mb]))
    err, e, o = deviation(before, expected, ref.snapshot(step.module))
    return Measure(err > 1e-3, "update differs from the dropout-free one (> 1e-3)",
                   f"relative difference {err:.2e}", e, o)


def finite_eval(step: TrainingStep, mbs: Sequence[Microbatch]) -> tuple[float, float]:
    loss, ppl = (float(v) for v in step.evaluate(mbs))
    if not (math.isfinite(loss) and math.isfinite(ppl)):
        raise TargetFault(f"evaluate() returned non-finite values ({loss}, {ppl})")
    return loss, ppl


def eval_mode(step: TrainingStep) -> Measure:
    step.build(DROPOUT)
    require_dropout(step)
    mbs = [plain_rows(seed=17), plain_rows(seed=18)]
    total, count = ref.eval_reference(step, mbs, DROPOUT)
    loss, _ = finite_eval(step, mbs)
    want = total / count
    err = abs(float(loss) - want) / want
    return Measure(err <= 1e-5, f"loss {want:.6f} (eval mode, no dropout)",
                   f"loss {float(loss):.6f}", [want], [float(loss)])


def eval_isolation(step: TrainingStep) -> Measure:
    step.build(DROPOUT)
    step.module.train()
    modes = [m.training for m in step.module.modules()]
    before = ref.snapshot(step.module)
    rng = torch.get_rng_state()
    step.evaluate([plain_rows(seed=19)])
    changed = []
    if not torch.equal(rng, torch.get_rng_state()):
        changed.append("the global RNG")
    if any(not torch.equal(before[n], v) for n, v in ref.snapshot(step.module).items()):
        changed.append("parameters")
    if modes != [m.training for m in step.module.modules()]:
        changed.append("the train/eval mode")
    return Measure(not changed, "RNG, parameters and mode unchanged",
                   "unchanged" if not changed else "changed " + ", ".join(changed))


def perplexity(step: TrainingStep) -> Measure:
    step.build(SPEC)
    mbs = [plain_rows(seed=20, n=1, length=10), plain_rows(seed=21, n=1, length=3)]
    total, count = ref.eval_reference(step, mbs, SPEC)
    _, ppl = finite_eval(step, mbs)
    want = math.exp(total / count)
    err = abs(float(ppl) - want) / want
    return Measure(err <= 1e-5, f"exp(sum NLL / sum tokens) = {want:.5f}",
                   f"{float(ppl):.5f}", [want], [float(ppl)])


def eval_kinds(spec: ProbeSpec) -> dict[str, Microbatch]:
    """Held-out microbatches of each kind a loop meets: padded rows (one ending in EOS),
    packed rows (two documents in a row) and chat rows (only the answers are targets)."""
    g = gen(100)
    return {
        "padded": data.single([data.text(g, 9, spec, eos=True), data.text(g, 4, spec),
                               data.text(g, 6, spec)], spec, length=11),
        "packed": data.microbatch([[data.text(g, 5, spec), data.text(g, 6, spec, eos=True)],
                                   [data.text(g, 7, spec)]], spec),
        "chat": chat_rows(101),
    }


def eval_rows(step: TrainingStep) -> Measure:
    """``evaluate`` on padded, packed and chat rows, each alone, of a model trained with
    label smoothing 0.2: the held-out loss is the gold (unsmoothed) NLL over the
    supervised targets only, divided by their count (E1, L5), within 1e-5."""
    spec = replace(SPEC, label_smoothing=0.2,
                   smoothing_convention=getattr(step, "smoothing_convention", "harvard"))
    step.build(spec)
    want, got, wrong = [], [], []
    for kind, mb in eval_kinds(spec).items():
        total, count = ref.eval_reference(step, [mb], spec)
        loss, _ = finite_eval(step, [mb])
        want.append(total / count)
        got.append(loss)
        if abs(loss - total / count) > 1e-5 * (total / count):
            wrong.append(kind + eval_diagnosis(step, mb, spec, loss, total, count))
    observed = ", ".join(f"{k} {v:.6f}" for k, v in zip(eval_kinds(spec), got, strict=True))
    if wrong:
        observed += "; wrong on " + ", ".join(wrong)
    return Measure(not wrong, "gold NLL per supervised target: " + ", ".join(
        f"{k} {v:.6f}" for k, v in zip(eval_kinds(spec), want, strict=True)), observed,
        want, got)


def eval_diagnosis(step: TrainingStep, mb: Microbatch, spec: ProbeSpec, loss: float,
                   total: float, count: int) -> str:
    """`` (matches <a known wrong evaluation>)`` or ``""``."""
    with ref.eval_mode(step.module), torch.no_grad():
        smoothed = float(ref.nll_sum(step, mb, spec)[0]) / count
        every = Microbatch(tokens=mb.tokens, documents=mb.documents, positions=mb.positions,
                           owned=mb.documents > 0)
        s_all, n_all = ref.nll_sum(step, every, spec, smoothed=False)
    candidates = {
        "label smoothing in evaluation": smoothed,
        "every token scored, prompts too": float(s_all) / max(n_all, 1),
        "padding counted in the denominator": total / (mb.tokens.shape[0]
                                                       * (mb.tokens.shape[1] - 1)),
    }
    for label, value in candidates.items():
        if abs(loss - value) <= 1e-5 * abs(value) and abs(value - total / count) > 1e-6:
            return f" (matches {label})"
    return ""


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[n], after[n]) for n in before)


def bitwise(straight: dict[str, torch.Tensor], resumed: dict[str, torch.Tensor]) -> Measure:
    """PASS when the resumed parameters equal the uninterrupted ones bitwise (S2, S5)."""
    off = [n for n in straight if not torch.equal(straight[n], resumed[n])]
    worst = max((float((straight[n] - resumed[n]).abs().max()) for n in off), default=0.0)
    return Measure(not off, "resumed == uninterrupted, bitwise",
                   "bitwise equal" if not off else
                   f"{len(off)} parameters differ (max {worst:.2e})")


def reload(step: TrainingStep, spec: ProbeSpec, tmp: str,
           after_build: Callable[[], None] = lambda: None) -> None:
    """Save, then continue as another process would: a fresh build under another RNG
    state (``after_build`` hands it its data), then ``load`` (S2)."""
    step.save(Path(tmp) / "state")
    torch.manual_seed(987654)  # another process: the RNG is not the one saved
    step.build(spec)
    after_build()
    torch.manual_seed(4242)
    step.load(Path(tmp) / "state")


RESUME = replace(ADAMW, warmup=3, dropout=0.5, eps=1e-8)


def resume_exact(step: TrainingStep) -> Measure:
    mbs = [plain_rows(seed=30 + i) for i in range(4)]
    step.build(RESUME)
    start = ref.snapshot(step.module)
    train(step, mbs[:2])
    check_logs(train(step, mbs[2:]))
    straight = ref.snapshot(step.module)
    with tempfile.TemporaryDirectory() as tmp:
        step.build(RESUME)
        train(step, mbs[:2])
        reload(step, RESUME, tmp)
        loaded = ref.snapshot(step.module)
        train(step, mbs[2:])
    if not moved(start, straight):
        raise TargetFault("train() changed no parameter: the loop never stepped")
    resumed = ref.snapshot(step.module)
    m = bitwise(straight, resumed)
    if not m.passed and not moved(loaded, resumed):
        m.observed += ("; the module never moved after load: the optimizer is not bound to "
                       "the loaded module's parameters")
    return m


# -- resume without the loss scaler (S2, U2) ----------------------------------------------

def repeated_rows(token: int, spec: ProbeSpec = SPEC, length: int = 12) -> Microbatch:
    """Two rows ``BOS t t ... t`` (``length`` tokens): every target is ``t``, so the
    gradient of ``t``'s embedding and head rows is a mean of aligned terms, the largest
    gradient a token mean gives (O(1) at initialization): the window a fp32 scale can
    overflow."""
    tokens = torch.full((2, length), token, dtype=torch.int64)
    tokens[:, 0] = spec.bos_id
    owned = torch.ones_like(tokens, dtype=torch.bool)
    owned[:, 0] = False
    return Microbatch(tokens=tokens, documents=torch.ones_like(tokens),
                      positions=torch.arange(length).repeat(2, 1), owned=owned)


def overflow_window(step: TrainingStep) -> tuple[Microbatch, int | None]:
    """The candidate window (one per content token) with the largest reference gradient
    at initialization, and the reference's overflow exponent for it (``None``: no fp32
    power-of-two scale overflows its declared scaled gradient)."""
    step.build(SPEC)
    best, largest = None, -1.0
    for token in range(3, SPEC.vocab_size):
        window = repeated_rows(token)
        grads, _ = ref.window_gradient(step, [window], SPEC)
        peak = max(float(g.abs().max()) for g in grads.values())
        if peak > largest:
            best, largest = window, peak
    return best, ref.overflow_exponent(step, [best], SPEC)


def scaled(exponent: int) -> ProbeSpec:
    """The probe's loop under a ``GradScaler`` of initial scale ``2**exponent`` (growth
    disabled, back-off 0.5; ``ProbeSpec.loss_scale``)."""
    return replace(SPEC, loss_scale=2.0 ** exponent)


def commits(step: TrainingStep, window: Microbatch, exponent: int) -> bool:
    """Whether the target, freshly built at scale ``2**exponent``, commits ``window``."""
    step.build(scaled(exponent))
    before = ref.snapshot(step.module)
    train(step, [window])
    return moved(before, ref.snapshot(step.module))


def target_exponent(step: TrainingStep, window: Microbatch, guess: int | None) -> int:
    """The smallest ``k`` at which the target skips ``window`` from a fresh build at
    scale ``2**k``, observed, with the bracket verified (commits at ``2**(k-1)``).

    The target's own threshold, not the reference's: a loop that scales the loss *sum*
    and divides after unscaling, or that autocasts its forward to fp16 (exactstep's
    engine on CPU), overflows at a smaller scale than the declared fp32 token mean; the
    reference's exponent ``guess`` is tried first."""
    if guess is not None and guess > 0 and not commits(step, window, guess) \
            and commits(step, window, guess - 1):
        return guess
    if not commits(step, window, 0):
        raise TargetFault("train() changed no parameter at loss scale 2^0: the loop never "
                          "stepped")
    top = ref.MAX_SCALE_EXPONENT
    if commits(step, window, top):
        raise NotApplicable(f"the target commits the probe's window even at loss scale "
                            f"2^{top} (no fp32 scale overflows its gradient), so a lost "
                            "scale cannot be observed")
    finite, overflows = 0, top
    while overflows - finite > 1:
        mid = (finite + overflows) // 2
        if commits(step, window, mid):
            finite = mid
        else:
            overflows = mid
    return overflows


def resume_scaler(step: TrainingStep) -> Measure:
    """At the target's overflow threshold ``2**k``: window 1 overflows and is skipped,
    the scale backs off to ``2**(k-1)``; save, reload; the same window then commits.
    A loop that does not save the scaler restarts at ``2**k`` and skips it again."""
    window, guess = overflow_window(step)
    k = target_exponent(step, window, guess)
    spec = scaled(k)
    step.build(spec)
    start = ref.snapshot(step.module)
    train(step, [window])
    if moved(start, ref.snapshot(step.module)):
        raise TargetFault(f"the loop committed at 2^{k} a window it skipped from the same "
                          "build before (not deterministic)")
    check_logs(train(step, [window]))
    straight = ref.snapshot(step.module)
    expected = f"skip at 2^{k}, back off, commit at 2^{k - 1} after the reload"
    if guess is not None:
        expected += f" (reference overflow at 2^{guess})"
    if not moved(start, straight):
        return Measure(False, expected, f"the uninterrupted run skipped the window again "
                       f"after the skip at 2^{k}: no back-off, or the overflowed gradient "
                       "was kept")
    with tempfile.TemporaryDirectory() as tmp:
        step.build(spec)
        train(step, [window])
        reload(step, spec, tmp)
        train(step, [window])
    resumed = ref.snapshot(step.module)
    if not moved(start, resumed):
        return Measure(False, expected, f"the resumed window was skipped: the scale "
                       f"restarted at 2^{k} instead of 2^{k - 1} (the checkpoint lacks the "
                       "scaler's state)")
    m = bitwise(straight, resumed)
    m.expected = expected
    return m


# -- resume without the data cursor (S2) --------------------------------------------------

def require_cursor(step: TrainingStep) -> None:
    if not (callable(getattr(step, "set_data", None))
            and callable(getattr(step, "train_steps", None))):
        raise NotApplicable("the target takes its microbatches from the caller; it does not "
                            "iterate a dataset of its own (TrainingStep.set_data / "
                            "train_steps)")


def train_steps(step: TrainingStep, n: int) -> list[float | None]:
    logs = step.train_steps(n)
    return list(logs) if logs is not None else []


def resume_data(step: TrainingStep) -> Measure:
    """Four windows from the loop's own iterator straight, against two, save, a fresh
    build with the same dataset, load, two more: bitwise equal parameters (S2)."""
    require_cursor(step)
    dataset = [[plain_rows(seed=60 + i)] for i in range(6)]
    step.build(SPEC)
    step.set_data(dataset)
    start = ref.snapshot(step.module)
    check_logs(train_steps(step, 4))
    straight = ref.snapshot(step.module)
    if not moved(start, straight):
        raise TargetFault("train_steps() changed no parameter: the loop never stepped")
    with tempfile.TemporaryDirectory() as tmp:
        step.build(SPEC)
        step.set_data(dataset)
        train_steps(step, 2)
        reload(step, SPEC, tmp, lambda: step.set_data(dataset))
        train_steps(step, 2)
    return bitwise(straight, ref.snapshot(step.module))


PROBES: tuple[Probe, ...] = (
    Probe("shift", "R1", "targets must be the next token: inputs tokens[:, :-1], labels "
          "tokens[:, 1:] (no shift, reversed, double shift or labels fed as input)", shift),
    Probe("eos_target", "R1", "the EOS token must stay a target: do not mask it out of the "
          "labels", eos_target),
    Probe("padding", "L3", "mask padded targets out of the loss and divide by the count of "
          "supervised targets, not B*T", padding),
    Probe("accumulation", "U1", "accumulate sum(loss)/N_window over the window's "
          "microbatches (one token mean), not a mean of microbatch means; step on "
          "(i + 1) % accum == 0", accumulation),
    Probe("remainder", "U1", "close the last, shorter window too, normalized by its own "
          "tokens; zero the gradients after each step", remainder),
    Probe("logged_loss", "U1", "log each committed window's token mean (the loss the "
          "update used: sum of the window's target losses / its target count), unscaled; "
          "log nothing for a skipped window", logged_loss),
    Probe("schedule_clock", "U5", "the update taken after k committed updates uses lr(k): "
          "advance the schedule once per optimizer step (not per microbatch) and take the "
          "first update at lr(0) = lr / warmup (a warmup from 0 wastes it)", schedule_clock),
    Probe("schedule_after_warmup", "U5", "cap the warm-up: lr(k) = lr * min(1, (k + 1) / "
          "warmup); past warm-up the rate stays at lr (the schedule's own shape after)",
          schedule_after_warmup),
    Probe("ddp_token_mean", "D5", "under DDP all-reduce the window's target count and "
          "scale each micro-loss by world_size / global count (DDP averages gradients); "
          "a mean of rank-local token means weighs ranks, not tokens", ddp_token_mean),
    Probe("packed_documents", "R3", "packed documents: reset positions per document, mask "
          "attention to the document and drop the EOS -> next-BOS target", packed_documents),
    Probe("causal_attention", "R2", "the model must not see later tokens: a causal "
          "(lower-triangular) mask, applied before the softmax", causal_attention),
    Probe("cross_document_attention", "R2", "the model must mask attention to other "
          "documents of the row (segment ids), not one causal mask", cross_document_attention),
    Probe("chat_ownership", "R5", "row i is supervised when token i + 1 is owned: use "
          "owned[:, 1:], not owned[:, :-1]", chat_ownership),
    Probe("prompt_visible", "R2", "the loss mask is not an attention mask: answers must "
          "attend to the prompt", prompt_visible),
    Probe("label_smoothing", "L2", "spread eps over the declared support (harvard: V-2 "
          "classes, never PAD, never gold)", label_smoothing),
    Probe("clip_global_norm", "U3", "clip once by the global norm over unique parameters "
          "(clip_grad_norm_(model.parameters())), not per tensor, not tied twice",
          clip_global_norm),
    Probe("scaled_clip", "U2", "unscale once (scaler.unscale_) before clipping, at the "
          "window's close only (not after a micro-step)", scaled_clip),
    Probe("adamw_decoupled", "U6", "use AdamW's weight_decay (decoupled), do not add an L2 "
          "term to the loss", adamw_decoupled),
    Probe("decay_groups", "U6", "put norms, biases and embeddings in a weight_decay=0 "
          "group", decay_groups),
    Probe("adamw_steps", "U6", "step AdamW with the declared betas and one optimizer for "
          "the run (its moments and step count persist across windows), bias-correct both "
          "moments, amsgrad off: torch.optim.AdamW(groups, lr, betas, eps)", adamw_steps),
    Probe("zero_target_window", "L4", "a window with no supervised target must not step, "
          "advance or log a loss (skip when the target count is 0)", zero_target_window),
    Probe("nonfinite_skip", "U4", "on a non-finite loss or gradient skip the window: no "
          "optimizer step, no scheduler step", nonfinite_skip),
    Probe("nonfinite_gradient", "U4", "decide the skip from the gradient too (the "
          "unscaled gradient norm is finite), not from the loss alone: on a skip do not "
          "step the scheduler and log nothing", nonfinite_gradient),
    Probe("train_mode", "E1", "call model.train() before training steps (dropout on)",
          train_mode),
    Probe("eval_mode", "E1", "evaluate under model.eval() and torch.no_grad()", eval_mode),
    Probe("eval_isolation", "E1", "evaluation must restore the mode and must not touch "
          "parameters or the global RNG (fork or save/restore it)", eval_isolation),
    Probe("perplexity", "L5", "perplexity = exp(total NLL / total tokens), not a mean of "
          "per-batch values", perplexity),
    Probe("eval_rows", "L5", "evaluate the gold NLL (no label smoothing) over the "
          "supervised targets only (ownership, no padding, no cross-document target), "
          "divided by their count", eval_rows),
    Probe("resume", "S2", "save and restore model, optimizer, scheduler, scaler and RNG "
          "state", resume_exact),
    Probe("resume_scaler", "S2", "save scaler.state_dict() with the checkpoint and load it "
          "on resume: the loss scale after a back-off is state (U2)", resume_scaler),
    Probe("resume_data", "S2", "save the data position (epoch, index into the epoch's "
          "order, and the shuffle's seed) and continue from it on resume; do not restart "
          "or reshuffle the data", resume_data),
)


def probe_names() -> list[str]:
    return [p.name for p in PROBES]
