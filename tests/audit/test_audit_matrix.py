"""A2: the audit passes the correct loops and fails each wrong loop on exactly the
probes its bug breaks.

The expected failure set of every catalogued loop is written here by hand from its
bug (``audit_wrong_loops``); a probe that is not listed must pass (or be N/A). The
correct loops are the negative controls of every probe, the wrong loops its positive
controls: every probe is failed by some wrong loop and passed by most.
"""

from __future__ import annotations

import audit_correct_loops as correct
import audit_wrong_loops as wrong
import pytest
import torch

from exactstep.audit.engine import ExactstepStep
from exactstep.audit.examples.annotated import AnnotatedLoop
from exactstep.audit.examples.nanogpt import NanoGPTLoop
from exactstep.audit.probes import ERROR, NA, PASS, PROBES
from exactstep.audit.run import run_audit

# Probes whose expectation is the declared update itself: any loss bug moves them.
UPDATE = {"shift", "eos_target", "padding", "accumulation", "remainder", "schedule_clock",
          "schedule_after_warmup", "packed_documents", "chat_ownership", "label_smoothing",
          "clip_global_norm", "scaled_clip", "adamw_decoupled", "adamw_steps",
          "ddp_token_mean"}
# A wrong loss: the update and the loss the loop logs for it (the skip probes compare the
# update after a skip with the loop's own first update, so they do not see it).
LOSS = UPDATE | {"logged_loss"}
# The Annotated-Transformer loop does not declare data-parallel training: N/A there.
DATA_PARALLEL = {"ddp_token_mean"}
# Probes that compare evaluate()'s numbers with the declared loss.
EVAL_VALUES = {"eval_mode", "perplexity", "eval_rows"}
# A loop that never changes a parameter: every probe that needs an update.
NEVER_STEPS = UPDATE | {"prompt_visible", "decay_groups", "resume", "train_mode",
                        "resume_scaler", "resume_data", "nonfinite_skip",
                        "nonfinite_gradient", "zero_target_window"}
# Every probe that calls train() or evaluate() of an Annotated-Transformer loop (the
# attention probes read only logits(); the data-parallel probe is N/A there).
TRAINS_OR_EVALUATES = ({p.name for p in PROBES} - DATA_PARALLEL
                       - {"causal_attention", "cross_document_attention"})

