"""Freed host memory leaves the resident set (L1, ``exactstep.host_memory``).

Each case runs in a fresh interpreter (mallopt changes the process): an 8 MiB tensor
is freed (glibc then raises its mmap threshold), then 100 tensors of 4 MiB are made,
each followed by a small tensor that stays alive, and freed. With the threshold
raised they sit in the heap under the small ones and stay resident (the negative
control); pinned, each was its own mapping and is returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc, /proc")

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch

    def rss():
        for line in open('/proc/self/status'):
            if line.startswith('VmRSS'):
                return int(line.split()[1]) / 1024

    mode, out = sys.argv[1], sys.argv[2]
    pinned = None
    if mode == 'keep':
        from exactstep.host_memory import keep_mmap_threshold
        pinned = keep_mmap_threshold()
    elif mode == 'run':  # what every run does before building its model
        from exactstep import runner
        from exactstep.config import load_config
        cfg = load_config(overrides=['model.d_model=16', 'model.n_layers=1', 'model.n_heads=2',
                                     'model.d_ff=32', 'batch.rows=2', 'batch.seq_len=32',
                                     'data.max_docs=40', 'data.val_fraction=0.25',
                                     'train.steps=1'])
        runner.build_run(cfg, Path(out))
    base = rss()
    big = torch.ones(8 << 18)
    del big
    ts, alive = [], []
    for _ in range(100):
        ts.append(torch.ones(1 << 20))
        alive.append(torch.ones(64))
    peak = rss()
    del ts
    print(json.dumps({'pinned': pinned, 'held': rss() - base, 'made': peak - base}))
""")


def freed(mode: str, tmp_path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(tmp_path / "run")],
                          capture_output=True, text=True, check=True, timeout=300,
                          env={**environ, **env})
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_activations_stay_resident_without_the_pin(tmp_path):
    result = freed("plain", tmp_path)
    assert result["made"] > 350  # 400 MiB made
    assert result["held"] > 300  # and still resident after the free


@pytest.mark.parametrize("mode", ["keep", "run"])
def test_with_the_pin_they_are_returned(tmp_path, mode):
    result = freed(mode, tmp_path)
    assert result["made"] > 350
    assert result["held"] < 50
    if mode == "keep":
        assert result["pinned"] is True


def test_the_users_own_setting_stands(tmp_path, monkeypatch):
    """``MALLOC_MMAP_THRESHOLD_`` set: ``mallopt`` is never called (their choice stands);
    unset: it is called once, with glibc's parameter number and default. The C library
    is replaced by a recorder; the subprocess shows the same refusal in a real one."""
    import ctypes

    from exactstep import host_memory

    calls: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
    assert host_memory.keep_mmap_threshold() is False and calls == []
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert host_memory.keep_mmap_threshold() is True
    assert calls == [(-3, 128 * 1024)]  # M_MMAP_THRESHOLD in glibc's <malloc.h>
    assert freed("keep", tmp_path, MALLOC_MMAP_THRESHOLD_=str(32 << 20))["pinned"] is False
