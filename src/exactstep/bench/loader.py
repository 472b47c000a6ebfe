"""Prepared-shard loader: packing throughput against raw memmap reads, and peak RSS
of a 100-window run over two corpus sizes (P2, R4, R7).

On synthetic prepared corpora, ``exactstep bench loader`` reports ``RowStream``'s
rate against nanoGPT-style memmap reads, where a batch's time goes, whether peak RSS
grows with the corpus (``rss_ratio``), and the step cost of packing inline, on a
thread or in a loader process.
Design and derivations: docs/design/bench.md#benchloaderpy (P2, R4, R7).
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from exactstep.bench.common import interleaved_times, median
from exactstep.data.prepared import (
    FORMAT,
    INDEX_COLUMNS,
    MANIFEST,
    VERSION,
    fingerprint_of,
    manifest_bytes,
    open_prepared,
    shard_names,
)
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.rows.config import BatchConfig
from exactstep.rows.prepared import ORDER_RULE, PreparedDocuments
from exactstep.rows.sources import representation_of
from exactstep.rows.stream import RowStream
from exactstep.state.durable import sha256_file

SIZES_MB = (1024, 4096)  # the 1 GB and 4 GB corpora of the goal (P2)
QUICK_SIZES_MB = (16, 64)
SEQ_LEN, ROWS, BUFFER = 2048, 8, 512
BLOCK = 4096
SHARD_TOKENS = 1 << 26
WINDOWS = 100


def write_synthetic(path: Path, megabytes: int, seed: int = 0) -> Path:
    """A prepared directory of about ``megabytes`` MB of train tokens (and a small
    validation split), every file fingerprinted like ``exactstep prepare``'s."""
    tok = ByteTokenizer()
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    splits = {}
    for split, tokens in (("train", megabytes * (1 << 20) // 2), ("val", 1 << 16)):
        lengths = np.maximum(2, rng.lognormal(np.log(400), 0.9, tokens // 300 + 16)
                             .astype(np.int64))
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
        shard_of = (np.cumsum(lengths) - 1) // SHARD_TOKENS
        shards = [write_shard(path, split, k, lengths[shard_of == k], rng, tok)
                  for k in range(int(shard_of[-1]) + 1)]
        (path / f"{split}.unigram").write_bytes(np.zeros(tok.vocab_size, np.int64).tobytes())
        splits[split] = {"documents": int(len(lengths)), "tokens": int(lengths.sum()),
                         "targets": int((lengths - 1).sum()), "min_length": int(lengths.min()),
                         "max_length": int(lengths.max()), "shards": shards}
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(path.iterdir())}
    meta = {"format": FORMAT, "version": VERSION, "kind": "text", "source": "synthetic",
            "source_fingerprint": f"synthetic:{megabytes}MB:seed{seed}",
            "split_rule": "synthetic", "representation": representation_of(tok),
            "dtype": "uint16", "order": {"rule": ORDER_RULE, "block_documents": BLOCK,
                                         "seed": "the run's seed"},
            "splits": splits, "files": files}
    meta["fingerprint"] = fingerprint_of(meta)
    (path / MANIFEST).write_bytes(manifest_bytes(meta))
    return path


def write_shard(path: Path, split: str, number: int, lengths: np.ndarray,
                rng: np.random.Generator, tok: ByteTokenizer) -> dict:
    """Shard files for documents of ``lengths``: ``BOS, random bytes, EOS`` each."""
    names = shard_names(split, number, chat=False)
    with open(path / names["tokens"], "wb") as fh:
        for start in range(0, len(lengths), 512):
            part = lengths[start: start + 512]
            tokens = rng.integers(0, 256, int(part.sum()), dtype=np.uint16)
            ends = np.cumsum(part)
            tokens[ends - part] = tok.bos_id
            tokens[ends - 1] = tok.eos_id
            fh.write(tokens.tobytes())
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    index = np.stack([offsets, lengths, lengths - 1], axis=1).astype(np.int64)
    assert index.shape[1] == INDEX_COLUMNS
    (path / names["index"]).write_bytes(index.tobytes())
    return {"files": names, "documents": int(len(lengths)), "tokens": int(lengths.sum())}


def packing_stream(path: Path) -> RowStream:
    """The candidate's stream over the prepared train split of ``path``."""
    tok = ByteTokenizer()
    docs = PreparedDocuments(open_prepared(path, verify=False).splits["train"], BLOCK)
    cfg = BatchConfig(seq_len=SEQ_LEN, rows=ROWS, buffer=BUFFER)
    return RowStream(docs, cfg, pad_id=tok.pad_id, seed=0, vocab_size=tok.vocab_size)


def packed_tokens(stream: RowStream, batches: int) -> int:
    """Pack ``batches`` more batches from ``stream``; the real tokens they hold."""
    before = stream.planner.counts.real_tokens
    for _ in range(batches):
        stream.next_batch()
    return stream.planner.counts.real_tokens - before


class MemmapReader:
    """The baseline: contiguous ``SEQ_LEN`` slices of the first train shard, read on
    from where the last call stopped (wrapping at the end) into int64 tensors
    ``[ROWS, SEQ_LEN]``."""

    def __init__(self, path: Path) -> None:
        self.shard = open_prepared(path, verify=False).splits["train"].shards[0].tokens
        self.position = 0

    def read(self, tokens: int) -> int:
        done = 0
        while done < tokens:
            rows = []
            for _ in range(ROWS):
                if self.position + SEQ_LEN > len(self.shard):
                    self.position = 0
                rows.append(self.shard[self.position: self.position + SEQ_LEN])
                self.position += SEQ_LEN
            torch.from_numpy(np.stack(rows).astype(np.int64))
            done += ROWS * SEQ_LEN
        return done


def throughput(path: Path, batches: int, repeats: int) -> dict:
    """Steady packing and memmap rates, interleaved, and the stream's start-up."""
    started = time.perf_counter()
    stream = packing_stream(path)
    stream.next_batch()
    startup = time.perf_counter() - started
    reader = MemmapReader(path)
    counted = {"candidate": [], "baseline": []}
    per_call = ROWS * SEQ_LEN * batches

    def candidate() -> None:
        counted["candidate"].append(packed_tokens(stream, batches))

    def baseline() -> None:
        counted["baseline"].append(reader.read(per_call))

    cand, base = interleaved_times(candidate, baseline, repeats=repeats)
    cand_rate = median([n / t for n, t in zip(counted["candidate"][1:], cand, strict=True)])
    base_rate = median([n / t for n, t in zip(counted["baseline"][1:], base, strict=True)])
    return {"tokens_per_s": cand_rate, "memmap_tokens_per_s": base_rate,
            "throughput_ratio": cand_rate / base_rate, "startup_s": startup}


def batch_parts(path: Path, blocks: int, per_block: int) -> dict:
    """Microseconds per batch of each part of ``RowStream.next_batch`` over ``path``
    (the median over ``blocks`` blocks of ``per_block`` batches), and of the compiled
    work alone on the same plans (``kernels_us``: the C fill, screen and count with
    outputs allocated once; docs/design/bench.md#benchloaderpy)."""
    from exactstep.rows.batch import Batch, Segment

    stream = packing_stream(path)
    for _ in range(20):
        stream.next_batch()
    tok = ByteTokenizer()
    fill = stream.examples.kernel_maps().causal_fill(SEQ_LEN, tok.pad_id, False, True,
                                                     (tok.vocab_size, True, True))
    names = ("plan", "fill", "batch")
    times = {name: [] for name in names}
    clock = time.perf_counter_ns
    for _ in range(blocks):
        spent = dict.fromkeys(names, 0)
        plans = []
        for _ in range(per_block):
            t0 = clock()
            plan = stream.planner.next_plan(ROWS)
            t1 = clock()
            tensors, bad, clean, _, segments = fill(plan.pieces, plan.row_starts, Segment)
            t2 = clock()
            Batch(*tensors, segments=segments)
            t3 = clock()
            if bad != -1 or not clean:
                raise RuntimeError("a benchmark batch was not clean; the parts measured "
                                   "another path than the stream's")
            del tensors, segments  # dropped before the next, as the rates' loops drop theirs
            for name, ns in zip(names, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                spent[name] += ns
            plans.append(plan)
        for name in names:
            times[name].append(spent[name] / per_block / 1e3)
    parts = {f"{name}_us": median(v) for name, v in times.items()}
    outputs = tuple(torch.empty(ROWS, SEQ_LEN, dtype=d)
                    for d in (torch.int64, torch.int64, torch.int64, torch.int32))
    kernel_s, tokens = compiled_work(plans, fill, outputs)
    return {**parts, "parts_us": sum(parts.values()), "kernels_us": kernel_s * 1e6,
            "kernels_tokens_per_s": tokens / kernel_s}


def compiled_work(plans: list, fill, outputs) -> tuple[float, float]:
    """Seconds per batch of the C fill, screen and count alone over ``plans`` (the
    call of ``fill``, a ``kernels.CausalFill``, made with its arguments built
    beforehand, into the same ``outputs``, so they stay in cache: a floor), the best
    of five passes; and the real tokens per batch."""
    from exactstep.rows import kernels

    call, frame = kernels.compiled_library().fill_screened, kernels.address(fill.frame)
    pointers = tuple(t.data_ptr() for t in outputs)
    calls = [(frame, kernels.address(p.pieces), p.pieces.shape[1], kernels.address(p.row_starts),
              len(p), *pointers) for p in plans]
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for args in calls:
            call(*args)
        best = min(best, (time.perf_counter() - started) / len(calls))
    answer = call(*calls[-1])
    if answer < 0 or not answer & 1:
        raise RuntimeError("the compiled work did not build a clean batch; the floor "
                           "measured nothing")
    tokens = sum(int(p.pieces[kernels.LENGTH].sum()) for p in plans) / len(plans)
    return best, tokens


RSS_SCRIPT = r"""
import json, resource, sys
from pathlib import Path
from exactstep.config import load_config
from exactstep.run.runner import train
source, out, windows = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = load_config(None, [f"data.source={source}", f"train.steps={windows}", "train.eval_every=0",
    "train.eval_tokens=256", "train.device=cpu", "train.threads=1", "train.progress=false",
    "checkpoint.every=0", "batch.seq_len=256", "batch.rows=8", "model.d_model=32",
    "model.n_layers=1", "model.n_heads=2", "model.d_ff=64"])
train(cfg, Path(out), progress=False)
print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def peak_rss_mb(source: Path, out: Path) -> float:
    """Peak RSS (MB) of a fresh process training ``WINDOWS`` windows from ``source``."""
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(source), str(out), str(WINDOWS)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["maxrss_kb"] / 1024


def step_times(source: Path, windows: int, blocks: int) -> dict:
    """Seconds per window with the data path free, in line, on a thread and in a
    loader process. Each source has its own stream of the same corpus and seed and
    takes ``windows`` batches per block, so in every block all four train on the
    same batches (the step's cost depends on how the rows were packed; the free
    source replays batches built beforehand, block for block)."""
    from exactstep.config import load_config
    from exactstep.rows.background import BackgroundStream
    from exactstep.rows.loader_process import LoaderProcess
    from exactstep.run.runner import build_run

    overrides = [f"data.source={source}", "train.steps=100000", "train.device=cpu",
                 "train.progress=false", "batch.seq_len=256", "batch.rows=8",
                 "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64"]
    with tempfile.TemporaryDirectory(prefix="exactstep-steps-") as tmp:
        run_ = build_run(load_config(None, overrides), Path(tmp) / "run")
        stream = run_.stream

        def fresh() -> RowStream:
            return RowStream(run_.data.train, run_.cfg.batch, pad_id=run_.tokenizer.pad_id,
                             seed=run_.cfg.seed, vocab_size=run_.tokenizer.vocab_size,
                             compiler=run_.parts.compiler)

        ahead, child, built = BackgroundStream(fresh(), 2), LoaderProcess(fresh(), 2), fresh()
        free = [built.next_batch() for _ in range((blocks + 1) * windows)]
        neighbour = Neighbour()
        sources = {"free": lambda i: free[i], "inline": lambda i: stream.next_batch(),
                   "background": lambda i: ahead.next_batch(),
                   "process": lambda i: child.next_batch(), "neighbour": lambda i: free[i]}
        seconds = {name: [] for name in sources}
        waits = {name: [] for name in sources}
        cpu = {name: [] for name in sources}
        window = 0
        try:
            for block in range(blocks + 1):  # block 0 warms up (and starts the child)
                order = list(sources) if block % 2 == 0 else list(sources)[::-1]
                for name in order:
                    waited = 0.0
                    if name == "neighbour":
                        neighbour.busy(True)
                    t0, c0 = time.perf_counter(), time.process_time()
                    for i in range(windows):
                        t1 = time.perf_counter()
                        batch = sources[name](block * windows + i)
                        waited += time.perf_counter() - t1
                        run_.engine.run_window([batch], window)
                        window += 1
                    neighbour.busy(False)
                    if block:
                        seconds[name].append((time.perf_counter() - t0) / windows)
                        cpu[name].append((time.process_time() - c0) / windows)
                        waits[name].append(waited / windows)
        finally:
            ahead.close()
            child.close()
            neighbour.close()
    per = {name: median(v) for name, v in seconds.items()}
    return {"step_s_free": per["free"], "step_s_inline": per["inline"],
            "step_s_background": per["background"], "step_s_process": per["process"],
            **{f"{name}_step_ratio": block_ratio(seconds[name], seconds["free"])
               for name in ("inline", "background", "process", "neighbour")},
            **{f"{name}_step_ratio_quartiles": block_quartiles(seconds[name], seconds["free"])
               for name in ("inline", "background", "process", "neighbour")},
            "step_blocks": blocks,
            **{f"next_s_{name}": median(v) for name, v in waits.items()},
            **{f"cpu_s_{name}": median(v) for name, v in cpu.items()},
            "process_cpu_ratio": median(cpu["process"]) / median(cpu["free"]),
            "torch_threads": torch.get_num_threads()}


class Neighbour:
    """The control for a loader process: a spawned process that only burns CPU, on
    while ``busy(True)``, blocked (no CPU) otherwise. Any second process running
    beside the trainer costs it what this one does (shared cores, caches, memory
    bandwidth); the loader process cannot be cheaper."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.go, self.stop = ctx.Event(), ctx.Event()
        self.process = ctx.Process(target=burn, args=(self.go, self.stop), daemon=True)
        self.process.start()

    def busy(self, on: bool) -> None:
        (self.go.set if on else self.go.clear)()

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        self.process.join(timeout=5.0)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


def burn(go, stop) -> None:
    """``Neighbour``'s process: count while ``go`` is set, wait for it otherwise."""
    count = 0
    while not stop.is_set():
        go.wait()
        while go.is_set():
            for _ in range(20000):
                count += 1


def block_ratio(candidate: list[float], free: list[float]) -> float:
    """The median over blocks of each block's ratio to the free path of the same block
    (the machine's speed drifts between blocks; within one it is nearly the same)."""
    return median([c / f for c, f in zip(candidate, free, strict=True)])


def block_quartiles(candidate: list[float], free: list[float]) -> list[float]:
    """First and third quartiles of the per-block ratios (``block_ratio``'s spread)."""
    ratios = np.array([c / f for c, f in zip(candidate, free, strict=True)])
    return [float(np.quantile(ratios, 0.25)), float(np.quantile(ratios, 0.75))]


def run(quick: bool) -> dict:
    sizes = QUICK_SIZES_MB if quick else SIZES_MB
    batches = 20 if quick else 60
    with tempfile.TemporaryDirectory(prefix="exactstep-loader-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        small, large = (write_synthetic(root / f"c{mb}", mb, seed=mb) for mb in sizes)
        write_s = time.perf_counter() - started
        rates = throughput(large, batches, repeats=3 if quick else 5)
        parts = batch_parts(large, blocks=5 if quick else 15, per_block=100)
        parts["kernels_ratio"] = parts["kernels_tokens_per_s"] / rates["memmap_tokens_per_s"]
        steps = step_times(large, windows=10, blocks=4 if quick else 24)
        rss_small = peak_rss_mb(small, root / "run-small")
        rss_large = peak_rss_mb(large, root / "run-large")
        sizes_real = [open_prepared(p, verify=False).splits["train"].info["tokens"] * 2 / 2**20
                      for p in (small, large)]
    return {
        "corpus_mb": [round(s, 1) for s in sizes_real],
        "seq_len": SEQ_LEN, "rows": ROWS, "buffer": BUFFER, "batches": batches,
        **rates,
        **parts,
        "windows": WINDOWS,
        "rss_small_mb": rss_small,
        "rss_large_mb": rss_large,
        "rss_ratio": rss_large / rss_small,
        "write_s": write_s,
        **steps,
    }
