"""The pure-Python oracle (L6): worked numbers, independence from torch, and agreement
with the torch path on random small cases (L1, L2)."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactstep.objective import ObjectiveConfig, fused_row_losses, logits_row_losses
from exactstep.objective import reference as ref
from exactstep.rows.batch import IGNORE_INDEX

REFERENCE_FILE = Path(ref.__file__)


# ------------------------------------------------------------------ worked numbers


def test_two_equal_logits_cost_ln2_whichever_the_target():
    for gold in (0, 1):
        smoothed, nll = ref.row_loss([0.7, 0.7], gold)
        assert nll == pytest.approx(0.693147, abs=1e-6)
        assert smoothed == pytest.approx(math.log(2), abs=1e-12)


def test_four_equal_logits_cost_ln4():
    for gold in range(4):
        assert ref.row_loss([3.0] * 4, gold)[1] == pytest.approx(math.log(4), abs=1e-12)


def test_three_logits_worked_example_and_its_gradient():
    # probabilities of logits (2, 1, 0) are e^2, e^1, e^0 over their sum
    total = math.exp(2) + math.exp(1) + 1
    smoothed, nll = ref.row_loss([2.0, 1.0, 0.0], 0)
    assert nll == pytest.approx(-math.log(math.exp(2) / total), abs=1e-12)
    grad = ref.row_logit_gradient([2.0, 1.0, 0.0], 0)
    assert grad[0] == pytest.approx(math.exp(2) / total - 1, abs=1e-12)
    assert math.fsum(grad) == pytest.approx(0.0, abs=1e-12)


def test_token_mean_is_3_and_mean_of_row_means_is_3_5():
    rows = [[2.0, 2.0], [5.0]]  # row A: two targets of loss 2; row B: one of loss 5
    assert ref.token_mean(rows) == pytest.approx(3.0)
    assert ref.mean_of_row_means(rows) == pytest.approx(3.5)
    rows = [[1.0, 1.0, 1.0], [3.0]]
    assert ref.token_mean(rows) == pytest.approx(1.5)
    assert ref.mean_of_row_means(rows) == pytest.approx(2.0)


def test_harvard_target_gold_one_minus_eps_pad_zero_rest_eps_over_v_minus_2():
    eps, V, pad, gold = 0.1, 6, 0, 3
    q = ref.target_distribution(V, gold, eps, "harvard", pad)
    assert q[gold] == pytest.approx(1 - eps)
    assert q[pad] == 0.0
    for c in (1, 2, 4, 5):
        assert q[c] == pytest.approx(eps / (V - 2))
    assert math.fsum(q) == pytest.approx(1.0)


def test_uniform_and_non_pad_targets():
    eps, V, pad, gold = 0.2, 5, 4, 1
    q = ref.target_distribution(V, gold, eps, "uniform")
    assert q[gold] == pytest.approx(1 - eps + eps / V)
    assert q[0] == pytest.approx(eps / V)
    q = ref.target_distribution(V, gold, eps, "non_pad", pad)
    assert q[pad] == 0.0 and q[gold] == pytest.approx(1 - eps + eps / (V - 1))
    assert math.fsum(q) == pytest.approx(1.0)


def test_next_token_labels_shift_once_and_respect_ownership():
    assert ref.next_token_labels([5, 6, 7, 8]) == [6, 7, 8, IGNORE_INDEX]
    # tokens 0..1 are a prompt: row 0 predicts a prompt token (no loss), row 1 owns token 2
    owned = [False, False, True, True]
    assert ref.next_token_labels([5, 6, 7, 8], owned) == [IGNORE_INDEX, 7, 8, IGNORE_INDEX]


# ---------------------------------------------------------------- no torch inside


def test_reference_imports_nothing_but_the_standard_library():
    tree = ast.parse(REFERENCE_FILE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "math", "collections"}, imported


def test_reference_loads_without_torch_in_a_fresh_interpreter():
    # log softmax of [0, 0] is -(0 + log 2): a few float64 roundings of values < 1, at most
    # ~4 * 2**-53 = 4.4e-16 from log 2, so 1e-15 holds on any libm with a faithful log
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('reference', {str(REFERENCE_FILE)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "assert abs(module.row_loss([0.0, 0.0], 1)[1] - 0.6931471805599453) < 1e-15\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_reference_ignore_index_is_the_batch_ignore_index():
    assert ref.IGNORE_INDEX == IGNORE_INDEX


# ------------------------------------------------- reference vs torch, random cases


@st.composite
def small_cases(draw):
    V = draw(st.integers(3, 7))
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 6))
    logit = st.floats(-8, 8, allow_nan=False, width=32)
    logits = [[[draw(logit) for _ in range(V)] for _ in range(T)] for _ in range(B)]
    label = st.one_of(st.just(IGNORE_INDEX), st.integers(0, V - 1))
    labels = [[draw(label) for _ in range(T)] for _ in range(B)]
    convention = draw(st.sampled_from(["uniform", "non_pad", "harvard"]))
    eps = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    pad = draw(st.integers(0, V - 1))
    chunk = draw(st.integers(0, 5))
    return logits, labels, convention, eps, pad, chunk


def torch_row_losses(logits, labels, convention, eps, pad, chunk, fused: bool):
    V = len(logits[0][0])
    z = torch.tensor(logits, dtype=torch.float32).reshape(-1, V)
    y = torch.tensor(labels, dtype=torch.int64).reshape(-1)
    cfg = ObjectiveConfig(smoothing=convention, label_smoothing=eps, chunk_rows=chunk)
    if fused:  # identity head: hidden = logits, W = I
        return fused_row_losses(z, torch.eye(V), y, cfg, pad_id=pad)
    return logits_row_losses(z, y, cfg, pad_id=pad)


@settings(max_examples=30, deadline=None)
@given(small_cases(), st.booleans())
def test_torch_row_losses_match_the_reference(case, fused):
    logits, labels, convention, eps, pad, chunk = case
    ce, nll = torch_row_losses(logits, labels, convention, eps, pad, chunk, fused)
    flat = [
        (z, y)
        for seq_z, seq_y in zip(logits, labels, strict=True)
        for z, y in zip(seq_z, seq_y, strict=True)
    ]
    for r, (z, y) in enumerate(flat):
        if y == IGNORE_INDEX:
            assert ce[r].item() == 0.0 and nll[r].item() == 0.0
            continue
        want_ce, want_nll = ref.row_loss(z, y, eps, convention, pad)
        assert ce[r].item() == pytest.approx(want_ce, abs=1e-6, rel=1e-6)
        assert nll[r].item() == pytest.approx(want_nll, abs=1e-6, rel=1e-6)


@settings(max_examples=15, deadline=None)
@given(small_cases())
def test_torch_logit_gradient_matches_the_reference(case):
    """In fp64, so that any gap beyond rounding (1e-9) is a formula difference."""
    logits, labels, convention, eps, pad, chunk = case
    V = len(logits[0][0])
    z = torch.tensor(logits, dtype=torch.float64).reshape(-1, V).requires_grad_(True)
    y = torch.tensor(labels).reshape(-1)
    cfg = ObjectiveConfig(smoothing=convention, label_smoothing=eps, chunk_rows=chunk)
    ce, _ = logits_row_losses(z, y, cfg, pad_id=pad)
    (grad,) = torch.autograd.grad(ce.sum(), z)
    for r, (zr, yr) in enumerate(zip(z.tolist(), y.tolist(), strict=True)):
        want = (
            [0.0] * V
            if yr == IGNORE_INDEX
            else ref.row_logit_gradient(zr, yr, eps, convention, pad)
        )
        assert grad[r].tolist() == pytest.approx(want, abs=1e-9)


def test_reference_agreement_check_catches_a_mixed_convention():
    """Negative control: torch ``uniform`` scored against the reference's ``non_pad``."""
    logits = [[[0.3, -1.0, 2.0, 0.5]]]
    z = torch.tensor(logits).reshape(-1, 4)
    ce, _ = logits_row_losses(
        z, torch.tensor([2]), ObjectiveConfig(label_smoothing=0.3), pad_id=None
    )
    wrong = ref.row_loss(logits[0][0], 2, 0.3, "non_pad", 0)[0]
    right = ref.row_loss(logits[0][0], 2, 0.3, "uniform")[0]
    assert ce[0].item() == pytest.approx(right, abs=1e-6)
    assert ce[0].item() != pytest.approx(wrong, abs=1e-6)
