"""Host memory: big freed tensors leave the resident set, small ones are reused (L1).

Each case runs in a fresh interpreter (mallopt changes the process).

- Returned: a 30 MiB tensor is freed (glibc then raises its mmap threshold to 30 MiB),
  then 20 tensors of 20 MiB are made, each followed by a 1 MiB tensor that stays
  alive, and freed. Under glibc's own rule they sit in the heap under the small ones
  and stay resident (the negative control); with the pin each was its own mapping.
- Reused: a 4 MiB tensor is made, filled and freed 100 times. With the pin it comes
  back from the heap and its pages are faulted once; under the old 128 KiB pin each
  one is a fresh mapping faulted anew, page by page (the negative control: the fault
  storm that halved the default run's speed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow,  # real processes with their own malloc tunables
              pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc, /proc")]

SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    import torch

    def rss():
        for line in open('/proc/self/status'):
            if line.startswith('VmRSS'):
                return int(line.split()[1]) / 1024

    mode, case, out = sys.argv[1], sys.argv[2], sys.argv[3]
    pinned = None
    if mode == 'pin':
        from exactstep.run.host_memory import pin_mmap_threshold
        pinned = pin_mmap_threshold()
    elif mode == 'run':  # what every run does before building its model
        from exactstep.run import runner
        from exactstep.config import load_config
        cfg = load_config(overrides=['model.d_model=16', 'model.n_layers=1', 'model.n_heads=2',
                                     'model.d_ff=32', 'batch.rows=2', 'batch.seq_len=32',
                                     'data.max_docs=40', 'data.val_fraction=0.25',
                                     'train.steps=1'])
        runner.build_run(cfg, Path(out))
    if case == 'returned':
        base = rss()
        big = torch.ones(30 << 18)
        del big
        ts, alive = [], []
        for _ in range(20):
            ts.append(torch.ones(20 << 18))
            alive.append(torch.ones(256 << 10))  # 1 MiB, from the heap's top
        peak = rss()
        del ts
        print(json.dumps({'pinned': pinned, 'held': rss() - base, 'made': peak - base}))
    else:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(100):
            t = torch.empty(1 << 20)
            t.fill_(1.0)
            small = torch.empty(16)
            del t
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(json.dumps({'pinned': pinned, 'faults': faults}))
""")
PAGES = 100 * (4 << 20) // 4096  # pages of the 100 tensors of the reuse case


def child(mode: str, case: str, tmp_path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, case, str(tmp_path / "run")],
                          capture_output=True, text=True, check=True, timeout=300,
                          env={**environ, **env})
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_activations_stay_resident_under_glibcs_own_rule(tmp_path):
    result = child("plain", "returned", tmp_path)
    assert result["made"] > 350  # 400 MiB made
    assert result["held"] > 300  # and still resident after the free


@pytest.mark.parametrize("mode", ["pin", "run"])
def test_with_the_pin_big_tensors_are_returned(tmp_path, mode):
    result = child(mode, "returned", tmp_path)
    assert result["made"] > 350
    assert result["held"] < 50
    if mode == "pin":
        assert result["pinned"] is True


@pytest.mark.parametrize("mode", ["pin", "run"])
def test_with_the_pin_small_tensors_are_reused_not_refaulted(tmp_path, mode):
    assert child(mode, "reused", tmp_path)["faults"] < PAGES // 5


def test_the_old_128_kib_pin_refaults_every_small_tensor(tmp_path):
    """The negative control of the reuse case: the old pin, set as glibc reads it at
    start-up, on a fresh heap (a big free chunk left in the heap would serve the
    tensors whatever the threshold)."""
    result = child("plain", "reused", tmp_path, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    assert result["faults"] > PAGES // 2


@pytest.mark.parametrize("setting", [
    {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)}, {"MALLOC_TRIM_THRESHOLD_": "0"},
    {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}])
def test_the_users_own_setting_stands(tmp_path, monkeypatch, setting):
    """A user's malloc setting in the environment: ``mallopt`` is never called (their
    choice stands); none: it is called for the mmap threshold (6 MiB) and the trim
    threshold (12 MiB) with glibc's parameter numbers. The C library is replaced by a
    recorder; the subprocess shows the same refusal in a real one."""
    import ctypes

    from exactstep.run import host_memory

    calls: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    for name in (*host_memory.USER_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    assert host_memory.pin_mmap_threshold() is False and calls == []
    for name in setting:
        monkeypatch.delenv(name)
    assert host_memory.pin_mmap_threshold() is True
    assert calls == [(-3, 6 << 20), (-1, 12 << 20)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert child("pin", "reused", tmp_path, **setting)["pinned"] is False


def test_the_threshold_follows_the_runs_own_shapes():
    """``threshold_for``: above the widest per-layer activation (whole MiB, between
    6 and 32 MiB), and no more than the layer input activation checkpointing keeps.
    ``activation_bytes`` read from the models themselves, against the shapes written
    out: the default decoder (16 x 256 tokens, gate_up 2 x 344 wide, d_model 128) and
    a Qwen2.5-0.5B-shaped layer (4 x 512 tokens, intermediate 4864, hidden 896)."""
    from exactstep.config import load_config
    from exactstep.model.decoder import activation_bytes, build_model
    from exactstep.run import host_memory

    mib = 1 << 20
    assert host_memory.threshold_for(10) == 6 * mib  # tiny shapes: the floor
    assert host_memory.threshold_for(int(10.75 * mib)) == 11 * mib
    assert host_memory.threshold_for(11 * mib) == 12 * mib  # strictly above
    assert host_memory.threshold_for(38 * mib) == 32 * mib  # glibc's largest
    assert host_memory.threshold_for(38 * mib, 7 * mib) == 7 * mib  # the kept input mapped
    assert host_memory.threshold_for(11 * mib, 2 * mib) == 2 * mib
    assert host_memory.threshold_for(11 * mib, 1000) == 1 * mib  # the floor for kept ones

    cfg = load_config()
    tokens = cfg.batch.rows * cfg.batch.seq_len
    model = build_model(cfg.model, 259, seed=0)
    assert activation_bytes(model, tokens, 259) == (4 * 16 * 256 * 2 * 344, 4 * 16 * 256 * 128)
    hf = load_config(overrides=[
        'model.source=hf', 'model.hf_config={"model_type": "qwen2", "hidden_size": 896, '
        '"intermediate_size": 4864, "num_hidden_layers": 1, "num_attention_heads": 14, '
        '"num_key_value_heads": 2, "vocab_size": 1000}', "model.lora.r=4"]).model
    pytest.importorskip("peft")
    qwen = build_model(hf, 1000, seed=0)  # its head (1000 wide) is not an activation
    assert activation_bytes(qwen, 2048, 1000) == (4 * 2048 * 4864, 4 * 2048 * 896)