EXPECTED: dict[str, set[str]] = {
    # the shift (R1)
    "NoShift": LOSS | EVAL_VALUES,
    "ReversedShift": LOSS | EVAL_VALUES,
    "DoubleShift": LOSS,  # its evaluate() does not use the doubly shifted loss
    "LabelsAsDecoderInput": LOSS - DATA_PARALLEL | EVAL_VALUES | {"prompt_visible"},  # prompt
    # fed as PAD
    "DropEos": {"eos_target", "eval_rows"},  # evaluation drops the EOS targets too
    "ProbabilitiesIntoCrossEntropy": LOSS,  # its evaluate() scores the logits themselves
    # padding and the denominator (L3)
    # the smoothing probe has padded rows; evaluation uses the same labels
    "PadInLoss": {"padding", "label_smoothing", "eval_rows"},
    "NormBT": {"padding", "packed_documents", "chat_ownership", "label_smoothing",
               "zero_target_window", "eval_rows"},  # B*T > 0 without targets: it steps
    "CountsTgt": {"padding", "packed_documents", "chat_ownership", "label_smoothing",
                  "zero_target_window", "eval_rows"},
    # the window (U1)
    # a rank is a microbatch; the logged value is the mean the update used
    "MeanOfMicrobatchMeans": {"accumulation", "ddp_token_mean", "logged_loss"},
    "RankLocalTokenMean": {"ddp_token_mean"},
    "FirstMicrobatchSteps": {"accumulation", "remainder", "schedule_clock", "scaled_clip",
                             "logged_loss"},
    # (the last three probes' windows have two microbatches too)
    "DropRemainder": {"remainder"},
    "NoRemainderClose": {"remainder"},
    # the NaN (and the overflowed) gradient stays; resumed windows start from zero grads
    "NoZeroGrad": {"remainder", "schedule_clock", "schedule_after_warmup", "adamw_steps",
                   "resume", "nonfinite_skip", "nonfinite_gradient", "resume_scaler",
                   "resume_data"},
    "ZeroGradBeforeStep": NEVER_STEPS,
    "ZeroGradEveryMicrobatch": {"accumulation", "remainder", "schedule_clock", "scaled_clip"},
    # packed documents (R2, R3)
    "OneCausalMaskOverDocuments": {"cross_document_attention", "packed_documents"},
    # evaluation on packed rows shares the model and the targets
    "PositionsNotReset": {"packed_documents", "eval_rows"},
    "PositionsResetWithoutSegments": {"packed_documents", "eval_rows"},
    "CrossDocumentTarget": {"packed_documents", "eval_rows"},
    "MaskIgnoresDocuments": {"cross_document_attention", "packed_documents"},
    "PaddingOnlyMask": {"causal_attention", "cross_document_attention", "packed_documents"},
    # hidden keys left in the softmax's denominator: the future and other documents move
    # every row's logits, slightly (about 1e-6 to 1e-5) but not zero
    "MaskAfterSoftmax": {"causal_attention", "cross_document_attention", "packed_documents"},
    # chat ownership (R2, R5)
    "UnshiftedOwnership": LOSS | EVAL_VALUES,  # text rows lose their first target too
    "LossMaskAsAttentionMask": {"chat_ownership", "prompt_visible", "eval_rows"},
    # label smoothing (L2)
    "PadGetsSmoothingMass": {"label_smoothing"},
    "SmoothingDenominatorVMinus1": {"label_smoothing"},
    "PadRowsNotZeroed": {"label_smoothing"},
    # clipping and the loss scale (U2, U3, U6)
    "PerTensorClip": {"clip_global_norm", "scaled_clip"},
    "TiedCountedTwice": {"clip_global_norm", "scaled_clip"},
    "ClipBeforeUnscale": {"scaled_clip"},
    # GradScaler raises: an ERROR wherever a loss scale is in play
    "DoubleUnscale": {"scaled_clip", "resume_scaler", "logged_loss", "nonfinite_gradient"},
    # the optimizer (U6); decay_groups is N/A when the step is not AdamW's
    "L2InLossWithAdam": {"adamw_decoupled", "adamw_steps"},
    "DecayOnEverything": {"decay_groups"},
    "DecayOnNothing": {"decay_groups"},
    # the embedding held as an nn.Parameter and read with F.embedding is still one (U6)
    "FunctionalTableDecayed": {"decay_groups"},
    # past the first update (where the betas cancel): the betas, the bias correction, the
    # second moment and the step count (U6); the first update is still AdamW's, except
    # without bias correction
    "SwappedBetas": {"adamw_steps"},
    "NoBiasCorrection": {"adamw_decoupled", "adamw_steps"},
    "Amsgrad": {"adamw_steps"},
    "FreshOptimizerEachWindow": {"adamw_steps"},
    # momentum shows from the second SGD update on
    "SGDWithMomentum": {"remainder", "schedule_clock", "schedule_after_warmup"},
    # the logged loss (U1, U4): the update is right, the log is not
    "LogsScaledLoss": {"logged_loss"},
    "LogsMeanOfMicrobatchMeans": {"logged_loss"},
    "LogsLastMicrostep": {"logged_loss"},
    # skipped and empty windows (L4, U4, U5)
    "SchedulerAdvancesOnSkip": {"nonfinite_skip"},
    "UncappedWarmup": {"schedule_after_warmup"},  # the other probes stay inside warm-up
    # without a scaler it steps on NaN; with one, GradScaler skips but the loop logs
    "NoFiniteCheck": {"nonfinite_skip", "nonfinite_gradient"},
    "SkipDecidedFromLossOnly": {"nonfinite_gradient"},
    "EmptyWindowAdvancesSchedule": {"zero_target_window"},
    "LambdaLRStepsOnSkip": {"nonfinite_skip"},
    "ZeroTargetWindowSteps": {"zero_target_window"},
    # modes and evaluation (E1, L5)
    "TrainsInEvalMode": {"train_mode"},
    "EvaluatesInTrainMode": {"eval_mode", "eval_isolation"},  # dropout draws from the RNG
    "EvalLeavesEvalMode": {"eval_isolation"},
    "EvalReseeds": {"eval_isolation"},
    "EvalThroughTrainStep": {"eval_mode", "eval_isolation", "perplexity", "eval_rows"},
    "EvalWithLabelSmoothing": {"eval_rows"},
    "EvalScoresPrompt": {"eval_rows"},
    "EvalCountsPadding": {"eval_rows"},
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
    # the reloaded module is not the optimizer's: it never moves; GradScaler then finds
    # no gradient to check and raises (an ERROR)
    "LoadRebuildsModel": {"resume", "resume_scaler", "resume_data"},
    # -- the shape-correct failure list: what the entries above did not cover --
    # masks (R2): the future visible is read by causal_attention; a packed row drops its
    # last token from the inputs, which the earlier tokens of its last document now see;
    # the answers no longer see the prompt (it is in their past)
    "InvertedTriangle": {"causal_attention", "packed_documents", "prompt_visible"},
    "WrongMaskLength": TRAINS_OR_EVALUATES,  # the target's RuntimeError (broadcast)
    "PadMaskWrongAxis": set(),  # not observable under right padding: see the loop
    # the generator and the criterion (L1, L2); evaluate() uses the same criterion
    "OutAsLogits": LOSS - DATA_PARALLEL | EVAL_VALUES,
    "GeneratorTwice": LOSS - DATA_PARALLEL | EVAL_VALUES,
    "FlattenDestroysVocabulary": TRAINS_OR_EVALUATES,  # the target's IndexError
    "ProbabilitiesIntoKLDiv": LOSS - DATA_PARALLEL | EVAL_VALUES,
    "LogProbsIntoCrossEntropy": set(),  # log_softmax is idempotent: the same objective
    # the confidence lands in the PAD column, which is then zeroed: without smoothing the
    # loss is 0 (the loop never steps), or an index past the row count raises
    "SmoothingScatterWrongDim": TRAINS_OR_EVALUATES,
    # padding (L3): padded labels (the target's pad, 0) counted and scored, EOS (the
    # source's pad, 2) dropped; a packed row's document boundary is such a padded label
    "SourcePadForTargets": {"eos_target", "padding", "packed_documents", "chat_ownership",
                            "label_smoothing", "zero_target_window", "eval_rows"},
    # training through inference's last position: one target per row; the padding probe's
    # last column is all padding, so there it never steps (an ERROR)
    "LastPositionOnly": LOSS,
    # every sequence weighs the same: the probes whose rows hold unequal target counts
    "MeanOfSequenceMeans": {"padding", "accumulation", "ddp_token_mean", "chat_ownership",
                            "label_smoothing", "logged_loss"},
    # the window and the backward (U1, U2, U5)
    "BackwardOfLoggedValue": NEVER_STEPS | {"logged_loss"},  # PyTorch's RuntimeError
    "UnscaleEachMicrobatch": {"scaled_clip"},
    "ScheduleCountsMicrobatches": {"schedule_clock"},
    # data parallel (D1, D5): no reduction at all, ranks diverge; the benign variant
    # communicates every micro-step and computes the same update
    "ForwardInsideNoSync": {"ddp_token_mean"},
    "BackwardInsideNoSync": set(),
    # randomness (E1): not observable through this protocol, see the loop
    "CheckpointRecomputesDropout": set(),
}
# Entries that pass every probe: benign variants and documented blind spots, each
# explained in its docstring and, for the blind spots, shown to be real bugs below.
PASSING = {"PadMaskWrongAxis", "LogProbsIntoCrossEntropy", "BackwardInsideNoSync",
           "CheckpointRecomputesDropout"}
