"""The GPU smoke test runs in CI as a dry run on the CPU, so it cannot rot (issue 16).

``exactstep smoke gpu --dry-run --json`` runs every check through the same code with
tiny shapes: the checks that need CUDA say so (``SKIP``, or ``not run here: ...``),
every other one passes, stdout is one JSON object and stderr one line per check.
Negative controls: a broken fp16 back-off fails its check, and a failing check makes
the command exit non-zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exactstep.cli import main
from exactstep.smoke import gpu
from exactstep.update.precision import Precision

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXPECTED = {"attention": "PASS", "windows": "PASS", "sync_audit": "SKIP", "fp16_skip": "PASS",
            "resume": "PASS", "fsdp_hf": "PASS", "chunked_ce": "PASS", "mfu": "PASS",
            "context_parallel": "PASS"}


def test_dry_run_exercises_every_check_and_names_what_needs_cuda(capsys) -> None:
    assert main(["smoke", "gpu", "--dry-run", "--json"]) == 0
    captured = capsys.readouterr()
    (summary,) = [json.loads(line) for line in captured.out.splitlines() if line.startswith("{")]
    assert summary["checks"] == EXPECTED and summary["ok"] is True
    assert summary["dry_run"] is True and summary["device"] == "cpu"
    lines = [line for line in captured.err.splitlines() if line.startswith("check ")]
    assert [line.split(":")[0] for line in lines] == [f"check {name}" for name in EXPECTED]
    by_name = dict(zip(EXPECTED, lines, strict=True))
    assert "SKIP" in by_name["sync_audit"] and "needs CUDA" in by_name["sync_audit"]
    for partial in ("attention", "chunked_ce", "context_parallel"):
        assert "not run here:" in by_name[partial] and "need" in by_name[partial]
    assert summary["resume_differences"] == 0
    assert summary["fp16_skip_scale_after_skip"] == summary["fp16_skip_scale_before_skip"] / 2
    assert summary["windows_max_loss_rel_diff"] <= gpu.BF16_LOSS_RTOL
    assert summary["fsdp_hf_full_units"] == summary["fsdp_hf_lora_units"] == 3  # 2 layers + root
    assert summary["fsdp_hf_full_max_abs_diff"] <= gpu.FSDP_TOLERANCE
    # 0x0A: two gloo ranks keep the packed visibility; both planted controls fail the rule
    tolerance = summary["context_parallel_output_tolerance"]
    assert summary["context_parallel_output_error"] <= tolerance
    for control in ("own_keys", "isolated", "rank0_positions"):
        assert summary[f"context_parallel_{control}_output_error"] > tolerance, control


def test_negative_control_a_scaler_that_never_backs_off_fails_the_fp16_check(monkeypatch):
    real = Precision.update
    monkeypatch.setattr(Precision, "update",  # WRONG: every window counts as finite
                        lambda self, optimizer, *, finite: real(self, optimizer, finite=True))
    result, _ = gpu.run_check("fp16_skip", gpu.check_fp16_skip, gpu.environment(True))
    assert result.status == "FAIL" and "did not halve" in " ".join(result.notes)


def test_negative_control_fsdp_without_per_layer_units_fails_its_check(monkeypatch):
    """D4: sharding the root alone (what an HF model got before) fails ``fsdp_hf``."""
    pytest.importorskip("peft")
    from exactstep.parallel import wrap

    monkeypatch.setattr(wrap, "shard_blocks", lambda model: [])
    result, _ = gpu.run_check("fsdp_hf", gpu.check_fsdp_hf, gpu.environment(True))
    assert result.status == "FAIL" and "not 2 decoder layers" in " ".join(result.notes)


def planted_ranks(figures: dict):
    """Stands in for the spawned ranks: every rank reports ``figures``."""
    def start_processes(fn, args, nprocs, **kwargs):
        out = Path(args[-1])
        for rank in range(nprocs):
            (out / f"rank{rank}.json").write_text(json.dumps(figures))
    return start_processes


CP_GOOD = {"output_tolerance": 1e-6, "output_error": 4e-7, "own_keys_output_error": 2.0,
           "isolated_output_error": 2.5, "rank0_positions_output_error": 1.2}


@pytest.mark.parametrize(("planted", "why"), [
    ({}, None),
    ({"output_error": 3e-6}, "differs from one process by more than twice"),
    ({"own_keys_output_error": 5e-7}, "the own_keys control passes the output check"),
])
def test_context_parallel_fails_on_a_shard_beyond_the_rule_or_a_control_within_it(
        monkeypatch, planted, why):
    """0x0A: the ``context_parallel`` verdict from its ranks' figures (the ranks' own
    measurements are in the dry run above): a shard farther than twice one process's
    error fails, and so does a planted control that the rule cannot tell from it."""
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "start_processes", planted_ranks({**CP_GOOD, **planted}))
    result, _ = gpu.run_check("context_parallel", gpu.check_context_parallel,
                              gpu.environment(True))
    assert result.status == ("PASS" if why is None else "FAIL"), result.notes
    if why is not None:
        assert why in " ".join(result.notes)


def test_a_failing_check_makes_the_command_exit_non_zero(monkeypatch, capsys) -> None:
    def broken(env, result):
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu, "CHECKS", (("broken", broken),))
    assert main(["smoke", "gpu", "--dry-run", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["checks"] == {"broken": "FAIL"}
    assert "check broken: FAIL" in captured.err and "RuntimeError: boom" in captured.err


def test_flops_per_token_counts_every_matmul_weight_and_causal_attention() -> None:
    from exactstep.model.config import ModelConfig
    from exactstep.model.decoder import build_model

    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=48)
    model = build_model(cfg, 50, seed=0)
    matmul_weights = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # + tied head
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert norms == (2 * cfg.n_layers + 1) * cfg.d_model
    assert gpu.flops_per_token(cfg, 50, seq_len=64) == 6 * matmul_weights + 6 * 2 * 32 * 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_without_cuda_and_without_dry_run_the_command_refuses(capsys) -> None:
    assert main(["smoke", "gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: smoke gpu needs a CUDA device; run 'exactstep smoke gpu --dry-run' "
                   "to exercise the same code on the CPU")


def test_dry_run_is_refused_by_a_benchmark_without_it(capsys) -> None:
    assert main(["bench", "packing", "--dry-run"]) == 2
    assert "has no --dry-run" in capsys.readouterr().err
