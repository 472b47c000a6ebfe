"""CUDA-fast defaults that are declared, resolved and recorded (U2, S1; issue 16 item 7).

``numerics.precision = auto`` is bf16 on a CUDA device with native bf16 and fp32 on
the CPU; ``numerics.fp32_matmul = auto`` is TF32 on CUDA. A run resolves both before
its manifest is written, so the manifest names what ran (never ``auto``) and a resume
keeps it. FSDP2's policy follows the resolved precision.
"""

from __future__ import annotations

import torch

from exactstep.config import load_config
from exactstep.parallel.process_group import shutdown
from exactstep.parallel.wrap import fsdp_mixed_precision
from exactstep.run.runner import build_run
from exactstep.update.config import NumericsConfig, resolve_numerics
from exactstep.update.precision import Precision, apply_fp32_matmul


def test_auto_resolves_per_device():
    auto = NumericsConfig()
    assert (auto.precision, auto.fp32_matmul) == ("auto", "auto")
    cuda = resolve_numerics(auto, "cuda")
    assert (cuda.precision, cuda.fp32_matmul) == ("bf16", "tf32")
    old_gpu = resolve_numerics(auto, "cuda", bf16_native=False)
    assert (old_gpu.precision, old_gpu.fp32_matmul) == ("fp32", "tf32")
    cpu = resolve_numerics(auto, "cpu")
    assert (cpu.precision, cpu.fp32_matmul) == ("fp32", "ieee")


def test_explicit_values_pass_through_and_resolving_twice_is_the_identity():
    for precision in ("fp32", "bf16", "fp16"):
        for matmul in ("ieee", "tf32"):
            cfg = NumericsConfig(precision=precision, fp32_matmul=matmul, init_scale=8.0)
            for device in ("cpu", "cuda"):
                assert resolve_numerics(cfg, device) == cfg
    once = resolve_numerics(NumericsConfig(), "cuda")
    assert resolve_numerics(once, "cpu") == once  # a resume elsewhere keeps what ran


def test_precision_on_cpu_defaults_to_fp32():
    precision = Precision(NumericsConfig(), "cpu")
    assert precision.name == "fp32" and not precision.uses_scaler
    assert Precision(NumericsConfig(precision="bf16"), "cpu").name == "bf16"


def test_the_manifest_records_the_resolved_numerics_not_auto(tmp_path):
    cfg = load_config(overrides=["train.device=cpu", "model.d_model=16", "model.n_heads=2",
                                 "model.n_layers=1", "model.d_ff=16", "batch.seq_len=16",
                                 "batch.rows=2"])
    assert cfg.numerics.precision == "auto"
    run = build_run(cfg, tmp_path / "run")
    try:
        recorded = run.manifest.body["config"]["numerics"]
        assert (recorded["precision"], recorded["fp32_matmul"]) == ("fp32", "ieee")
        assert run.manifest.body["numerics"]["precision"] == "fp32"
        assert run.engine.precision.name == "fp32"
    finally:
        shutdown(run.ctx)
    assert not (tmp_path / "run").exists()  # building writes nothing


def test_fp32_matmul_mode_is_set_for_cuda_only():
    before = torch.get_float32_matmul_precision()
    try:
        apply_fp32_matmul(NumericsConfig(), "cpu")
        assert torch.get_float32_matmul_precision() == before  # the CPU is never touched
        apply_fp32_matmul(NumericsConfig(), "cuda")  # only sets torch's flag: no CUDA call
        assert torch.get_float32_matmul_precision() == "high"  # TF32
        apply_fp32_matmul(NumericsConfig(fp32_matmul="ieee"), "cuda")
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_fsdp_policy_gathers_bf16_and_reduces_fp32_only_under_bf16():
    bf16 = fsdp_mixed_precision("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    for name in ("fp32", "fp16"):
        policy = fsdp_mixed_precision(name)
        assert (policy.param_dtype, policy.reduce_dtype) == (None, None)