# Where the target's own exception (not a wrong value) is what the probe reports.
ERRORS = {"ZeroGradBeforeStep": NEVER_STEPS,
          "DoubleUnscale": EXPECTED["DoubleUnscale"],
          "WrongMaskLength": TRAINS_OR_EVALUATES, "LoadRebuildsModel": {"resume_scaler"},
          "FlattenDestroysVocabulary": TRAINS_OR_EVALUATES,
          "SmoothingScatterWrongDim": EXPECTED["SmoothingScatterWrongDim"] - {"eval_rows"},
          "BackwardOfLoggedValue": EXPECTED["BackwardOfLoggedValue"],
          "LastPositionOnly": {"padding"}}
# ... and what each of those ERRORs says: the target's own message, not an audit crash.
ERROR_MESSAGES = {
    "WrongMaskLength": ("RuntimeError: The size of tensor a",),
    "FlattenDestroysVocabulary": ("IndexError: Dimension out of range",),
    "SmoothingScatterWrongDim": ("is out of bounds for dimension 0", "never stepped"),
    "BackwardOfLoggedValue": ("element 0 of tensors does not require grad",),
}
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


VARIANTS = ["FunctionalEmbedding", "FusedAdamW", "ManualLogSoftmaxGather",
            "LambdaLRPerCommittedUpdate", "WholeWindowOneForward"]


