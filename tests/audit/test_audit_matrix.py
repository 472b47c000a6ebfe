"""A2: the audit passes the correct loops and fails each wrong loop on exactly the
probes its bug breaks.

The expected failure set of every catalogued loop is written here by hand from its
bug (``audit_wrong_loops``); a probe that is not listed must pass (or be N/A). The
correct loops are the negative controls of every probe, the wrong loops its positive
controls: every probe is failed by some wrong loop and passed by most.
"""

from __future__ import annotations

import audit_wrong_loops as wrong
import pytest

from exactstep.audit.engine import ExactstepStep
from exactstep.audit.examples.annotated import AnnotatedLoop
from exactstep.audit.examples.nanogpt import NanoGPTLoop
from exactstep.audit.probes import ERROR, NA, PASS, PROBES
from exactstep.audit.run import run_audit

# Probes whose expectation is the declared update itself: any loss bug moves them.
UPDATE = {"shift", "eos_target", "padding", "accumulation", "remainder", "packed_documents",
          "chat_ownership", "label_smoothing", "clip_global_norm", "scaled_clip",
          "adamw_decoupled", "nonfinite_skip", "ddp_token_mean"}
# The Annotated-Transformer loop does not declare data-parallel training: N/A there.
DATA_PARALLEL = {"ddp_token_mean"}
# Probes that compare evaluate()'s numbers with the declared loss.
EVAL_VALUES = {"eval_mode", "perplexity"}
# A loop that never changes a parameter: every probe that needs an update.
NEVER_STEPS = UPDATE | {"prompt_visible", "decay_groups", "resume", "train_mode",
                        "resume_scaler", "resume_data"}

EXPECTED: dict[str, set[str]] = {
    # the shift (R1)
    "NoShift": UPDATE | EVAL_VALUES,
    "ReversedShift": UPDATE | EVAL_VALUES,
    "DoubleShift": UPDATE,  # its evaluate() does not use the doubly shifted loss
    "LabelsAsDecoderInput": UPDATE - DATA_PARALLEL | EVAL_VALUES | {"prompt_visible"},  # prompt
    # fed as PAD
    "DropEos": {"eos_target"},
    "ProbabilitiesIntoCrossEntropy": UPDATE,  # its evaluate() scores the logits themselves
    # padding and the denominator (L3)
    "PadInLoss": {"padding", "label_smoothing"},  # the smoothing probe has padded rows
    "NormBT": {"padding", "packed_documents", "chat_ownership", "label_smoothing",
               "zero_target_window"},  # B*T > 0 for a window without targets: it steps
    "CountsTgt": {"padding", "packed_documents", "chat_ownership", "label_smoothing",
                  "zero_target_window"},
    # the window (U1)
    "MeanOfMicrobatchMeans": {"accumulation", "ddp_token_mean"},  # a rank is a microbatch
    "RankLocalTokenMean": {"ddp_token_mean"},
    "FirstMicrobatchSteps": {"accumulation", "remainder"},
    "DropRemainder": {"remainder"},
    "NoRemainderClose": {"remainder"},
    # the NaN (and the overflowed) gradient stays; resumed windows start from zero grads
    "NoZeroGrad": {"remainder", "resume", "nonfinite_skip", "resume_scaler", "resume_data"},
    "ZeroGradBeforeStep": NEVER_STEPS,
    "ZeroGradEveryMicrobatch": {"accumulation", "remainder"},
    # packed documents (R2, R3)
    "OneCausalMaskOverDocuments": {"cross_document_attention", "packed_documents"},
    "PositionsNotReset": {"packed_documents"},
    "PositionsResetWithoutSegments": {"packed_documents"},
    "CrossDocumentTarget": {"packed_documents"},
    "MaskIgnoresDocuments": {"cross_document_attention", "packed_documents"},
    "PaddingOnlyMask": {"causal_attention", "cross_document_attention", "packed_documents"},
    # hidden keys left in the softmax's denominator: the future and other documents move
    # every row's logits, slightly (about 1e-6 to 1e-5) but not zero
    "MaskAfterSoftmax": {"causal_attention", "cross_document_attention", "packed_documents"},
    # chat ownership (R2, R5)
    "UnshiftedOwnership": UPDATE | EVAL_VALUES,  # text rows lose their first target too
    "LossMaskAsAttentionMask": {"chat_ownership", "prompt_visible"},
    # label smoothing (L2)
    "PadGetsSmoothingMass": {"label_smoothing"},
    "SmoothingDenominatorVMinus1": {"label_smoothing"},
    "PadRowsNotZeroed": {"label_smoothing"},
    # clipping and the loss scale (U2, U3, U6)
    "PerTensorClip": {"clip_global_norm", "scaled_clip"},
    "TiedCountedTwice": {"clip_global_norm", "scaled_clip"},
    "ClipBeforeUnscale": {"scaled_clip"},
    "DoubleUnscale": {"scaled_clip", "resume_scaler"},  # GradScaler raises: an ERROR
    # the optimizer (U6); decay_groups is N/A when the step is not AdamW's
    "L2InLossWithAdam": {"adamw_decoupled"},
    "DecayOnEverything": {"decay_groups"},
    "DecayOnNothing": {"decay_groups"},
    # skipped and empty windows (L4, U4, U5)
    "SchedulerAdvancesOnSkip": {"nonfinite_skip"},
    "NoFiniteCheck": {"nonfinite_skip"},
    "LambdaLRStepsOnSkip": {"nonfinite_skip"},
    "ZeroTargetWindowSteps": {"zero_target_window"},
    # modes and evaluation (E1, L5)
    "TrainsInEvalMode": {"train_mode"},
    "EvaluatesInTrainMode": {"eval_mode", "eval_isolation"},  # dropout draws from the RNG
    "EvalLeavesEvalMode": {"eval_isolation"},
    "EvalReseeds": {"eval_isolation"},
    "EvalThroughTrainStep": {"eval_mode", "eval_isolation", "perplexity"},  # it steps
    "PerplexityPerBatch": {"perplexity"},
    "PerplexityOfMeanLoss": {"perplexity"},
    # resume (S2)
    "ResumeWithoutOptimizer": {"resume"},
    "ResumeWithoutRng": {"resume"},
    "ResumeWithoutStepCounter": {"resume"},
    "ResumeWithoutScheduler": {"resume"},
    "ResumeWithoutScaler": {"resume_scaler"},  # the probe's back-off is lost
    "ResumeWithoutDataCursor": {"resume_data"},
    "ResumeReshufflesData": {"resume_data"},
}
# Where the target's own exception (not a wrong value) is what the probe reports.
ERRORS = {"ZeroGradBeforeStep": NEVER_STEPS,
          "DoubleUnscale": {"scaled_clip", "resume_scaler"},
          "NoZeroGrad": {"nonfinite_skip"}}
