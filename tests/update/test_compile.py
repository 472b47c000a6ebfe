"""``train.compile = true`` (``model.compiled``): compiled windows match eager within a
stated tolerance, a compiled run resumes bitwise (S5), checkpoints move between compiled
and eager runs as declared non-bitwise continuations (S9, S4), an HF model compiles, and
a model exactstep does not compile is refused with one ``ConfigError``.

What was compiled is checked on the model itself, not on the manifest (which records
the configuration): every block of the built-in decoder (and encoder) a run builds with
``train.compile = true`` is compiled, and during the compiled run no block call ran as
eager Python (a forward pre-hook counts the calls that run outside a compiled graph).

Independent expectations: the eager run of the same configuration (the compiled kernels
round differently, so within ``TOLERANCE``), the straight compiled run (bitwise), and
the state-dict names of the eager model. Negative controls: a run with a 5% larger
learning rate fails the tolerance check, the eager run fails the bitwise one, and
``compile_model`` planted to compile nothing or only the first block fails the block
checks. Compiling is the cost here (tens of seconds on two cores, once per module;
inductor's cache makes later sessions faster), so the builtin runs are trained once per
module.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import process_server
import pytest
import torch
import torch.nn.functional as F
from model.hf_support import hf_model
from model.model_batches import fill_rows, packed_batch
from text_corpus import write_corpus

import exactstep.run.runner as runner
from exactstep.config import load_config
from exactstep.errors import ConfigError
from exactstep.model.compiled import compile_model, compile_options
from exactstep.run.continuation import resume
from exactstep.run.runner import train
from exactstep.state.compare import state_differences
from exactstep.state.safetensors_format import load_checkpoint
from exactstep.state.store import latest_checkpoint

#: fp32, relative to the largest magnitude of each compared quantity: H5's documented
#: tolerance (docs/design/model.md). Compiled kernels only reorder and fuse fp32 sums
#: (~1e-7 relative per window); measured on this configuration: losses agree to ~1e-7,
#: final weights to ~1.2e-6 after four windows. Where fp32 itself cannot promise it (a
#: LoRA step magnified by AdamW), test_compiled_lora derives a larger one from float64.
TOLERANCE = 1e-5

SETTINGS = ["train.device=cpu", "train.threads=1", "batch.seq_len=64", "batch.rows=2",
            "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=128",
            "data.val_fraction=0.2", "train.steps=4", "update.accum=2", "checkpoint.every=2",
            "checkpoint.keep=5", "train.progress=false", "train.eval_tokens=256"]
RUNS = {"eager": [], "compiled": ["train.compile=true"], "lr": ["update.lr=6.3e-3"]}


# ------------------------------------------------------------------ what was compiled


def compile_nothing(model: torch.nn.Module, *, family: str) -> list[torch.nn.Module]:
    """PLANTED BUG: ``compile_model`` that compiles nothing."""
    return []


def compile_first_block(model: torch.nn.Module, *, family: str) -> list[torch.nn.Module]:
    """PLANTED BUG: ``compile_model`` that compiles only the decoder's first block."""
    model.layers[0].compile(**compile_options())
    return [model.layers[0]]


def train_counting(cfg, out_dir: Path, *, planted: Callable | None = None) -> list[int]:
    """``train(cfg, out_dir)``, counting per block of the model the run built how many
    of its calls ran as eager Python: a forward pre-hook counts a call unless
    ``torch.compiler.is_compiling()``. In a compiled block the hook is traced into the
    graph, where that branch is dead, so a compiled call never counts; a block left
    eager (or one that fell back to eager) counts every call. ``planted`` replaces
    the runner's ``compile_model``."""
    calls: list[int] = []
    build = runner.build_run

    def counting(*args, **kwargs):
        run = build(*args, **kwargs)
        calls.extend([0] * len(run.model.layers))
        for i, block in enumerate(run.model.layers):
            def pre(module, args, i=i):
                if not torch.compiler.is_compiling():
                    calls[i] += 1
            block.register_forward_pre_hook(pre)
        return run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "build_run", counting)
        if planted is not None:
            mp.setattr(runner, "compile_model", planted)
        train(cfg, out_dir, progress=False)
    return calls


def eager_blocks(calls: list[int]) -> list[str]:
    """The blocks of a ``train.compile = true`` run that ran eagerly (all must be
    compiled), or a model without SETTINGS' two blocks."""
    out = [f"block {i} ran eagerly {n} times" for i, n in enumerate(calls) if n]
    return out if len(calls) == 2 else [*out, f"{len(calls)} blocks, not 2"]