@pytest.mark.parametrize("name", VARIANTS)
def test_a_correct_loop_written_another_way_passes_every_probe(name: str) -> None:
    """Correct loops by other routes (``audit_correct_loops``): a table read with
    ``F.embedding`` and ``model.forward`` called directly, fused AdamW, a hand-written
    ``log_softmax`` + ``gather`` loss, a ``LambdaLR`` per committed update, the whole
    window in one forward. Nothing fails, nothing is N/A."""
    report = run_audit(getattr(correct, name)())
    assert {r.probe: r.observed for r in report.results if r.status != PASS} == {}
    assert report.ok


@pytest.mark.slow  # 88 loops through every probe: out of the edit loop, once in make test
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_wrong_loop_fails_exactly_its_probes(name: str) -> None:
    report = run_audit(getattr(wrong, name)())
    observed = {r.probe: f"{r.status}: {r.observed}" for r in report.results
                if r.status not in (PASS, NA)}
    assert set(observed) == EXPECTED[name], observed
    errors = {r.probe for r in report.results if r.status == ERROR}
    assert errors == ERRORS.get(name, set()), observed
    if name in ERROR_MESSAGES:
        assert all(any(m in observed[p] for m in ERROR_MESSAGES[name]) for p in errors), \
            observed
    assert report.ok == (name in PASSING)


def test_the_catalogue_covers_every_probe_and_no_probe_fails_everything() -> None:
    """Each probe is failed (a wrong value, not the target's ERROR) by some wrong loop (it
    can fail) and by at most a third of them (it does not fail everything; the loops
    that raise everywhere are the targets' faults, not the probe's); the catalogue holds
    at least 35 loops, each one catalogued."""
    catalogued = {name for name, value in vars(wrong).items() if isinstance(value, type)
                  and value.__module__ == wrong.__name__
                  and issubclass(value, NanoGPTLoop | AnnotatedLoop)}
    broken = {"RaisesInTrain", "NeverSteps", "NaNLogits"}  # tested for ERRORs below
    assert catalogued - broken == set(EXPECTED)
    assert len(EXPECTED) >= 35
    assert {n for n, probes in EXPECTED.items() if not probes} == PASSING
    for probe in NAMES:
        failed_by = [n for n, probes in EXPECTED.items()
                     if probe in probes - ERRORS.get(n, set())]
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


