"""bf16 with a Hugging Face model, and ``model.dtype`` for bf16 checkpoints (U2, L1, H1, S1).

* U2 with an HF Llama on the CPU: under ``numerics.precision = "bf16"`` the
  decoder's linear layers compute in bf16 (a forward hook sees bf16 outputs; under
  ``fp32`` the same hook sees fp32: the negative control), the head's operands are
  rounded to bf16 and the cross entropy runs on fp32 logits (L1); the window's loss
  stays within ``LOSS_RTOL`` of the fp32 window's from the same parameters and rows,
  yet differs from it (bf16 was in effect); parameters, gradients' owners and AdamW's
  moments stay fp32 (master weights).
* ``model.dtype``: a checkpoint saved in bf16 loads to fp32 parameters bitwise equal
  to its bf16 values upcast, and trains; the manifest's ``model`` section records the
  stored dtype (``bfloat16``; a float32-saved checkpoint records ``float32``: the
  negative control) and its config section ``model.dtype``; ``bfloat16`` parameters
  are refused in one line. Derivation: docs/design/model.md#model-dtype.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_support import hf_config, hf_model  # noqa: E402
from model_batches import fill_rows, packed_batch  # noqa: E402
from run_support import TINY, set_args  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from text_corpus import write_corpus  # noqa: E402
from torch import nn  # noqa: E402

import exactstep.objective.cross_entropy as cross_entropy  # noqa: E402
from exactstep.cli import main  # noqa: E402
from exactstep.config import load_config  # noqa: E402
from exactstep.errors import ConfigError  # noqa: E402
from exactstep.model.config import ModelConfig  # noqa: E402
from exactstep.model.decoder import build_model  # noqa: E402
from exactstep.objective.config import ObjectiveConfig  # noqa: E402
from exactstep.update.config import NumericsConfig, UpdateConfig  # noqa: E402
from exactstep.update.disposition import Outcome  # noqa: E402
from exactstep.update.groups import build_optimizer  # noqa: E402
from exactstep.update.precision import Precision  # noqa: E402
from exactstep.update.schedule import build_schedule  # noqa: E402
from exactstep.update.window import UpdateEngine  # noqa: E402

VOCAB = 64
PAD = 0
SEQ_LEN = 16
ROWS = [[5, 9], [12, 3], [16], [2, 7, 6]]  # document lengths per row
# Weights drawn with std 0.5 (not HF's 0.02) so the logits spread over several nats
# and the loss depends on every layer: at 0.02 every loss is ~log V whatever the
# precision and the comparison would test nothing.
INIT = {"initializer_range": 0.5}
# bf16 keeps 8 significant bits: each rounded operand is off by at most 2^-8 (3.9e-3)
# relative. The loss is a mean over rows of errors of mixed sign, so its relative
# error stays near that of one operand; 2e-2 is five such roundings. Measured on this
# model: 1.5e-4 (docs/design/model.md#model-dtype).
LOSS_RTOL = 2e-2


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def engine_for(model: nn.Module, precision: str) -> UpdateEngine:
    cfg = UpdateConfig(schedule="constant", warmup=0, lr=1e-3)
    optimizer, _ = build_optimizer(model, cfg)
    return UpdateEngine(model, optimizer, build_schedule(cfg, 10),
                        Precision(NumericsConfig(precision=precision), "cpu"), cfg,
                        ObjectiveConfig(chunk_rows=8), device="cpu", pad_id=PAD)


def window_batches(count: int = 2):
    return [packed_batch(fill_rows(ROWS, VOCAB, seed=s), SEQ_LEN) for s in range(count)]


class Observed:
    """Dtypes seen in one window: every decoder ``nn.Linear`` output, the head
    matmul's operand dtype and the logits the cross entropy reads (L1)."""

    def __init__(self, engine: UpdateEngine, monkeypatch) -> None:
        self.linear: set[torch.dtype] = set()
        self.head_operands: set[torch.dtype] = set()
        self.ce_logits: set[torch.dtype] = set()
        for module in engine.model.decoder.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda m, i, out: self.linear.add(out.dtype))
        head_logits, chunk_losses = cross_entropy.head_logits, cross_entropy.chunk_losses

        def spied_head(h, weight, dtype):
            self.head_operands.add(dtype)
            return head_logits(h, weight, dtype)

        def spied_losses(z, *args):
            self.ce_logits.add(z.dtype)
            return chunk_losses(z, *args)

        monkeypatch.setattr(cross_entropy, "head_logits", spied_head)
        monkeypatch.setattr(cross_entropy, "chunk_losses", spied_losses)


def one_window(precision: str, monkeypatch) -> tuple[UpdateEngine, Observed, float]:
    engine = engine_for(hf_model("llama", VOCAB, seed=1, **INIT), precision)
    seen = Observed(engine, monkeypatch)
    disposition = engine.run_window(window_batches(), 0)
    assert disposition.outcome is Outcome.COMMITTED
    return engine, seen, disposition.loss


