"""Export a run's checkpoint as a Hugging Face model directory, with the handoff check (H3).

``export_run`` writes what plain ``transformers`` loads (weights, tokenizer, configs
carrying the run's special ids, a passport) and publishes it only after the written
artifact reproduces the training model's logits and token ids; ``verify_export``
rechecks every digest the passport lists (S6). One export at a time per ``OUT`` (S8).
Design and derivations: docs/design/prepare-export.md#artifactsexportpy (H3, H2, S6, S8).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exactstep import __version__
from exactstep.config import load_config
from exactstep.data.tokenizer import build_tokenizer
from exactstep.errors import ConfigError, ExportError
from exactstep.families import family_name
from exactstep.model.decoder import build_model
from exactstep.model.lora import merged_state
from exactstep.objective.cross_entropy import rows_per_chunk
from exactstep.rows.batch import single_segment_batch
from exactstep.run.finished_run import open_finished_run, run_config
from exactstep.state.durable import (
    check_out,
    exclusive_lock,
    json_bytes,
    lock_beside,
    publish_directory,
    sha256_file,
    stale_temporaries,
    write_durably,
)
from exactstep.state.store import CHECKPOINT_MANIFEST

LOGIT_TOLERANCE = 1e-5
PASSPORT = "passport.json"
CHECK_DOCUMENTS = 8
CHECK_TOKENS = 256
#: Objective families whose models export as Hugging Face causal LMs (R8).
EXPORTABLE_FAMILIES = ("causal", "chat")

# The byte chat template (data/chat.py's exactstep-bytes-chat-v1) in Jinja, with
# generation markers around what an assistant turn owns (content, tool calls, EOS).
BYTES_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<|tool_call|>"
    "{{ c | tojson(separators=(',', ':'), sort_keys=True) }}\n{% endfor %}"
    "{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ExportReport:
    out: Path
    passport: dict[str, Any]

    def format(self) -> str:
        check = self.passport["check"]
        return (f"exported {self.passport['checkpoint']} to {self.out}\n"
                f"  handoff check: max |logit difference| {check['max_abs_logit_diff']:.3g} "
                f"over {check['tokens']} tokens of {check['documents']} held-out documents "
                f"(tolerance {check['tolerance']:.3g}); tokenizer ids identical")


# --------------------------------------------------------------------------- mapping


def llama_config(cfg: Any, vocab_size: int, special: dict[str, int], max_positions: int):
    """The ``LlamaConfig`` the built-in decoder's weights mean."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads, head_dim=cfg.d_model // cfg.n_heads,
        hidden_act="silu", max_position_embeddings=max_positions, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False, bos_token_id=special["bos"],
        eos_token_id=special["eos"], pad_token_id=special["pad"],
        architectures=["LlamaForCausalLM"], dtype="float32",
    )