@pytest.mark.parametrize(("name", "probe", "says"), [
    ("NormBT", "padding", "the update is 0.545x the reference: a denominator"),
    ("CountsTgt", "chat_ownership", "the update is 0.5x the reference"),
    ("SGDWithMomentum", "schedule_after_warmup", "matches SGD with momentum 0.9"),
    ("NoBiasCorrection", "adamw_steps", "matches Adam without bias correction"),
    ("Amsgrad", "adamw_steps", "matches AdamW with amsgrad=True"),
    ("SwappedBetas", "adamw_steps", "matches AdamW with the betas swapped"),
    ("FreshOptimizerEachWindow", "adamw_steps", "matches a new optimizer every window"),
    ("ScheduleCountsMicrobatches", "schedule_clock", "matches a microbatch clock"),
    ("SchedulerAdvancesOnSkip", "nonfinite_skip", "matches a schedule advanced by the skipped"),
    ("EmptyWindowAdvancesSchedule", "zero_target_window", "advanced by the skipped window"),
    ("NoZeroGrad", "nonfinite_gradient", "gradient was not cleared"),
    ("LoadRebuildsModel", "resume", "the optimizer is not bound to the loaded module"),
    ("LogsScaledLoss", "logged_loss", "matches the loss still multiplied by the loss scale"),
    ("LogsMeanOfMicrobatchMeans", "logged_loss", "matches a mean of the microbatches' means"),
    ("LogsLastMicrostep", "logged_loss", "matches the last micro-step's mean"),
    ("EvalWithLabelSmoothing", "eval_rows", "matches label smoothing in evaluation"),
    ("EvalScoresPrompt", "eval_rows", "wrong on chat (matches every token scored"),
    ("EvalCountsPadding", "eval_rows", "matches padding counted in the denominator"),
])
def test_a_fail_names_the_known_mistake_it_matches(name: str, probe: str, says: str) -> None:
    """Diagnoses: each is computed from the observed and expected values (a constant
    factor, a known wrong optimizer, schedule, log or evaluation recomputed from the
    same start), never from the loop's name."""
    (result,) = run_audit(getattr(wrong, name)(), probes=[probe]).results
    assert result.status == "FAIL" and says in result.observed, result.observed


def test_a_diagnosis_is_not_given_where_none_matches() -> None:
    """Negative controls: a per-tensor clip is no constant factor and no known AdamW; a
    wrong alignment's log matches no known wrong log."""
    (clip,) = run_audit(wrong.PerTensorClip(), probes=["clip_global_norm"]).results
    assert clip.status == "FAIL" and "matches" not in clip.observed
    assert "x the reference" not in clip.observed
    (log,) = run_audit(wrong.NoShift(), probes=["logged_loss"]).results
    assert log.status == "FAIL" and "matches" not in log.observed


def test_an_unrelated_failure_names_no_alignment() -> None:
    """Negative control: a normalization bug is not reported as a shift bug."""
    (result,) = run_audit(wrong.NormBT(), probes=["padding"]).results
    assert result.status == "FAIL" and "matches" not in result.observed


# -- the blind spots are real bugs (so that passing them is a statement about the probes)


def padded_rows():
    from exactstep.audit import data
    from exactstep.audit.probes import SPEC, gen

    g = gen(60)
    return data.single([data.text(g, n, SPEC) for n in (10, 4, 7)], SPEC, length=12)


