"""The two resume probes beyond ``resume`` (S2): the loss scaler's state
(``resume_scaler``) and the loop's own data position (``resume_data``).

The overflow threshold the probe calibrates is checked against an independent search
(``F.cross_entropy`` through the model, ``torch.isfinite`` at every scale), and against
what a correct loop does when observed; the N/A and ERROR paths are per probe, never
an audit crash.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exactstep.audit import probes
from exactstep.audit import reference as ref
from exactstep.audit.engine import ExactstepStep
from exactstep.audit.examples.annotated import AnnotatedLoop
from exactstep.audit.examples.nanogpt import IGNORE, NanoGPTLoop
from exactstep.audit.probes import ERROR, FAIL, NA, PASS
from exactstep.audit.run import run_audit

RESUME_PROBES = ["resume_scaler", "resume_data"]


def finite_at(loop: NanoGPTLoop, mb, exponent: int) -> bool:
    """The scaled backward written out with PyTorch's criterion: the token-mean loss of
    the shifted rows times ``2**exponent``, every parameter gradient finite."""
    x, pos, docs, y = loop.get_batch(mb)
    loop.module.eval()
    loss = F.cross_entropy(loop.module(x, pos, docs).flatten(0, 1), y.flatten(),
                           ignore_index=IGNORE) * 2.0 ** exponent
    grads = torch.autograd.grad(loss, list(loop.module.parameters()))
    return all(bool(torch.isfinite(g).all()) for g in grads)


def linear_scan(loop: NanoGPTLoop, mb) -> int | None:
    """The first ``k`` in 0..127 that overflows, found by trying every one."""
    return next((k for k in range(128) if not finite_at(loop, mb, k)), None)


def test_the_calibrated_threshold_is_the_first_overflowing_scale() -> None:
    loop = NanoGPTLoop()
    window, k = probes.overflow_window(loop)
    loop.build(probes.SPEC)
    assert k is not None and k == linear_scan(loop, window)
    assert finite_at(loop, window, k - 1) and not finite_at(loop, window, k)
    # negative control: a window of random tokens has no fp32 overflow at all
    plain = probes.plain_rows(seed=50)
    assert ref.overflow_exponent(loop, [plain], probes.SPEC) is None
    assert linear_scan(loop, plain) is None


def test_a_correct_loop_skips_exactly_where_the_reference_overflows() -> None:
    """nanoGPT scales the token mean in fp32: its observed threshold is the
    reference's. The Annotated loop scales the loss *sum* and divides after unscaling:
    its gradient is ``N`` (22 targets) times larger, so it overflows 4 to 5 powers of
    two earlier; the probe follows the target, not the reference."""
    nano = NanoGPTLoop()
    window, guess = probes.overflow_window(nano)
    assert probes.target_exponent(nano, window, None) == guess  # bisection, no guess
    annotated = AnnotatedLoop()
    window, guess = probes.overflow_window(annotated)
    k = probes.target_exponent(annotated, window, guess)
    assert guess - 5 <= k <= guess - 4
    assert probes.commits(annotated, window, k - 1) and not probes.commits(annotated, window, k)


class NoCursor(NanoGPTLoop):
    set_data = None  # takes its microbatches from the caller only
    train_steps = None


class UnscaledLoop(NanoGPTLoop):
    def build(self, spec) -> None:  # noqa: ANN001
        super().build(spec)
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)  # ignores loss_scale


class CursorRaises(NanoGPTLoop):
    def train_steps(self, n: int) -> list[float | None]:
        raise RuntimeError("dataloader worker exited unexpectedly")


class BrokenScaler(NanoGPTLoop):
    def step_optimizer(self) -> None:
        raise RuntimeError("scaler state corrupted")


def statuses(step: object) -> dict[str, tuple[str, str]]:
    report = run_audit(step, probes=RESUME_PROBES)
    return {r.probe: (r.status, r.observed) for r in report.results}


def test_a_loop_without_its_own_data_is_not_applicable() -> None:
    status, observed = statuses(NoCursor())["resume_data"]
    assert status == NA and "set_data / train_steps" in observed


def test_a_loop_that_never_overflows_is_not_applicable() -> None:
    status, observed = statuses(UnscaledLoop())["resume_scaler"]
    assert status == NA and "even at loss scale 2^127" in observed


def test_a_raising_target_is_an_error_per_probe_not_a_crash() -> None:
    assert statuses(CursorRaises())["resume_data"] == (
        ERROR, "RuntimeError: dataloader worker exited unexpectedly")
    assert statuses(CursorRaises())["resume_scaler"][0] == PASS
    status, observed = statuses(BrokenScaler())["resume_scaler"]
    assert status == ERROR and "scaler state corrupted" in observed


def test_forgetting_the_scaler_says_what_to_save() -> None:
    import audit_wrong_loops as wrong

    report = run_audit(wrong.ResumeWithoutScaler(), probes=["resume_scaler"])
    (result,) = report.results
    assert result.status == FAIL
    assert "the resumed window was skipped: the scale restarted at 2^127" in result.observed
    assert "scaler.state_dict()" in result.fix


@pytest.mark.parametrize("name", ["ResumeWithoutDataCursor", "ResumeReshufflesData"])
def test_losing_the_data_position_fails_with_the_fix(name: str) -> None:
    import audit_wrong_loops as wrong

    (result,) = run_audit(getattr(wrong, name)(), probes=["resume_data"]).results
    assert result.status == FAIL and "parameters differ" in result.observed
    assert "data position" in result.fix


@pytest.mark.parametrize(("ignore_data_skip", "status"), [(False, PASS), (True, FAIL)])
def test_the_trainer_resumes_its_data_only_by_skipping_batches(ignore_data_skip: bool,
                                                                status: str) -> None:
    """``hf-trainer``'s own data order: the default skips the batches trained before the
    checkpoint (PASS); ``ignore_data_skip=True`` restarts the epoch (AUDIT.md)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from exactstep.audit.hf_trainer import HFTrainerStep

    step = HFTrainerStep(ignore_data_skip=ignore_data_skip)
    (result,) = run_audit(step, probes=["resume_data"]).results
    assert result.status == status, result.observed


class EngineForgetsScaler(ExactstepStep):
    def load(self, path) -> None:  # noqa: ANN001
        super().load(path)
        self.engine.precision.scaler = torch.amp.GradScaler(  # BUG: back to init_scale
            "cpu", init_scale=self.spec.loss_scale)


def test_the_engine_keeps_its_fp16_scale_and_a_variant_that_drops_it_fails() -> None:
    """The engine autocasts to fp16 on the CPU: it overflows far below the fp32
    reference's scale, and the probe follows it there (negative control: the same
    engine with a fresh scaler after ``load``)."""
    (ok,) = run_audit(ExactstepStep(), probes=["resume_scaler"]).results
    assert ok.status == PASS, ok.observed
    (bad,) = run_audit(EngineForgetsScaler(), probes=["resume_scaler"]).results
    assert bad.status == FAIL and "the resumed window was skipped" in bad.observed