def built_model(out_dir: Path, overrides: list[str], *, planted: Callable | None = None
                ) -> torch.nn.Module:
    """The model ``train`` builds (``build_run``, which compiles it) for SETTINGS with
    three blocks and ``overrides``, the run stopped before its first window (compiling
    is lazy: nothing is traced here). ``planted`` replaces the runner's
    ``compile_model``."""
    corpus = out_dir.parent / "corpus.jsonl"
    write_corpus(corpus)
    built: list[torch.nn.Module] = []

    def stop(run, started, progress):
        built.append(run.model)
        return {}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "train_new", stop)
        if planted is not None:
            mp.setattr(runner, "compile_model", planted)
        train(load_config(None, [*SETTINGS, f"data.source={corpus}", "model.n_layers=3",
                                 *overrides]), out_dir, progress=False)
    (model,) = built
    return model


def uncompiled_blocks(model: torch.nn.Module) -> list[int]:
    """The blocks of the built-in stack whose calls would not go through a compiled
    forward (``nn.Module.compile`` sets ``_compiled_call_impl``)."""
    return [i for i, block in enumerate(model.layers) if block._compiled_call_impl is None]


@pytest.mark.parametrize("family", ["causal", "mlm"])
def test_train_compile_compiles_every_block_of_the_builtin_stack(tmp_path, family):
    """``train.compile = true`` on the built-in decoder (``causal``) and encoder
    (``mlm``): every one of the three blocks of the model the run trains is compiled;
    with ``train.compile = false`` none is. Negative controls: ``compile_model``
    planted to compile nothing, or only the first block, fails the same check."""
    on = [f"objective.family={family}", "train.compile=true"]
    model = built_model(tmp_path / "compiled", on)
    assert len(model.layers) == 3 and uncompiled_blocks(model) == []
    assert uncompiled_blocks(built_model(tmp_path / "eager", on[:1])) == [0, 1, 2]
    assert uncompiled_blocks(built_model(tmp_path / "nothing", on,
                                         planted=compile_nothing)) == [0, 1, 2]
    assert uncompiled_blocks(built_model(tmp_path / "first", on,
                                         planted=compile_first_block)) == [1, 2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The eager, compiled and larger-learning-rate runs, trained once for the module,
    with each run's eager block calls (``train_counting``) under ``"eager_calls"``."""
    root = tmp_path_factory.mktemp("compile")
    corpus = root / "corpus.jsonl"
    write_corpus(corpus)
    out = {"root": root, "corpus": corpus, "eager_calls": {}}
    for name, extra in RUNS.items():
        out[name] = root / name
        out["eager_calls"][name] = train_counting(
            load_config(None, [*SETTINGS, f"data.source={corpus}", *extra]), out[name])
    return out


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))[0]