def test_the_pad_mask_axis_changes_only_padded_rows() -> None:
    """``[B, T, 1]`` instead of ``[B, 1, T]`` under right padding: the padded rows' logits
    change (the bug is real), the real rows' logits and the update do not, bitwise, in
    a two-layer model (so no layer lets a padded row reach a real one)."""
    from dataclasses import replace

    from exactstep.audit.probes import SPEC
    from exactstep.audit.reference import snapshot

    spec, mb = replace(SPEC, n_layers=2), padded_rows()
    real = mb.documents > 0
    logits, params = [], []
    for loop in (AnnotatedLoop(), wrong.PadMaskWrongAxis()):
        loop.build(spec)
        logits.append(loop.logits(mb.tokens, mb.positions, mb.documents).detach())
        loop.train([mb])
        params.append(snapshot(loop.module))
    assert torch.equal(logits[0][real], logits[1][real])
    assert float((logits[0][~real] - logits[1][~real]).abs().max()) > 1e-3
    assert all(torch.equal(params[0][n], params[1][n]) for n in params[0])


def test_checkpointed_dropout_without_the_rng_state_changes_the_update() -> None:
    """With dropout on, checkpointing that preserves the RNG state reproduces the plain
    loop's update bitwise (the recomputation draws the forward's masks); without it the
    update is another one (relative difference > 1e-2), which no probe sees."""
    from dataclasses import replace

    from exactstep.audit.probes import SPEC, plain_rows
    from exactstep.audit.reference import snapshot

    class Preserving(NanoGPTLoop):
        model_type = wrong.CheckpointedGPT

    spec, mb = replace(SPEC, dropout=0.5, n_layers=2), plain_rows(seed=61)
    deltas = []
    for loop in (NanoGPTLoop(), Preserving(), wrong.CheckpointRecomputesDropout()):
        loop.build(spec)
        before = snapshot(loop.module)
        loop.train([mb])
        after = snapshot(loop.module)
        deltas.append(torch.cat([(after[n] - before[n]).flatten() for n in before]))
    plain, preserved, fresh = deltas
    assert torch.equal(plain, preserved)
    assert float((fresh - plain).abs().max() / plain.abs().max()) > 1e-2


def count_reductions(rank: int, port: int, name: str, out: str) -> None:
    """One of two gloo ranks: one window of two micro-steps of loop ``name``; writes how
    many gradient buckets DDP all-reduced (a comm hook counts them)."""
    from dataclasses import replace
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from exactstep.audit.probes import SPEC, plain_rows

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    try:
        loop = getattr(wrong, name)()  # NanoGPTLoop, the control, is imported there too
        loop.build(replace(SPEC, accum=2))
        calls = []

        def hook(state, bucket):  # noqa: ANN001, ANN202
            calls.append(1)
            return allreduce_hook(state, bucket)

        loop.model.register_comm_hook(None, hook)
        loop.train([plain_rows(seed=70 + rank), plain_rows(seed=72 + rank)])
        Path(out, f"{rank}").write_text(str(len(calls)))
        # neither rank tears the group down while the other may still be reducing: a
        # rank that left first aborted its peer's pending gloo work (SIGABRT, 2 runs in 12)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("name", "reductions"), [
    ("NanoGPTLoop", 1), ("BackwardInsideNoSync", 2), ("ForwardInsideNoSync", 0),
])
def test_the_no_sync_variants_reduce_as_their_docstrings_say(name: str, reductions: int,
                                                             tmp_path) -> None:
    """The correct loop all-reduces once per window (the last micro-step); the benign
    variant every micro-step (its forwards arm the reduction), which is why it passes;
    the misuse never, which is why its ranks diverge."""
    import time

    import torch.multiprocessing as mp
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: F401

    from exactstep.parallel.process_group import free_port

    # spawned, not forked: a fork of this multi-threaded test worker (xdist's own
    # threads) hung one run in four at load, inside DDP's first reduction
    job = mp.start_processes(count_reductions, args=(free_port(), name, str(tmp_path)),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 90
    try:
        while not job.join(timeout=1.0):
            assert time.monotonic() < deadline, "the two ranks did not finish in 90 s"
    finally:
        for process in job.processes:
            if process.is_alive():
                process.kill()
    assert [int((tmp_path / f"{r}").read_text()) for r in range(2)] == [reductions] * 2
