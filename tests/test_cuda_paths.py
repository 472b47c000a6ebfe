"""CUDA-only checks of the paths issue 16 fixed (skipped without a GPU).

- U7: a window moves its host data pinned and asynchronously; under
  ``torch.cuda.set_sync_debug_mode`` it makes exactly one synchronising call (the
  finite decision), per-document attention and FlexAttention alike. Negative
  control: a blocking copy is counted.
- (``tests/model/test_attention_cuda.py``: the host-built block mask on CUDA.)
- S2: the RNG state of the current device round-trips; U2: bf16 is the default.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from exactstep.smoke.gpu import count_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("impl", ["segments", "auto"])
def test_a_window_makes_exactly_one_synchronising_call(impl) -> None:
    from exactstep.smoke.gpu import DRY, GPU, Env, host_batches, make_engine

    env = Env(CUDA, replace(GPU, model=replace(DRY.model, d_model=64, n_heads=4), rows=4,
                            seq_len=64), dry_run=False)
    batches = host_batches(env, 3)
    engine = make_engine(env, replace(env.shapes.model, attention=impl), "bf16")
    for w in range(2):  # warm-up: compilation, optimizer state, pinned-memory pool
        engine.run_window([batches[w]], w)
    torch.cuda.synchronize()
    assert count_syncs(lambda: engine.run_window([batches[2]], 2)) == 1


def test_negative_control_a_blocking_copy_is_counted() -> None:
    assert count_syncs(lambda: torch.arange(8).to(CUDA)) >= 1
    from exactstep.rows.transfer import host_to_device

    assert count_syncs(lambda: host_to_device(torch.arange(8), CUDA)) == 0


def test_batches_are_pinned_before_the_copy() -> None:
    from exactstep.parallel.agreement import empty_microbatch

    pinned = empty_microbatch(2, 8, 0).pin_memory()
    assert pinned.input_ids.is_pinned() and pinned.segment_ids.is_pinned()


def test_rng_round_trips_the_current_device_only() -> None:
    from exactstep.state.rng import capture_rng, restore_rng

    torch.rand(1, device=CUDA)  # CUDA initialised
    saved = capture_rng()
    assert saved["cuda_devices"] == [torch.cuda.current_device()] and len(saved["cuda"]) == 1
    first = torch.rand(4, device=CUDA)
    restore_rng(saved)
    assert torch.equal(torch.rand(4, device=CUDA), first)


def test_bf16_is_the_cuda_default_where_native() -> None:
    from exactstep.update.config import NumericsConfig
    from exactstep.update.precision import Precision

    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert Precision(NumericsConfig(), CUDA).name == ("bf16" if native else "fp32")