def relative(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """max |a - b| over max |b| (fp64)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def within_tolerance(run: Path, reference: Path) -> list[str]:
    """What differs beyond ``TOLERANCE``: each window's loss and gradient norm, each
    final tensor."""
    out = []
    windows = [[r for r in ledger(d) if "window" in r] for d in (run, reference)]
    for a, b in zip(*windows, strict=True):
        for key in ("loss", "grad_norm"):
            if relative(a[key], b[key]) > TOLERANCE:
                out.append(f"window {b['window']} {key}")
    ours, theirs = final_model(run), final_model(reference)
    assert sorted(ours) == sorted(theirs)
    out += [name for name in theirs if relative(ours[name], theirs[name]) > TOLERANCE]
    return out


@pytest.mark.slow
def test_compiled_windows_match_eager_within_tolerance(runs):
    assert len(ledger(runs["compiled"])) == 4
    assert within_tolerance(runs["compiled"], runs["eager"]) == []
    # what ran was compiled: no call of any block ran eagerly, in the windows or the
    # evaluations, while in the eager run every block did (the hooks see the calls)
    assert eager_blocks(runs["eager_calls"]["compiled"]) == []
    assert all(n > 0 for n in runs["eager_calls"]["eager"])
    # the manifest records it as the numerics environment, not as configuration (S9)
    manifest = json.loads((runs["compiled"] / "manifest.json").read_text())["manifest"]
    assert manifest["environment"]["compile"] is True
    assert "compile" not in manifest["config"]["train"]
    eager = json.loads((runs["eager"] / "manifest.json").read_text())["manifest"]
    assert eager["environment"]["compile"] is False
    # negative control: a 5% larger learning rate is caught by the same check
    assert within_tolerance(runs["lr"], runs["eager"])


@pytest.mark.slow
@pytest.mark.parametrize("planted, eager", [(compile_nothing, [0, 1]),
                                            (compile_first_block, [1])])
def test_a_run_that_compiles_too_little_is_caught(runs, planted, eager):
    """Negative controls of the runtime block check: ``train.compile = true`` with
    ``compile_model`` planted to compile nothing, or only the first block. Each run
    stays within ``TOLERANCE`` of eager and its manifest says ``compile = true`` (what
    the checks above passed on before), but blocks ran eagerly."""
    cfg = load_config(None, [*SETTINGS, f"data.source={runs['corpus']}",
                             "train.compile=true"])
    out = runs["root"] / planted.__name__
    calls = train_counting(cfg, out, planted=planted)
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    assert manifest["environment"]["compile"] is True
    found = eager_blocks(calls)
    assert [int(line.split()[1]) for line in found] == eager, found


@pytest.mark.slow
def test_compiled_run_resumed_in_a_new_process_is_bitwise_the_straight_run_s5(runs):
    """A copy of the compiled run resumed from its window-2 checkpoint by ``exactstep
    resume`` (a new process, which compiles again and restores ``train.compile``
    from the checkpoint's record): final state, ledger and manifest bitwise equal."""
    straight, copy = runs["compiled"], runs["root"] / "compiled_resumed"
    shutil.copytree(straight, copy)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = process_server.run(
        [sys.executable, "-m", "exactstep", "resume", str(copy), "--no-progress",
         "--from", str(copy / "checkpoints" / "window-00000002")],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "non-bitwise" not in done.stderr
    state = load_checkpoint(latest_checkpoint(straight / "checkpoints"))
    again = load_checkpoint(latest_checkpoint(copy / "checkpoints"))
    assert state_differences({"model": state[0], **state[1]},
                             {"model": again[0], **again[1]}) == []
    for file in ("ledger.jsonl", "manifest.json"):
        assert (straight / file).read_bytes() == (copy / file).read_bytes(), file
    # negative control: the bitwise comparison tells the eager run from the compiled one
    eager = load_checkpoint(latest_checkpoint(runs["eager"] / "checkpoints"))
    assert any(d.startswith("model.") for d in state_differences(
        {"model": state[0], **state[1]}, {"model": eager[0], **eager[1]}))


@pytest.mark.slow
@pytest.mark.parametrize("origin, switch", [("eager", "true"), ("compiled", "false")])
def test_a_resume_that_switches_compile_is_a_declared_continuation_s9(runs, origin, switch):
    """Checkpoints hold the eager names (no ``_orig_mod.``), so an eager checkpoint
    resumes compiled and a compiled one eager: one CONTINUATION line naming ``compile``,
    the run's manifest kept, the end within ``TOLERANCE`` of the straight run."""
    assert sorted(final_model(runs["compiled"])) == sorted(final_model(runs["eager"]))
    assert not any("_orig_mod" in name for name in final_model(runs["compiled"]))
    copy = runs["root"] / f"{origin}_switched"
    shutil.copytree(runs[origin], copy)
    resume(copy, from_checkpoint=copy / "checkpoints" / "window-00000002",
           overrides=[f"train.compile={switch}"], progress=False)
    events = [r for r in ledger(copy) if r.get("event") == "CONTINUATION"]
    change = "False -> True" if switch == "true" else "True -> False"
    assert [e["differs"] for e in events] == [[f"compile {change}"]]
    assert events[0]["next_window"] == 2 and events[0]["bitwise"] is False
    assert (copy / "manifest.json").read_bytes() == (runs[origin] / "manifest.json").read_bytes()
    windows = [r for r in ledger(copy) if "window" in r]
    assert [r["window"] for r in windows] == [0, 1, 2, 3]
    assert within_tolerance(copy, runs[origin]) == []


@pytest.mark.slow
def test_an_hf_llama_compiles_and_matches_eager_within_tolerance():
    """Its decoder stack compiled in place: hidden states and every gradient of one
    packed batch within ``TOLERANCE`` of the eager model, the same state-dict names.
    Negative control: a model of another seed fails the same check."""
    vocab = 300
    batch = packed_batch(fill_rows([[20, 30], [40]], vocab), 64)

    def step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.train()
        hidden = model(batch)  # [B, T, H]
        loss = F.cross_entropy(model.logits(hidden).flatten(0, 1), batch.labels.flatten())
        loss.backward()
        return hidden.detach(), {n: p.grad for n, p in model.named_parameters()}

    eager, compiled, other = (hf_model("llama", vocab, seed=s) for s in (0, 0, 1))
    names = sorted(eager.state_dict())
    assert compile_model(compiled, family="causal") == [compiled.decoder]
    assert sorted(compiled.state_dict()) == names

    def far(a, b) -> list[str]:
        (ha, ga), (hb, gb) = a, b
        return ([] if relative(ha, hb) <= TOLERANCE else ["hidden"]) + [
            n for n in gb if relative(ga[n], gb[n]) > TOLERANCE]

    reference = step(eager)
    assert far(step(compiled), reference) == []
    assert far(step(other), reference)  # negative control


def test_compile_of_a_model_exactstep_does_not_compile_is_one_config_error(tmp_path):
    """The permutation LM's two-stream decoder: refused before anything is written."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    cfg = load_config(None, [*SETTINGS, f"data.source={corpus}", "train.compile=true",
                             "objective.family=permutation"])
    with pytest.raises(ConfigError, match="train.compile") as caught:
        train(cfg, tmp_path / "run", progress=False)
    assert "objective.family = 'permutation'" in str(caught.value)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="train.compile must be true or false"):
        load_config(None, ["train.compile=sometimes"])