def test_bf16_window_is_within_tolerance_of_fp32_u2_l1(monkeypatch):
    _, _, fp32_loss = one_window("fp32", monkeypatch)
    monkeypatch.undo()
    _, _, bf16_loss = one_window("bf16", monkeypatch)
    assert fp32_loss > 2 * math.log(VOCAB) / 3  # a real loss, not ~0
    assert abs(bf16_loss - fp32_loss) <= LOSS_RTOL * fp32_loss
    assert bf16_loss != fp32_loss  # bf16 was in effect


def test_bf16_autocast_reaches_the_hf_forward_and_the_head_ce_in_fp32_u2_l1(monkeypatch):
    _, seen, _ = one_window("bf16", monkeypatch)
    assert seen.linear == {torch.bfloat16}  # the HF decoder's matmuls ran in bf16
    assert seen.head_operands == {torch.bfloat16}  # the head's operands rounded to bf16
    assert seen.ce_logits == {torch.float32}  # the cross entropy itself in fp32 (L1)


def test_fp32_hooks_see_fp32_negative_control_u2(monkeypatch):
    _, seen, _ = one_window("fp32", monkeypatch)
    assert seen.linear == seen.head_operands == seen.ce_logits == {torch.float32}


def test_bf16_keeps_fp32_master_weights_and_optimizer_state_u2(monkeypatch):
    engine, _, _ = one_window("bf16", monkeypatch)
    assert engine.run_window(window_batches(), 1).outcome is Outcome.COMMITTED
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    moments = [v for state in engine.optimizer.state.values() for k, v in state.items()
               if k.startswith("exp_avg")]
    assert len(moments) == 2 * len(engine.parameters)
    assert all(m.dtype == torch.float32 for m in moments)


# ---------------------------------------------------------------------------- model.dtype


def saved_llama(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A tiny Llama written by ``save_pretrained`` in ``dtype``; returns the tensors
    as stored (read back with ``safetensors``, not through exactstep)."""
    table = hf_config("llama", vocab_size=259, tie_word_embeddings=False, **INIT)
    config = transformers.AutoConfig.for_model(table.pop("model_type"), **table)
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(directory)
    (weights,) = directory.glob("*.safetensors")
    return load_file(weights)


def test_a_bf16_checkpoint_loads_to_fp32_bitwise_upcast_and_trains_h1_u2(tmp_path):
    stored = saved_llama(tmp_path / "llama", torch.bfloat16)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    model = build_model(ModelConfig(source="hf", path=str(tmp_path / "llama")), 259, seed=0)
    loaded = model.hf.state_dict()
    for name, tensor in stored.items():
        assert loaded[name].dtype == torch.float32, name
        upcast = tensor.float()
        assert torch.equal(loaded[name].view(torch.int32), upcast.view(torch.int32)), name
    assert model.describe()["stored_dtype"] == "bfloat16"

    engine = engine_for(model, "bf16")
    before = [p.detach().clone() for p in engine.parameters]
    batches = [packed_batch(fill_rows(ROWS, 259, seed=s), SEQ_LEN) for s in range(2)]
    disposition = engine.run_window(batches, 0)
    assert disposition.outcome is Outcome.COMMITTED and math.isfinite(disposition.loss)
    assert all(p.dtype == torch.float32 for p in engine.parameters)
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.parameters, strict=True))


def test_a_float32_checkpoint_records_float32_negative_control_s1(tmp_path):
    stored = saved_llama(tmp_path / "llama", torch.float32)
    assert {t.dtype for t in stored.values()} == {torch.float32}
    model = build_model(ModelConfig(source="hf", path=str(tmp_path / "llama")), 259, seed=0)
    assert model.describe()["stored_dtype"] == "float32"


def test_random_init_records_no_stored_dtype_s1():
    assert hf_model("llama", VOCAB).describe()["stored_dtype"] is None


def test_bf16_parameters_are_refused_in_one_line_u2():
    with pytest.raises(ConfigError, match=r"model.dtype = 'bfloat16'.*numerics.precision") as err:
        ModelConfig(dtype="bfloat16")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(overrides=["model.dtype=float16"])
    assert load_config().model.dtype == "float32"


def test_the_manifest_records_both_dtypes_and_the_precision_s1(tmp_path):
    """A bf16 run of a bf16-saved checkpoint through the command line (U2, S1)."""
    saved_llama(tmp_path / "llama", torch.bfloat16)
    corpus, run = tmp_path / "docs.jsonl", tmp_path / "run"
    write_corpus(corpus)
    rows = {k: v for k, v in TINY.items() if not k.startswith("model.")}
    argv = ["train", "--out", str(run), "--no-progress",
            *set_args({**rows, "data.source": corpus, "model.source": "hf",
                       "model.path": tmp_path / "llama", "numerics.precision": "bf16",
                       "train.steps": 1, "update.warmup": 0, "train.eval_tokens": 32,
                       "train.threads": 1})]
    assert main(argv) == 0
    manifest = json.loads((run / "manifest.json").read_text())["manifest"]
    assert manifest["model"]["stored_dtype"] == "bfloat16"  # what the directory held
    assert manifest["config"]["model"]["dtype"] == "float32"  # what the run trains
    assert manifest["config"]["numerics"]["precision"] == "bf16"
    assert manifest["numerics"]["precision"] == "bf16"