# LambdaLRStepsOnSkip steps its scheduler without an optimizer step: PyTorch warns, rightly
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
CORRECT = {"nanogpt": NanoGPTLoop, "annotated": AnnotatedLoop}
NAMES = [p.name for p in PROBES]


def failing(report) -> set[str]:
    return {r.probe for r in report.results if r.status not in (PASS, NA)}


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_a_correct_example_loop_passes_every_probe(name: str) -> None:
    """The Annotated-Transformer loop declares no data-parallel training: that probe is
    N/A with its reason, every other passes."""
    report = run_audit(CORRECT[name]())
    not_passed = {r.probe: r.observed for r in report.results if r.status != PASS}
    if name == "annotated":
        assert set(not_passed) == DATA_PARALLEL, not_passed
        assert "does not declare data-parallel" in not_passed["ddp_token_mean"]
        assert all(r.status == NA for r in report.results if r.probe in DATA_PARALLEL)
    else:
        assert not_passed == {}
    assert report.ok


def test_exactstep_passes_every_applicable_probe() -> None:
    """Its decoder has no dropout: the two dropout probes are N/A, nothing else."""
    report = run_audit(ExactstepStep(), target="exactstep")
    statuses = {r.probe: r.status for r in report.results}
    assert {p for p, s in statuses.items() if s == NA} == {"train_mode", "eval_mode"}
    assert {p for p, s in statuses.items() if s not in (PASS, NA)} == set()
    assert report.ok


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_wrong_loop_fails_exactly_its_probes(name: str) -> None:
    report = run_audit(getattr(wrong, name)())
    observed = {r.probe: f"{r.status}: {r.observed}" for r in report.results
                if r.status not in (PASS, NA)}
    assert set(observed) == EXPECTED[name], observed
    errors = {r.probe for r in report.results if r.status == ERROR}
    assert errors == ERRORS.get(name, set()), observed
    assert not report.ok


def test_the_catalogue_covers_every_probe_and_no_probe_fails_everything() -> None:
    """Each probe is failed by some wrong loop (it can fail) and passed by most (it does
    not fail everything: at most a third of them); the catalogue holds at least 35 loops, each one catalogued."""
    catalogued = {name for name, value in vars(wrong).items() if isinstance(value, type)
                  and value.__module__ == wrong.__name__
                  and issubclass(value, NanoGPTLoop | AnnotatedLoop)}
    broken = {"RaisesInTrain", "NeverSteps", "NaNLogits"}  # tested for ERRORs below
    assert catalogued - broken == set(EXPECTED)
    assert len(EXPECTED) >= 35
    for probe in NAMES:
        failed_by = [n for n, probes in EXPECTED.items() if probe in probes]
        assert failed_by, f"no wrong loop fails {probe}"
        assert len(failed_by) <= len(EXPECTED) // 3, (probe, failed_by)
    assert set().union(*EXPECTED.values()) == set(NAMES)


@pytest.mark.parametrize(("name", "message"), [
    ("RaisesInTrain", "RuntimeError: CUDA error"),
    ("NeverSteps", "never stepped"),
    ("NaNLogits", "non-finite"),
])
def test_a_target_that_breaks_gets_a_per_probe_error_not_a_crash(name: str,
                                                                   message: str) -> None:
    report = run_audit(getattr(wrong, name)())
    assert len(report.results) == len(PROBES)
    errors = [r for r in report.results if r.status == ERROR]
    assert errors and all(message in r.observed for r in errors
                          if "logged" not in r.observed), [r.observed for r in errors]
    assert not report.ok


@pytest.mark.parametrize(("name", "label"), [
    ("NoShift", "no shift"), ("ReversedShift", "reversed shift"),
    ("UnshiftedOwnership", "unshifted ownership"),
])
def test_a_failing_update_names_the_wrong_alignment_it_matches(name: str, label: str) -> None:
    (result,) = run_audit(getattr(wrong, name)(), probes=["shift"]).results
    assert result.status == "FAIL" and f"matches {label} (" in result.observed


def test_an_unrelated_failure_names_no_alignment() -> None:
    """Negative control: a normalization bug is not reported as a shift bug."""
    (result,) = run_audit(wrong.NormBT(), probes=["padding"]).results
    assert result.status == "FAIL" and "matches" not in result.observed