def llama_state(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """The built-in decoder's state dict under ``LlamaForCausalLM``'s names."""
    d, f = cfg.d_model, cfg.d_ff
    out = {"model.embed_tokens.weight": state["embed.weight"],
           "model.norm.weight": state["final_norm.weight"]}
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state[src + "attn.qkv.weight"].split(d, dim=0)
        gate, up = state[src + "mlp.gate_up.weight"].split(f, dim=0)
        out.update({
            dst + "input_layernorm.weight": state[src + "attn_norm.weight"],
            dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": state[src + "attn.out.weight"],
            dst + "post_attention_layernorm.weight": state[src + "mlp_norm.weight"],
            dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": state[src + "mlp.down.weight"],
        })
    out["lm_head.weight"] = state["embed.weight"] if cfg.tie_embeddings else state["head.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def byte_tokenizer_hf(tokenizer: Any, chat_template: str | None = None):
    """The byte tokenizer as a ``PreTrainedTokenizerFast``: byte b -> id b, specials above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes
    byte_char = bytes_to_unicode()  # GPT-2's byte -> character table, as ByteLevel uses
    vocab = {byte_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    core.add_special_tokens(list(specials.values()))
    ids = [core.token_to_id(t) for t in specials.values()]
    if ids != [tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id]:
        raise ExportError(f"byte tokenizer special ids {ids} do not match the run's "
                          f"{[tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id]}")
    return PreTrainedTokenizerFast(tokenizer_object=core, chat_template=chat_template,
                                   model_max_length=1 << 30, **specials)


# The parts of a ``tokenizer.json`` that decide what ids a text gets, and what text ids
# decode to (``truncation`` and ``padding`` are call state, not the mapping).
TOKENIZER_PARTS = ("normalizer", "pre_tokenizer", "model", "added_tokens", "post_processor",
                   "decoder")
SPECIAL_ROLES = ("bos", "eos", "pad")


def special_ids_of(where: Any) -> dict[str, Any]:
    """``{"bos": ..., "eos": ..., "pad": ...}`` of a config, generation config or
    tokenizer (``*_token_id``; a one-element list counts as its element)."""
    out = {}
    for role in SPECIAL_ROLES:
        value = getattr(where, f"{role}_token_id", None)
        out[role] = value[0] if isinstance(value, list) and len(value) == 1 else value
    return out


def check_tokenizer(tmp: Path, written: Any, special: dict[str, int]) -> Any:
    """``AutoTokenizer.from_pretrained(tmp)`` must be the tokenizer written (H2, H3).

    Compares the backend pipelines part by part (``TOKENIZER_PARTS``) and the special
    ids with the run's. Returns the loaded tokenizer; raises ``ExportError`` naming
    the class transformers chose, the differing parts and what to do instead.
    """
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp)
    ours = json.loads(written.backend_tokenizer.to_str())
    theirs = json.loads(loaded.backend_tokenizer.to_str())
    parts = [part for part in TOKENIZER_PARTS if ours.get(part) != theirs.get(part)]
    if parts:
        model_type = _json(tmp / "config.json").get("model_type")
        declared = _json(tmp / "tokenizer_config.json").get("tokenizer_class")
        chosen = type(loaded).__name__
        why = "" if chosen == declared else (
            f" (for model_type {model_type!r} transformers chooses that class itself, whatever "
            f"tokenizer_config.json's tokenizer_class {declared!r} says)")
        sizes = "" if len(loaded) == len(written) else (
            f", with {len(loaded)} tokens instead of {len(written)}")
        raise ExportError(
            f"plain transformers loads the exported tokenizer as {chosen}{why}, and it differs "
            f"from the run's tokenizer in its {', '.join(parts)}{sizes}: it would tokenize text "
            f"differently from training; export a run whose tokenizer {chosen} reproduces (one "
            f"saved by {chosen} itself), or train with a model type whose tokenizer "
            "transformers loads as written (e.g. 'llama', or 'qwen3' for Qwen2's layout); "
            "nothing was published")
    got = special_ids_of(loaded)
    if got != special:
        raise ExportError(f"the exported tokenizer's special ids {got} differ from the run's "
                          f"{special}; nothing was published")
    return loaded


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


# --------------------------------------------------------------------------- export


def export_run(run_dir: Path, out: Path, *, from_checkpoint: Path | None = None,
               adapter: bool = False) -> ExportReport:
    """Export ``run_dir``'s checkpoint (``--from`` or the one a resume would choose) to ``out``.

    Raises ``ConfigError`` when ``out`` exists and is not empty or cannot be written,
    ``DirectoryInUse`` when another process exports into ``out``, ``ExportError`` when
    the handoff check fails (nothing is published then).

    ``out`` gets ``config.json``, ``model.safetensors``, the tokenizer files,
    ``generation_config.json`` and ``passport.json``, written under a temporary
    sibling and renamed into place only after the check passes (H3). ``.OUT.lock``
    beside ``out`` is held throughout; a killed export's temporary is removed. The run
    directory is only read (committed checkpoints), so a training run can be exported.
    ``adapter``: a LoRA run's PEFT adapter directory instead of the merged model (H4),
    for an HF base only (a built-in decoder's LoRA run exports merged).
    """
    out = Path(out)
    check_out(out)
    with exclusive_lock(lock_beside(out), f"--out {out}"):
        for leftover in stale_temporaries(out):  # a killed export's, never published (S8)
            shutil.rmtree(leftover, ignore_errors=True)
        return export_held(run_dir, out, from_checkpoint=from_checkpoint, adapter=adapter)


def export_held(run_dir: Path, out: Path, *, from_checkpoint: Path | None = None,
                adapter: bool = False) -> ExportReport:
    """``export_run`` with ``out`` held (``check_out`` again: another export may have
    published it before this one got the lock)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one summary line, not transformers' bars
    hf_logging.set_verbosity_error()
    run_dir, out = Path(run_dir), Path(out)
    check_out(out)
    _, cfg = run_config(run_dir)
    family = family_name(cfg)
    if family not in EXPORTABLE_FAMILIES:
        raise ConfigError(
            f"{run_dir} trained objective.family = {family!r}; exactstep export writes "
            f"Hugging Face causal LMs, from runs of the {' or '.join(EXPORTABLE_FAMILIES)} "
            "family"
        )
    if adapter and not cfg.model.lora.enabled:
        raise ConfigError(f"exactstep export --adapter writes LoRA adapters; {run_dir} trained "
                          "none (model.lora.r = 0)")
    if adapter and cfg.model.source == "builtin":
        raise ConfigError(f"exactstep export --adapter writes adapters for a Hugging Face base "
                          f"model; {run_dir} trained them on the built-in decoder, whose base "
                          "exists only inside the run: export it merged (without --adapter)")
    with open_finished_run(run_dir, from_checkpoint=from_checkpoint, device="cpu",
                           purpose="export") as run:
        return publish_export(run, out, CHECKPOINT_MANIFEST, adapter=adapter)


def publish_export(run: Any, out: Path, checkpoint_manifest: str, *,
                   adapter: bool = False) -> ExportReport:
    """Write, check (H3) and publish the export of an opened run (``FinishedRun``);
    ``adapter``: the PEFT adapter directory, checked by ``adapter_check`` (H4)."""
    cfg, manifest, tokenizer, data = run.cfg, run.manifest, run.parts.tokenizer, run.parts.data
    model = run.model
    model.eval()
    # The byte tokenizer's chat template is the built-in one, whatever the run trained
    # on, so an export of a text run can be fine-tuned on chat; an HF tokenizer keeps
    # its own template (or the run's data.chat_template).
    template = (getattr(tokenizer, "chat_template", None) if hasattr(tokenizer, "hf")
                else BYTES_CHAT_TEMPLATE)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        max_tokens = min(CHECK_TOKENS, cfg.batch.seq_len)
        if adapter:
            written = write_adapter(tmp, model, tokenizer, template)
            check_tokenizer(tmp, written, tokenizer.special_ids())
            figures = adapter_check(tmp, model, cfg, tokenizer, data.val, max_tokens=max_tokens)
        else:
            written = write_artifact(tmp, model, cfg, tokenizer, template)
            check_tokenizer(tmp, written, tokenizer.special_ids())
            figures = handoff_check(tmp, model, tokenizer, data.val, max_tokens=max_tokens)
        passport = {
            "format": "exactstep-export/1",
            "exactstep": __version__,
            "run_manifest_digest": manifest.digest,
            "checkpoint": run.checkpoint.name,
            "checkpoint_manifest_sha256": _sha256(run.checkpoint / checkpoint_manifest),
            "tokenizer_hash": tokenizer.fingerprint(),
            "special_ids": tokenizer.special_ids(),
            "template_hash": data.representation.get("template_hash"),
            "dtype": "float32",
            "architecture": architecture_of(model) if cfg.model.source == "hf"
                            else "LlamaForCausalLM",
            **({"adapters": "peft" if adapter else "merged",
                "base_weights_sha256": model.initial_weights_sha256}
               if getattr(model, "lora", None) is not None else {}),
            **({"teacher_targets": data.section["teacher"]} if "teacher" in data.section
               else {}),  # trained on a teacher's outputs (R10)
            "check": figures,
            "files": {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()},
        }
        write_durably(tmp / PASSPORT, json_bytes(passport))
        publish_directory(tmp, out)
    except OSError as exc:
        raise ExportError(f"writing the export to {out} failed ({exc.strerror or exc}); "
                          "nothing was published") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportReport(out, passport)


def write_artifact(tmp: Path, model: Any, cfg: Any, tokenizer: Any, template: str | None) -> Any:
    """``save_pretrained`` of the model (the built-in one mapped onto Llama, an HF one
    as it is), the tokenizer and the generation config; returns the tokenizer written.

    ``config.json`` and ``generation_config.json`` carry the run's BOS / EOS / PAD ids
    (an HF model's config keeps its architecture's defaults otherwise)."""
    from transformers import GenerationConfig

    special = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
    hf_model = (hf_model_of(model) if cfg.model.source == "hf"
                else llama_model(model, cfg, tokenizer, special))
    for role, token_id in special.items():
        setattr(hf_model.config, f"{role}_token_id", token_id)
    hf_model.generation_config = GenerationConfig(
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"])
    hf_model.save_pretrained(tmp, safe_serialization=True)
    hf_tokenizer = getattr(tokenizer, "hf", None)  # a Hugging Face tokenizer run (H2)
    if hf_tokenizer is None:
        hf_tokenizer = byte_tokenizer_hf(tokenizer, template)
    elif template is not None:
        hf_tokenizer.chat_template = template  # data.chat_template, when the run set one
    hf_tokenizer.save_pretrained(tmp)
    return hf_tokenizer


def write_adapter(tmp: Path, model: Any, tokenizer: Any, template: str | None) -> Any:
    """The PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
    and the tokenizer; returns the tokenizer written."""
    model.hf.save_pretrained(tmp, safe_serialization=True)
    hf_tokenizer = getattr(tokenizer, "hf", None)
    if hf_tokenizer is None:
        hf_tokenizer = byte_tokenizer_hf(tokenizer, template)
    elif template is not None:
        hf_tokenizer.chat_template = template
    hf_tokenizer.save_pretrained(tmp)
    return hf_tokenizer


def adapter_check(tmp: Path, model: Any, cfg: Any, tokenizer: Any, documents: Any, *,
                  max_tokens: int) -> dict[str, Any]:
    """The written adapters on the run's base reproduce the trained model's logits (H4).

    The base is built again without adapters (``model.path`` or ``model.hf_config`` and
    the run's seed) and must have the digest the run recorded; ``PeftModel.from_pretrained``
    loads the directory onto it. Raises ``ExportError`` otherwise.
    """
    import peft

    base_cfg = dataclasses.replace(cfg.model, lora=dataclasses.replace(cfg.model.lora, r=0))
    base = build_model(base_cfg, tokenizer.vocab_size, seed=cfg.seed)
    if base.initial_weights_sha256 != model.initial_weights_sha256:
        raise ExportError("the run's base model no longer has the recorded "
                          "model.lora.base_weights_sha256; the adapters cannot be checked on it; "
                          "nothing was published")
    loaded = peft.PeftModel.from_pretrained(base.hf, tmp).eval()
    worst, tokens, used = 0.0, 0, 0
    with torch.no_grad():
        for example in list(documents)[:CHECK_DOCUMENTS]:
            ids = torch.as_tensor(example.tokens[:max_tokens], dtype=torch.int64)[None]
            worst = max(worst, logit_differences(model, loaded, None, ids)[0])
            tokens, used = tokens + ids.shape[1], used + 1
    if used == 0:
        raise ExportError("the run has no held-out documents to check the export on")
    if not worst <= LOGIT_TOLERANCE:
        raise ExportError(f"the exported adapters on the base give logits that differ from the "
                          f"trained model's by {worst:.3g} (tolerance {LOGIT_TOLERANCE:g}); "
                          "nothing was published")
    return {"max_abs_logit_diff": worst, "tolerance": LOGIT_TOLERANCE, "documents": used,
            "tokens": tokens}


def hf_model_of(model: Any) -> Any:
    """An HF run's model as plain ``transformers`` holds it: with LoRA (H4), a copy with
    the adapters merged into the base (``merge_and_unload``; the run's model keeps
    them, so the handoff check compares the merged weights against it)."""
    if getattr(model, "lora", None) is None:
        return model.hf
    return copy.deepcopy(model.hf).merge_and_unload()


def architecture_of(model: Any) -> str:
    """The class name ``config.json`` records for an HF run's model (the base's, under
    LoRA: the export is merged)."""
    hf = model.hf.get_base_model() if getattr(model, "lora", None) is not None else model.hf
    return (hf.config.architectures or [type(hf).__name__])[0]


def llama_model(model: Any, cfg: Any, tokenizer: Any, special: dict[str, int]) -> Any:
    """The built-in decoder's weights in a ``LlamaForCausalLM`` (no copy of the init);
    with LoRA, the adapters merged into the base by peft (``merged_state``, H4)."""
    from transformers import LlamaForCausalLM

    hf_config = llama_config(cfg.model, tokenizer.vocab_size, special,
                             max_positions=max(cfg.batch.seq_len, 2048))
    with torch.device("meta"):
        hf_model = LlamaForCausalLM(hf_config)
    own = merged_state(model) if getattr(model, "lora", None) is not None else model.state_dict()
    state = llama_state({k: v.detach().cpu() for k, v in own.items()}, cfg.model)
    hf_model.load_state_dict(state, strict=True, assign=True)
    if cfg.model.tie_embeddings:
        hf_model.tie_weights()
    return hf_model


def logit_differences(model: Any, loaded: Any, eager: Any | None, ids: torch.Tensor
                      ) -> tuple[float, float]:
    """(max |loaded - trained|, max |loaded - eager|; 0 without ``eager``) of the logits of
    ``ids`` ``[1, T]``,
    compared ``rows_per_chunk`` positions at a time (L1, H3): at a large vocabulary a
    document's ``[T, V]`` logits are never held whole; transformers' own forward gives
    each chunk's logits (``logits_to_keep``), the decoder re-run per chunk."""
    hidden = model(single_segment_batch(ids))  # [1, T, H]
    T = ids.shape[1]
    step = rows_per_chunk(T, int(model.head_weight.shape[0])) or T
    worst = spread = 0.0
    for start in range(0, T, step):
        keep = {} if step >= T else {"logits_to_keep": torch.arange(start, min(start + step, T))}
        expected = model.logits(hidden[:, start : start + step])  # [1, n, V]
        got = loaded(input_ids=ids, **keep).logits.float()  # [1, n, V]
        worst = max(worst, float((got - expected).abs().max()))
        del expected
        if eager is not None:
            eager_got = eager(input_ids=ids, **keep).logits.float()  # [1, n, V]
            spread = max(spread, float((got - eager_got).abs().max()))
    return worst, spread


def handoff_check(tmp: Path, model: Any, tokenizer: Any, documents: Any, *,
                  max_tokens: int) -> dict[str, Any]:
    """Load the written artifact with plain ``transformers`` and compare (H3).

    For up to ``CHECK_DOCUMENTS`` held-out documents (each alone, at most
    ``max_tokens`` tokens: a row length the run trained on), the exported model's
    logits must equal the training model's within ``tolerance`` = max(
    ``LOGIT_TOLERANCE``, 2 x the largest difference between the artifact's own ``sdpa``
    and ``eager`` logits on the same rows), and the exported tokenizer must give the
    same ids for the document's text. Raises ``ExportError`` otherwise.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    eager = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp)
    special = tokenizer.special_ids()
    for name, where in (("config.json", loaded.config),
                        ("generation_config.json", loaded.generation_config)):
        if special_ids_of(where) != special:
            raise ExportError(f"the exported {name} names special ids {special_ids_of(where)}, "
                              f"not the run's {special}; nothing was published")
    worst, spread, tokens, used = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for example in list(documents)[:CHECK_DOCUMENTS]:
            ids = torch.as_tensor(example.tokens[:max_tokens], dtype=torch.int64)[None]
            diff, eager_diff = logit_differences(model, loaded, eager, ids)
            worst, spread = max(worst, diff), max(spread, eager_diff)
            special = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}
            text = tokenizer.decode([int(t) for t in example.tokens if int(t) not in special])
            got_ids = hf_tokenizer.encode(text, add_special_tokens=False)
            want_ids = tokenizer.encode(text)
            if got_ids != want_ids:
                at = next((j for j, (a, b) in enumerate(zip(got_ids, want_ids, strict=False))
                           if a != b), min(len(got_ids), len(want_ids)))
                raise ExportError(
                    f"the exported tokenizer ({type(hf_tokenizer).__name__}, as plain "
                    f"transformers loads it) encodes held-out document {used} differently from "
                    f"the run's tokenizer (from token {at}: {got_ids[at:at + 4]} instead of "
                    f"{want_ids[at:at + 4]}); nothing was published")
            tokens += ids.shape[1]
            used += 1
    if used == 0:
        raise ExportError("the run has no held-out documents to check the export on")
    tolerance = max(LOGIT_TOLERANCE, 2.0 * spread)
    if not worst <= tolerance:
        raise ExportError(f"the exported model's logits differ from the trained model's by "
                          f"{worst:.3g} (tolerance {tolerance:.3g}: {LOGIT_TOLERANCE:g}, or twice "
                          f"transformers' own sdpa/eager spread {spread:.3g}); nothing was "
                          "published")
    return {"max_abs_logit_diff": worst, "tolerance": tolerance,
            "base_tolerance": LOGIT_TOLERANCE, "transformers_sdpa_eager_spread": spread,
            "documents": used, "tokens": tokens}


def _sha256(path: Path) -> str:
    return sha256_file(path)


def read_passport(out: Path) -> dict[str, Any]:
    return json.loads((Path(out) / PASSPORT).read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class FileCheck:
    """One file of an export as ``verify_export`` found it."""

    name: str
    status: str  # "ok" | "missing" | "corrupted"
    sha256: str | None
    detail: str = ""


@dataclass(frozen=True)
class ExportVerifyReport:
    """Result of ``verify_export``: one ``FileCheck`` per file the passport lists, plus
    problems of the export as a whole (no or unreadable passport, unlisted files)."""

    path: Path
    files: tuple[FileCheck, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems and all(f.status == "ok" for f in self.files)

    def format(self, heading: str | None = None) -> str:
        """Lines for ``exactstep export verify`` (``heading`` replaces the first)."""
        lines = [heading or f"export {self.path} (digests from its {PASSPORT})"]
        for f in self.files:
            extra = f"  ({f.detail})" if f.detail else ""
            lines.append(f"  {f.status:<9} {f.name:<24} sha256 {f.sha256 or '-'}{extra}")
        lines += [f"  problem   {problem}" for problem in self.problems]
        lines.append("  verdict   " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


def is_export(path: Path) -> bool:
    """Whether ``path`` is an export directory (a passport, no checkpoint manifest)."""
    path = Path(path)
    return (path / PASSPORT).is_file() and not (path / CHECKPOINT_MANIFEST).exists()


def open_export(path: Path) -> tuple[Any, Any]:
    """An export (or Hugging Face model) directory as exactstep's adapter over the
    ``transformers`` model it holds, and its tokenizer: what the sampler draws from."""
    cfg = load_config(None, ["model.source=hf", f"model.path={path}", "data.tokenizer=hf",
                             f"data.tokenizer_path={path}", "model.hf_config={}"])
    tokenizer = build_tokenizer(cfg)
    return build_model(cfg.model, tokenizer.vocab_size, seed=0), tokenizer


def verify_export(out: Path) -> ExportVerifyReport:
    """Recompute the sha256 of every file ``passport.json`` lists (H3, S6).

    Never raises for a damaged export: a missing or unreadable passport, a missing
    or changed file, and a file the passport does not list are reported. Raises
    ``ConfigError`` only when ``out`` is not a directory.
    """
    out = Path(out)
    if not out.is_dir():
        what = "is not a directory" if out.exists() else "does not exist"
        raise ConfigError(f"export directory {out} {what}; name a directory written by "
                          "exactstep export")
    try:
        listed = read_passport(out)["files"]
        if not isinstance(listed, dict):
            raise TypeError
    except FileNotFoundError:
        return ExportVerifyReport(out, problems=(
            f"no {PASSPORT}: not an exactstep export (or its passport was lost)",))
    except (OSError, ValueError, KeyError, TypeError):
        return ExportVerifyReport(out, problems=(
            f"{PASSPORT} is unreadable or lists no files; the export cannot be verified",))
    checks = []
    for name, expected in sorted(listed.items()):
        file = out / name
        if not file.is_file():
            checks.append(FileCheck(name, "missing", None, "file does not exist"))
            continue
        found = _sha256(file)
        checks.append(FileCheck(name, "ok", found) if found == expected else
                      FileCheck(name, "corrupted", found, f"the passport says {expected}"))
    present = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    unlisted = tuple(f"file {name} is not listed in {PASSPORT}" for name in present
                     if name not in listed and name != PASSPORT)
    return ExportVerifyReport(out, tuple(checks), unlisted)
