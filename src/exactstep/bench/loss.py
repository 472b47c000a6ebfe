"""Loss memory and time: fused chunked cross entropy vs naive ``logits.float()`` + CE (L1).

Both paths compute the same objective forward and backward; memory is measured as
peak extra RSS in a fresh interpreter per measurement, time as interleaved medians.
``exactstep bench loss`` reports ``memory_ratio`` and ``time_ratio``.
Design and derivations: docs/design/bench.md#benchlosspy (L1).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from exactstep.bench.common import status_kib

FULL = {"rows": 8192, "vocab": 32000, "hidden": 512, "chunk_rows": 1024, "repeats": 3}
QUICK = {"rows": 1024, "vocab": 8000, "hidden": 128, "chunk_rows": 256, "repeats": 3}
TRAIN_SHAPE = {"rows": 4096, "vocab": 259, "hidden": 256, "chunk_rows": 1024}
CHILD_MODULE = "exactstep.bench.loss"  # each child runs ``python -m CHILD_MODULE ...``


def run(quick: bool) -> dict:
    shape = QUICK if quick else FULL
    N, V, H, C = shape["rows"], shape["vocab"], shape["hidden"], shape["chunk_rows"]
    naive = child("memory", "naive", N, V, H, C)
    fused = child("memory", "fused", N, V, H, C)
    fused_2n = child("memory", "fused", 2 * N, V, H, C)
    growth_per_row = (fused_2n["peak_extra_bytes"] - fused["peak_extra_bytes"]) / N
    timing = child("time", "both", N, V, H, C, repeats=shape["repeats"])
    train = child(
        "time",
        "both",
        TRAIN_SHAPE["rows"],
        TRAIN_SHAPE["vocab"],
        TRAIN_SHAPE["hidden"],
        TRAIN_SHAPE["chunk_rows"],
        repeats=3 if quick else 15,
    )
    figures = {
        "rows": N,
        "vocab": V,
        "hidden": H,
        "chunk_rows": C,
        "naive_peak_extra_mib": naive["peak_extra_bytes"] / 2**20,
        "fused_peak_extra_mib": fused["peak_extra_bytes"] / 2**20,
        "memory_ratio": fused["peak_extra_bytes"] / naive["peak_extra_bytes"],
        "fused_peak_extra_mib_at_2n": fused_2n["peak_extra_bytes"] / 2**20,
        "fused_growth_per_row_bytes": growth_per_row,
        "growth_per_row_in_hidden_rows": growth_per_row / (H * 4),
        "growth_per_row_in_logit_rows": growth_per_row / (V * 4),
        "naive_s": timing["naive_s"],
        "fused_s": timing["fused_s"],
        "time_ratio": timing["fused_s"] / timing["naive_s"],
        "train_shape_time_ratio": train["fused_s"] / train["naive_s"],
        "memory_method": fused["method"],
    }
    if not quick:  # naive at 2N needs ~6 GiB at the full shape; only measured quick
        return figures
    naive_2n = child("memory", "naive", 2 * N, V, H, C)
    figures["naive_growth_per_row_in_logit_rows"] = (
        (naive_2n["peak_extra_bytes"] - naive["peak_extra_bytes"]) / N / (V * 4)
    )
    return figures


# --------------------------------------------------------------------- parent side


def child(kind: str, mode: str, N: int, V: int, H: int, C: int, repeats: int = 3) -> dict:
    """Run one measurement in a fresh interpreter and return its JSON result.

    The child is started as ``python -m exactstep.bench.loss``, so it finds this module
    wherever the package is installed (no path of a source checkout is assumed)."""
    args = [
        sys.executable,
        "-m",
        CHILD_MODULE,
        kind,
        mode,
        str(N),
        str(V),
        str(H),
        str(C),
        str(repeats),
    ]
    # a fixed mmap threshold makes glibc hand every large block back to the kernel on
    # free, so resident memory follows live tensors instead of allocator history
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(args, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"bench loss child {kind} {mode} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- child side


def make_inputs(N: int, V: int, H: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen).requires_grad_(True)  # [N, H]
    weight = torch.randn(V, H, generator=gen).mul_(0.02).requires_grad_(True)  # [V, H]
    labels = torch.randint(0, V, (N,), generator=gen)  # [N]
    return hidden, weight, labels


def make_step(mode: str, hidden, weight, labels, C: int):
    import torch
    import torch.nn.functional as F

    from exactstep.objective import ObjectiveConfig, microbatch_terms

    cfg = ObjectiveConfig(chunk_rows=C)
    coeff = torch.ones(1, labels.shape[0])  # [1, N] token-sum coefficients

    def naive() -> None:
        logits = hidden @ weight.T  # [N, V]
        F.cross_entropy(logits.float(), labels, reduction="sum").backward()

    def fused() -> None:
        numerator, _ = microbatch_terms(hidden[None], weight, labels[None], coeff, cfg, pad_id=None)
        numerator.backward()

    step = naive if mode == "naive" else fused

    def clean_step() -> None:
        hidden.grad = None
        weight.grad = None
        step()

    return clean_step


def can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        status_kib("VmHWM")
        return True
    except OSError:
        return False
    except KeyError:
        return False


def measure_memory(mode: str, N: int, V: int, H: int, C: int) -> dict:
    import gc

    hidden, weight, labels = make_inputs(N, V, H)
    step = make_step(mode, hidden, weight, labels, C)
    resettable = can_reset_peak()
    if resettable:
        step()  # warm-up
    hidden.grad = weight.grad = None
    gc.collect()
    if resettable:
        before = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        step()
        peak = status_kib("VmHWM")
        method = "VmHWM reset via /proc/self/clear_refs"
    else:
        before = status_kib("VmRSS")
        step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        method = "getrusage ru_maxrss (no warm-up)"
    return {"peak_extra_bytes": (peak - before) * 1024, "method": method}


def measure_time(N: int, V: int, H: int, C: int, repeats: int) -> dict:
    from exactstep.bench.common import interleaved_times, median

    hidden, weight, labels = make_inputs(N, V, H)
    fused = make_step("fused", hidden, weight, labels, C)
    naive = make_step("naive", hidden, weight, labels, C)
    fused_times, naive_times = interleaved_times(fused, naive, repeats=repeats, warmup=1)
    return {"fused_s": median(fused_times), "naive_s": median(naive_times)}


def main(argv: list[str]) -> None:
    kind, mode = argv[0], argv[1]
    N, V, H, C, repeats = (int(a) for a in argv[2:7])
    if kind == "memory":
        result = measure_memory(mode, N, V, H, C)
    else:
        result = measure_time(N, V, H, C, repeats)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
