"""Hugging Face causal LMs as exactstep models (H1, R1, R3, U6, L1).

``build_hf_model`` wraps an ``AutoModelForCausalLM`` as ``HFCausalLM``, which returns
final hidden states like the built-in decoder (never logits, never ``labels=``: R1,
L1) and sees packed rows only through per-document positions and a 4D block mask its
backend honours, or exactstep's per-document attention (``hf_attention``; R3). A
backend, head, window or vocabulary that cannot keep these contracts is refused when
the model is built, checked by a one-time probe.
Design and derivations: docs/design/model.md#modelhfpy (H1, H4, R1, R3, U6, L1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from exactstep.errors import ConfigError, ModelError
from exactstep.model import hf_attention
from exactstep.model.attention import (
    dense_visibility_mask,
    prepare_visibility,
    windowed_visibility,
)
from exactstep.model.config import LoRAConfig, ModelConfig
from exactstep.model.lora import (
    HEAD_TARGETED,
    adapted,
    adapter_state,
    adapting,
    import_peft,
    load_adapter_state,
    lora_config,
    lora_section,
)
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.state.rng import isolated_rng
from exactstep.update.window import head_for_loss

#: attention backends whose isolation of packed documents exactstep realises (R3):
#: HF's own two with a 4D block mask, and exactstep's per-document attention
ISOLATING_BACKENDS = ("sdpa", "eager", hf_attention.NAME)
#: ``model.attn_implementation = "auto"``: exactstep's per-document attention where the
#: model allows it, else HF's ``sdpa`` (``eager`` for a model without it), decided when
#: the model is built from its config alone (``resolve_backend``)
AUTO_BACKEND = "auto"
PER_DOCUMENT = f"{hf_attention.NAME!r} (per-document attention)"

#: config attributes that make the head more than ``hidden @ W.T``, with their names;
#: a value in the tuple is neutral (the feature is off)
HEAD_FEATURES: tuple[tuple[str, str, tuple], ...] = (
    ("final_logit_softcapping", "final logit soft-capping", (None, 0, 0.0)),
    ("logit_scale", "a final logit scale", (None, 1, 1.0)),
    ("logits_scaling", "a final logit scale", (None, 1, 1.0)),
)

#: safetensors' names of the floating-point dtypes, as torch spells them
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

#: RoPE types whose frequencies follow the longest position of the batch (R3)
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")

#: config fields sizing a sliding window (a query sees the last ``size`` positions)
SLIDING_FIELDS = ("sliding_window", "sliding_window_size", "attention_window_size",
                  "local_attention_window_len", "window_size", "attention_window")
#: config fields sizing chunked attention (a query sees its own ``size``-position chunk)
CHUNK_FIELDS = ("attention_chunk_size",)

#: attributes where a CausalLM keeps its decoder stack when ``base_model`` is not it
DECODER_ATTRIBUTES = ("model", "transformer", "language_model", "decoder", "gpt_neox")

PROBE_LENGTHS = (3, 4)  # two documents packed in one row, then one padding column
PROBE_WINDOW_LIMIT = 512  # the longest window the build-time probe crosses (and realises)
PROBE_TOLERANCE = 1e-4  # relative to the logits' magnitude; fp32 kernels agree to ~1e-6
LEAK_TOLERANCE = 1e-6  # the same kernels on the same row: an isolated document moves by 0


@dataclasses.dataclass(frozen=True)
class Window:
    """An attention window a config applies (R3): ``kind`` ``"sliding"`` (a query sees
    keys fewer than ``size`` positions back) or ``"chunked"`` (a query sees the keys of
    its own ``size``-position chunk); ``field`` is the config field that sets it."""

    field: str
    kind: str
    size: int


@dataclasses.dataclass(frozen=True)
class RowLimit:
    """A coupling of a row's documents that no mask can undo: rows longer than
    ``max_len`` tokens are refused with ``reason`` and the fix besides a shorter row,
    ``alternative`` (R3)."""

    field: str
    value: int
    max_len: int
    reason: str
    alternative: str


class HFCausalLM(nn.Module):
    """An HF causal LM seen as an exactstep model (H1). Build it with ``build_hf_model``.

    ``forward(batch) -> [B, T, H]`` final hidden states of ``decoder`` (the module that
    maps ``input_ids`` to them, found by ``decoder_name``); ``head_weight`` ``[V, H]``;
    ``logits(hidden)``; ``num_parameters()`` (unique, a tied head counted once).

    Windows (R3): ``windows`` maps each layer type (``None``: every layer) to the
    attention windows its layers apply; ``realised`` holds the windows the mask
    applies (those the build-time probe crossed and confirmed); ``refusals`` the
    windows a row may not exceed; ``row_limits`` the couplings no mask can undo.
    """

    def __init__(self, model: nn.Module, *, attn_implementation: str) -> None:
        super().__init__()
        if attn_implementation not in ISOLATING_BACKENDS:
            raise ModelError(backend_message(model.config.model_type, attn_implementation))
        self.hf = model
        self.attn_implementation = attn_implementation
        self.model_type: str = model.config.model_type
        self.decoder_name = decoder_name(model)
        self.vocab_size = int(self.head_weight.shape[0])
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self.windows: dict[str | None, tuple[Window, ...]] = windows_of(model.config)
        self.realised: frozenset[Window] = frozenset()  # until the probe confirms them
        self.refusals: tuple[Window, ...] = used_windows(self.windows)
        self.row_limits: tuple[RowLimit, ...] = row_limits_of(model.config)
        self.initial_weights_sha256: str | None = None
        #: under ``attn_implementation = "auto"`` resolved to HF's backend: why (one
        #: line, printed once by the run's rank 0); else None
        self.backend_note: str | None = None
        #: under ``attn_implementation = "exactstep"``: ``model.attention``, how the batch's
        #: visibility is realised (``auto``: the cheaper of per-document and dense at the
        #: thread count, R3, S9; ``segments``: always per document)
        self.attention: str = "auto"
        self.stored_dtype: str | None = None  # of model.path's tensors; None: random init
        self.lora: LoRAConfig | None = None  # set by ``with_lora`` (H4)

    @property
    def decoder(self) -> nn.Module:
        """The HF decoder stack: ``input_ids`` -> ``last_hidden_state`` (after its final norm)."""
        return self.hf.get_submodule(self.decoder_name)

    @property
    def head_weight(self) -> torch.Tensor:
        """``[V, H]``; the input embedding Parameter itself when tied (U6 counts it once)."""
        return self.hf.get_output_embeddings().weight

    def forward(self, batch: Batch) -> torch.Tensor:
        """Final hidden states ``[B, T, H]`` of the decoder stack (no logits, no labels: R1).

        Visibility: ``batch.position_ids`` and the block-diagonal causal mask of
        ``batch.segment_ids``, narrowed to the realised windows (R3); under
        ``attn_implementation = "exactstep"`` the batch's ``Visibility`` as
        ``model.attention`` realises it (per document with no ``[B, 1, T, T]`` mask, or
        under ``auto`` the dense mask where the cost model finds it cheaper at the
        thread count; no realised window). Refuses, without
        reading any device value, a batch with ``prefix_len``, a bidirectional batch,
        and rows longer than the model's positions, a window it does not realise or a
        row limit.
        """
        self.check_rows(batch.shape[1])
        if batch.prefix_len is not None or not batch.causal:
            raise ModelError(
                f"an HF causal LM ({self.model_type}) trains causal objectives only; this "
                "batch is bidirectional or carries prefix_len"
            )
        device = self.head_weight.device
        position_ids = batch.position_ids.to(device)
        if self.attn_implementation == hf_attention.NAME:  # per document: no [B, 1, T, T] mask
            head_dim = head_dim_of(self)  # model.attention, as the built-in decoder reads it
            visibility = prepare_visibility(batch, self.attention, device, head_dim=head_dim)
            # a 2D all-visible mask spares HF's search for documents in position_ids (a
            # host sync); its mask builders then build nothing (``packed_forward``)
            keys = torch.ones(batch.shape, dtype=torch.bool, device=device)  # [B, T]
            with hf_attention.packed_forward():
                out = self.decoder(input_ids=batch.input_ids.to(device), position_ids=position_ids,
                                   attention_mask=keys, use_cache=False, return_dict=True,
                                   **{hf_attention.VISIBILITY_KEYWORD: visibility})
            return hidden_states_of(out, self)  # [B, T, H]
        out = self.decoder(
            input_ids=batch.input_ids.to(device),
            position_ids=position_ids,
            attention_mask=self.attention_mask(batch.segment_ids.to(device), position_ids),
            use_cache=False,
            return_dict=True,
        )
        return hidden_states_of(out, self)  # [B, T, H]

    def attention_mask(
        self, segment_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The 4D mask ``[B, 1, T, T]`` in the form this backend honours (R3).

        With ``position_ids``, each realised window shorter than the row narrows the
        mask of its layers: one mask when every layer has the same windows, else one
        per layer type (``{layer_type: mask}``, the form HF's decoders take for mixed
        layers).
        """
        visible = dense_visibility_mask(segment_ids, causal=True)  # [B, 1, T, T] bool
        T = segment_ids.shape[1]
        active = {} if position_ids is None else {
            key: tuple(w for w in windows if w in self.realised and w.size < T)
            for key, windows in self.windows.items()}
        active = {key: windows for key, windows in active.items() if windows}
        if not active:
            return self.mask_form(visible)
        if None in active:  # no layer types: every layer applies the same windows
            return self.mask_form(windowed(visible, position_ids, active[None]))
        masks: dict[tuple[Window, ...], torch.Tensor] = {}
        by_type = {}
        for layer_type in dict.fromkeys(self.hf.config.layer_types):
            windows = active.get(layer_type, ())
            if windows not in masks:
                masks[windows] = self.mask_form(windowed(visible, position_ids, windows))
            by_type[layer_type] = masks[windows]
        return by_type

    def mask_form(self, visible: torch.Tensor) -> torch.Tensor:
        """Boolean for ``sdpa``; additive float (0 or the float32 minimum) for ``eager``,
        which adds the mask to the scores (a boolean mask would be added as 0/1)."""
        if self.attn_implementation == "eager":
            blocked = torch.finfo(torch.float32).min
            return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, blocked)
        return visible

    def check_rows(self, seq_len: int) -> None:
        """Refuse rows of ``seq_len`` tokens that the model cannot take exactly.

        Positions reach ``seq_len - 1`` at most; the 4D mask replaces the model's own,
        so a window it does not realise must not be shorter than a row (R3), and a row
        limit (a coupling by row index) must not be reached.
        """
        if self.max_positions is not None and seq_len > self.max_positions:
            raise ModelError(
                f"batch.seq_len = {seq_len} exceeds the {self.model_type} model's "
                f"max_position_embeddings = {self.max_positions}; lower batch.seq_len"
            )
        for limit in self.row_limits:
            if seq_len > limit.max_len:
                raise ModelError(
                    f"batch.seq_len = {seq_len} reaches the {self.model_type} model's "
                    f"{limit.field} = {limit.value}: {limit.reason}, so a packed document "
                    f"would differ from itself alone (R3); lower batch.seq_len to at most "
                    f"{limit.max_len} or {limit.alternative}"
                )
        for window in self.refusals:
            if seq_len > window.size:
                per_document = (self.attn_implementation == hf_attention.NAME
                                and window.size <= PROBE_WINDOW_LIMIT)
                raise ModelError(
                    f"batch.seq_len = {seq_len} exceeds the {self.model_type} model's "
                    f"{window.field} = {window.size} ({window.kind} attention), which "
                    + (f"attn_implementation {hf_attention.NAME!r} does not realise"
                       if per_document else "exactstep's block mask does not realise for this "
                       "model") + ", so a packed row would differ from its documents alone "
                    f"(R3); lower batch.seq_len to at most {window.size}"
                    + (" or set model.attn_implementation = 'sdpa'" if per_document else "")
                )

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: Any = None, *,
                    positions: torch.Tensor | None = None, keys: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, Any]:
        """Incremental decoding with HF's own key-value cache (``past_key_values``, named
        ``cache`` by the models transformers 5 has renamed it in; a ``DynamicCache`` built from the config, so sliding and full layers each keep
        what HF's ``generate`` keeps): ``tokens [B, n]`` continue the rows ``cache``
        holds (None: from column 0). Rows of different lengths are left-padded as
        ``generate`` pads them: ``keys [B, T + n]`` is HF's 2D ``attention_mask`` (1 at
        every real column, cached and new) and ``positions [B, n]`` the new tokens'
        positions within their rows. Returns the final hidden states ``[B, n, H]`` and
        the cache (the same object, grown by ``n`` columns). Any HF causal LM whose
        decoder stack takes ``past_key_values``; without gradients."""
        from transformers import DynamicCache  # lazy: transformers is an extra

        device = self.head_weight.device
        start = 0 if cache is None else cache.get_seq_length()
        self.check_rows(start + tokens.shape[1])
        if cache is None:
            cache = DynamicCache(config=self.hf.config)
        if positions is None:
            positions = torch.arange(start, start + tokens.shape[1], device=device)
            positions = positions.expand(tokens.shape[0], -1)
        decoder = self.decoder
        named = cache_keyword(decoder)
        out = decoder(input_ids=tokens.to(device), position_ids=positions.to(device),
                      attention_mask=None if keys is None else keys.to(device).long(),
                      use_cache=True, return_dict=True, **{named: cache})
        return hidden_states_of(out, self), cache

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, H] -> [B, T, V]``. For evaluation and tests; training fuses the head (L1)."""
        return F.linear(hidden, head_for_loss(self))  # a tensor-parallel head gathered

    def num_parameters(self) -> int:
        """Unique parameters; a tied embedding/head is counted once (U6)."""
        return sum(p.numel() for p in self.parameters())

    def describe(self) -> dict[str, Any]:
        """The manifest's ``model`` section (S1): what ``model.path`` or ``model.hf_config``
        resolved to, which the configuration alone does not pin down. The architecture
        (a sha256 over the resolved config, transient keys left out), the initial
        weights (``initial_weights_sha256``, set by ``build_hf_model``), the dtype the
        checkpoint stored them in (``stored_dtype``, before the upcast to fp32) and the
        modelling code's version; a resume whose directory now holds another config or
        other weights is refused naming this section."""
        return {
            "source": "hf",
            "model_type": self.model_type,
            "attn_implementation": self.attn_implementation,
            "config_sha256": config_digest(self.hf.config),
            "initial_weights_sha256": self.initial_weights_sha256,
            "stored_dtype": self.stored_dtype,
            "transformers": import_transformers().__version__,
            **({"lora": self.lora_section()} if self.lora is not None else {}),
        }

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds (S2): with LoRA the adapters only, since the base is
        rebuilt from ``model.path`` or the seed and pinned by its digest in the
        manifest (H4, S4); else the whole state dict."""
        return self.state_dict() if self.lora is None else adapter_state(self)

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``checkpoint_state``'s tensors; with LoRA only frozen base tensors may be
        absent (a whole state dict loads too). Anything else is a ``ModelError``."""
        if self.lora is None:
            self.load_state_dict(state)
        else:
            load_adapter_state(self, state)

    def lora_section(self) -> dict[str, Any]:
        """With LoRA (H4): the frozen base's digest (the weights before the adapters were
        added), the adapters' parameter count and the ``peft`` version."""
        return lora_section(self, self.initial_weights_sha256)


def build_hf_model(cfg: ModelConfig, vocab_size: int, *, seed: int,
                   seq_len: int | None = None) -> HFCausalLM:
    """The HF causal LM ``cfg`` declares, checked to keep every contract (H1).

    From ``cfg.path`` (weights loaded and held in float32, ``model.dtype``) or
    ``cfg.hf_config`` (random init, deterministic in ``seed``, global RNG streams
    untouched: S5). ``attn_implementation = "auto"`` becomes a backend here
    (``resolve_backend``, weighing windows against rows of ``seq_len`` tokens,
    ``batch.seq_len``); the adapter records the resolved one and, on a fallback, why
    (``backend_note``). Raises ``ModelError`` for missing files, a
    backend or architecture that cannot isolate packed documents (R3), a decoder stack
    that cannot be found, a head that is not a plain linear map, router logits whose
    loss would be dropped (L3), or a model vocabulary smaller than ``vocab_size``;
    ``ConfigError`` for an unknown ``hf_config`` key.
    """
    transformers = import_transformers()
    with quiet(transformers):
        config = load_config(transformers, cfg, vocab_size)
        model_type = config.model_type
        text = text_config_of(config)
        refuse_head_features(text)
        refuse_batch_dependent_rope(text)
        refuse_router_logits(text, cfg, nested=text is not config)
        backend, why = resolve_backend(transformers, config, cfg.attn_implementation, seq_len)
        check_backend(transformers, config, backend)
        model = instantiate(transformers, dataclasses.replace(cfg, attn_implementation=backend),
                            config, seed)
        if cfg.attn_implementation == AUTO_BACKEND and backend == hf_attention.NAME:
            backend, why = resolve_after_building(transformers, model, text)
        actual = getattr(model.config, "_attn_implementation", None)
        if actual != backend:
            raise ModelError(
                f"model type {model_type} runs attention with {actual!r}, not the requested "
                f"attn_implementation {backend!r}; exactstep isolates packed "
                "documents (R3) only where it knows the backend"
            )
        model.config.use_cache = False
        adapter = HFCausalLM(model, attn_implementation=backend)
        adapter.attention = cfg.attention
        adapter.backend_note = why
        adapter.initial_weights_sha256 = weights_digest(model)
        if cfg.path is not None:
            adapter.stored_dtype = stored_dtype(Path(cfg.path))
        check_head(adapter)
        check_vocab(adapter, vocab_size)
        check_exactstep_attention(adapter)
        probe(adapter, vocab_size)
        if cfg.activation_checkpointing:
            enable_checkpointing(adapter)
    if cfg.lora.enabled:
        with_lora(adapter, cfg.lora, seed=seed)
    return adapter


def resolve_backend(transformers: Any, config: Any, requested: str,
                    seq_len: int | None) -> tuple[str, str | None]:
    """The backend ``requested`` runs as, and why ``auto`` fell back (else None).

    ``auto`` is ``exactstep`` unless the config shows something exactstep's
    per-document attention refuses: a model outside transformers' attention interface,
    attention logit soft-capping or attention dropout (``hf_attention.config_refusal``),
    or an attention window shorter than rows of ``seq_len`` tokens (it realises no
    window; ``seq_len`` None: shorter than ``max_position_embeddings``, or any window
    where the config has none). Then it is ``sdpa`` (``eager`` for a model without
    it). Attention sinks show only in the built model (``resolve_after_building``).
    A pure function of the config and ``seq_len``, so a resume resolves the same.
    """
    if requested != AUTO_BACKEND:
        return requested, None
    model_class = model_class_of(transformers, config)
    if getattr(model_class, "_supports_attention_backend", True) is False:
        found = (f"runs its own attention ({model_class.__name__}), outside transformers' "
                 f"attention interface, where {PER_DOCUMENT} cannot reach it")
    else:
        feature = hf_attention.config_refusal(text_config_of(config))
        found = None if feature is None else f"applies {feature}, which {PER_DOCUMENT} does not"
    if found is None:  # rows longer than the model's positions are refused anyway
        longest = seq_len if seq_len is not None else getattr(config, "max_position_embeddings",
                                                               None)
        shorter = [w for w in used_windows(windows_of(config))
                   if not isinstance(longest, int) or w.size < longest]
        if shorter:
            w = shorter[0]
            rows = (f"batch.seq_len = {seq_len}" if seq_len is not None else
                    f"max_position_embeddings = {longest}" if isinstance(longest, int) else
                    "rows")
            found = (f"applies {w.field} = {w.size} ({w.kind} attention), shorter than {rows}, "
                     f"which {PER_DOCUMENT} does not realise")
    if found is None:
        return hf_attention.NAME, None
    fallback = "sdpa" if getattr(model_class, "_supports_sdpa", True) is not False else "eager"
    return fallback, fallback_note(config.model_type, found, fallback)


def resolve_after_building(transformers: Any, model: nn.Module, text: Any
                           ) -> tuple[str, str | None]:
    """``auto`` resolved to ``exactstep`` from the config: still ``exactstep``, unless
    the built model has what the config does not show (attention sinks), where the
    model is switched to ``sdpa`` (``eager`` for a model without it) in place: the
    backend holds no parameter, so the weights are the same."""
    found = hf_attention.refusal(text, model)
    if found is None:
        return hf_attention.NAME, None
    fallback = "sdpa" if getattr(model, "_supports_sdpa", True) is not False else "eager"
    check_backend(transformers, model.config, fallback)
    model.set_attn_implementation(fallback)
    return fallback, fallback_note(model.config.model_type,
                                   f"applies {found}, which {PER_DOCUMENT} does not", fallback)


def fallback_note(model_type: str, found: str, fallback: str) -> str:
    """The one line saying that ``auto`` runs ``fallback``, and what of the model
    (``found``) ``exactstep`` refuses."""
    return f"model.attn_implementation = 'auto' runs {fallback!r}: the {model_type} model {found}"


def with_lora(adapter: HFCausalLM, lora: LoRAConfig, *, seed: int) -> None:
    """Wrap ``adapter.hf`` with ``peft.get_peft_model`` (H4): every base tensor frozen,
    the adapters the only trainable parameters; their random init from ``seed`` only
    (S5). The decoder stack is found again through the wrapper. A target that is the
    output head is refused: exactstep fuses the plain head weight into its loss (L1).
    """
    config = lora_config(lora, task_type="CAUSAL_LM")
    with adapting(seed):
        wrapped = import_peft().get_peft_model(adapter.hf, config)
    if adapted(wrapped.get_output_embeddings()):
        raise ModelError(HEAD_TARGETED)
    adapter.hf = wrapped
    adapter.decoder_name = decoder_name(wrapped)
    adapter.lora = lora


def config_digest(config: Any) -> str:
    """sha256 of an HF config's canonical JSON, without its private (``_``) keys and
    the version that wrote it (recorded apart)."""
    values = {k: v for k, v in config.to_dict().items()
              if not k.startswith("_") and k != "transformers_version"}
    text = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stored_dtype(directory: Path) -> str:
    """The floating-point dtype(s) of the tensors in ``directory``'s safetensors files,
    read from their headers (``"bfloat16"``; several joined by ``+``, sorted)."""
    names = set()
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                names.add(SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype(), ""))
    names.discard("")
    return "+".join(sorted(names)) or "none"


def weights_digest(model: nn.Module) -> str:
    """sha256 over every tensor of ``model``'s state dict (name, dtype, shape, bytes),
    in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().contiguous().cpu().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------- building


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "model.source = 'hf' needs the Hugging Face extra: pip install 'exactstep[hf]'"
        ) from None
    return transformers


@contextlib.contextmanager
def quiet(transformers: Any) -> Iterator[None]:
    """HF's log lines, progress bars and warnings silenced while the model is built
    (a refusal is one line, X4); the previous settings are restored."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def load_config(transformers: Any, cfg: ModelConfig, vocab_size: int) -> Any:
    """The HF config of ``model.path`` or ``model.hf_config``."""
    if cfg.path is not None:
        directory = model_directory(Path(cfg.path))
        try:
            return transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(
                f"model.path {directory}: config.json cannot be read as a Hugging Face config "
                f"({first_line(exc)})"
            ) from None
    table = dict(cfg.hf_config)
    model_type = table.pop("model_type")
    try:
        config_class = transformers.AutoConfig.for_model(model_type).__class__
    except (ValueError, KeyError):
        raise ModelError(
            f"model.hf_config.model_type {model_type!r} is not a model type this transformers "
            f"({transformers.__version__}) knows"
        ) from None
    check_keys("model.hf_config", table, config_class)
    text_class = (getattr(config_class, "sub_configs", None) or {}).get("text_config")
    if isinstance(table.get("text_config"), dict) and isinstance(text_class, type):
        # a multimodal config (Mllama, Llama 4): its decoder is built from text_config
        check_keys("model.hf_config.text_config", table["text_config"], text_class)
        table["text_config"] = {**table["text_config"]}
        table["text_config"].setdefault("vocab_size", vocab_size)
    else:
        table.setdefault("vocab_size", vocab_size)
    try:
        return transformers.AutoConfig.for_model(model_type, **table)
    except Exception as exc:  # HF validators raise their own types
        reason = " ".join(str(exc).split())  # HF validators put the reason on a second line
        raise ModelError(f"model.hf_config is not a valid {model_type} config ({reason})"
                         ) from None


def check_keys(prefix: str, table: dict[str, Any], config_class: type) -> None:
    unknown = sorted(set(table) - known_config_keys(config_class) - {"model_type"})
    if unknown:
        raise ConfigError(
            f"{prefix}.{unknown[0]} is not a key of {config_class.__name__}; check its "
            "spelling against the model's configuration"
        )


def model_directory(directory: Path) -> Path:
    """``directory`` if it holds ``config.json`` and safetensors weights; else one
    ``ModelError`` naming the path and what is missing."""
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise ModelError(f"model.path {directory} {what}; give a directory with config.json "
                         "and safetensors weights (as written by save_pretrained)")
    missing = [] if (directory / "config.json").is_file() else ["config.json"]
    if not any(directory.glob("*.safetensors")):
        missing.append("safetensors weights (*.safetensors)")
    if missing:
        raise ModelError(f"model.path {directory} has no {' and no '.join(missing)}; give a "
                         "directory written by save_pretrained")
    return directory


def known_config_keys(config_class: type) -> set[str]:
    """Every key ``config_class`` declares: its fields, defaults and attribute aliases."""
    keys = set(config_class().to_dict())
    if dataclasses.is_dataclass(config_class):
        keys |= {f.name for f in dataclasses.fields(config_class)}
    keys |= set(getattr(config_class, "attribute_map", {}))
    if "rope_parameters" in keys:  # config.json files still spell these the older way
        keys |= {"rope_scaling", "rope_theta"}
    return keys | {"rope_scaling"}


def model_class_of(transformers: Any, config: Any) -> type | None:
    """The class ``AutoModelForCausalLM`` builds for ``config``, or None if it has none."""
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError, ValueError):
        return None


def check_backend(transformers: Any, config: Any, backend: str) -> None:
    """Only backends that honour exactstep's 4D mask (R3); a model without ``sdpa`` is
    pointed to ``eager``, which every HF model has."""
    model_class = model_class_of(transformers, config)
    has_sdpa = getattr(model_class, "_supports_sdpa", True) is not False
    if backend not in ISOLATING_BACKENDS:
        raise ModelError(backend_message(config.model_type, backend,
                                         "sdpa" if has_sdpa else "eager"))
    if backend == "sdpa" and not has_sdpa:
        raise ModelError(no_sdpa_message(config.model_type, model_class.__name__))
    if backend == hf_attention.NAME:  # HF's calls without packed rows run HF's sdpa function
        if getattr(model_class, "_supports_attention_backend", True) is False:
            raise ModelError(
                f"model type {config.model_type} ({model_class.__name__}) runs its own attention, "
                f"not transformers' attention interface, so attn_implementation "
                f"{hf_attention.NAME!r} cannot reach it; set model.attn_implementation = "
                f"{'sdpa' if has_sdpa else 'eager'!r}"
            )
        hf_attention.register(transformers)


def check_exactstep_attention(adapter: HFCausalLM) -> None:
    """``attn_implementation = "exactstep"`` runs what the model's attention does only
    where it needs nothing beyond scaled, causal, per-document attention: soft-capping,
    attention dropout or sinks are one ``ModelError`` naming ``sdpa`` (``eager`` for a
    model without it) (R3)."""
    if adapter.attn_implementation != hf_attention.NAME:
        return
    found = hf_attention.refusal(text_config_of(adapter.hf.config), adapter.hf)
    if found is not None:
        fix = "sdpa" if getattr(adapter.hf, "_supports_sdpa", True) is not False else "eager"
        raise ModelError(
            f"model type {adapter.model_type} applies {found}, which attn_implementation "
            f"{hf_attention.NAME!r} (exactstep's per-document attention) does not; set "
            f"model.attn_implementation = {fix!r}"
        )


def head_dim_of(adapter: HFCausalLM) -> int | None:
    """The attention head dimension the config declares (``head_dim``, else
    ``hidden_size / num_attention_heads``), or None where it declares neither."""
    config = text_config_of(adapter.hf.config)
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden, heads = (getattr(config, name, None) for name in ("hidden_size", "num_attention_heads"))
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def no_sdpa_message(model_type: str, class_name: str) -> str:
    return (
        f"model type {model_type} ({class_name}) has no sdpa attention in this transformers; "
        "set model.attn_implementation = 'eager' (exactstep isolates packed documents under "
        "eager too, R3)"
    )


def text_config_of(config: Any) -> Any:
    """The decoder's config: ``config`` itself, or the text config a multimodal config
    nests (Mllama, Llama 4), which is what its CausalLM is built from."""
    get_text_config = getattr(config, "get_text_config", None)
    try:
        return get_text_config(decoder=True) if callable(get_text_config) else config
    except (TypeError, ValueError, AttributeError):
        return config


def refuse_router_logits(config: Any, cfg: ModelConfig, *, nested: bool) -> None:
    """An MoE model with ``output_router_logits`` adds a load-balancing loss to HF's own
    loss; exactstep computes the loss itself (R1, L3) and has no such term, so the
    router would silently train without it. Refused, naming where to turn it off."""
    if getattr(config, "output_router_logits", False) is not True:
        return
    if cfg.path is not None:
        where = f"output_router_logits = true in {Path(cfg.path) / 'config.json'}"
        fix = "set it to false there"
    else:
        key = "model.hf_config." + ("text_config." if nested else "") + "output_router_logits"
        where, fix = f"{key} = true", f"set {key} = false"
    raise ModelError(
        f"model type {config.model_type} has {where}: HF would add a load-balancing "
        "(auxiliary) loss to its own loss, which exactstep's objective (L3) does not "
        f"include, so the router would train without it; {fix} to train without the "
        "load-balancing loss knowingly"
    )


def refuse_head_features(config: Any) -> None:
    """A head that is not ``hidden @ W.T`` cannot be fused into exactstep's loss (L1)."""
    for attribute, feature, neutral in HEAD_FEATURES:
        value = getattr(config, attribute, None)
        if value not in neutral:
            raise ModelError(
                f"model type {config.model_type} applies {feature} ({attribute} = {value}) to its "
                "logits; exactstep fuses a plain linear head into its loss (L1) and cannot train "
                "it exactly; use a model without it"
            )


def refuse_batch_dependent_rope(config: Any) -> None:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    layers = parameters.values() if isinstance(parameters, dict) else ()
    # rope_parameters is one dict, or one dict per attention type
    tables = [parameters] + [p for p in layers if isinstance(p, dict)]
    for table in tables:
        rope_type = table.get("rope_type", table.get("type")) if isinstance(table, dict) else None
        if rope_type in BATCH_DEPENDENT_ROPE:
            raise ModelError(
                f"model type {config.model_type} uses rope_type {rope_type!r}, whose "
                "frequencies depend on the longest position in the batch, so packed documents "
                "would change each other (R3); use a fixed RoPE type"
            )


def windows_of(config: Any) -> dict[str | None, tuple[Window, ...]]:
    """The attention windows ``config`` applies, by layer type (R3).

    With ``layer_types``: a type whose name holds ``chunk`` is chunked by the first
    set field of ``CHUNK_FIELDS``; one holding ``sliding`` or ``local`` slides by the
    first set field of ``SLIDING_FIELDS``; any other type has no window here (what
    it does is the probe's to see). Without ``layer_types``, every set window field
    applies to every layer (key ``None``), except ``sliding_window`` under
    ``use_sliding_window = False``. A windowed layer type without a size exactstep can
    read is a ``ModelError``.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        windows: dict[str | None, tuple[Window, ...]] = {}
        for layer_type in dict.fromkeys(layer_types):
            kind = window_kind(str(layer_type))
            if kind is None:
                continue
            found = window_field(config, CHUNK_FIELDS if kind == "chunked" else SLIDING_FIELDS)
            if found is None:
                raise ModelError(
                    f"model type {config.model_type}: layer type {layer_type!r} has no window "
                    f"size exactstep can read (none of {', '.join(SLIDING_FIELDS + CHUNK_FIELDS)}"
                    "), so it cannot keep packed documents apart exactly (R3); use a model "
                    "without it"
                )
            windows[layer_type] = (Window(found[0], kind, found[1]),)
        return windows
    every = []
    sliding = window_field(config, SLIDING_FIELDS)
    if sliding is not None and getattr(config, "use_sliding_window", True) is not False:
        every.append(Window(sliding[0], "sliding", sliding[1]))
    chunk = window_field(config, CHUNK_FIELDS)
    if chunk is not None:
        every.append(Window(chunk[0], "chunked", chunk[1]))
    return {None: tuple(every)} if every else {}


def window_kind(layer_type: str) -> str | None:
    name = layer_type.lower()
    if "chunk" in name:
        return "chunked"
    if "sliding" in name or "local" in name:
        return "sliding"
    return None


def window_field(config: Any, fields: tuple[str, ...]) -> tuple[str, int] | None:
    """The first of ``fields`` set on ``config`` to a positive size (the smallest, for a
    per-layer list), with its name."""
    for name in fields:
        value = getattr(config, name, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        sizes = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        if sizes:
            return name, min(sizes)
    return None


def used_windows(windows: dict[str | None, tuple[Window, ...]]) -> tuple[Window, ...]:
    return tuple(dict.fromkeys(w for group in windows.values() for w in group))


def declared_windows(config: Any) -> tuple[Window, ...]:
    """Every window field ``config`` sets, used by a layer or not (the probe crosses them
    all, so a field exactstep reads as unused is checked too)."""
    declared = []
    for fields, kind in ((SLIDING_FIELDS, "sliding"), (CHUNK_FIELDS, "chunked")):
        for name in fields:
            found = window_field(config, (name,))
            if found is not None:
                declared.append(Window(found[0], kind, found[1]))
    return tuple(declared)


def row_limits_of(config: Any) -> tuple[RowLimit, ...]:
    """Couplings of a row's documents by row index, which no mask can undo (R3).

    Llama 4's attention temperature (``attn_temperature_tuning``) scales the queries
    of its NoPE layers by ``log1p(floor((i + 1) / floor_scale))`` of the row index
    ``i``, not of the document's position: 1 while ``i + 1 < floor_scale``, so rows
    of fewer than ``floor_scale`` tokens are exact.
    """
    floor_scale = getattr(config, "floor_scale", None)
    nope = 0 in (getattr(config, "no_rope_layers", None) or ())
    if getattr(config, "attn_temperature_tuning", False) and nope and isinstance(floor_scale, int):
        return (RowLimit("floor_scale", floor_scale, floor_scale - 1,
                         "with attn_temperature_tuning its NoPE layers scale queries by the row "
                         "index, not by the document's position",
                         "set attn_temperature_tuning = false in the model's config"),)
    return ()


def windowed(visible: torch.Tensor, position_ids: torch.Tensor,
             windows: tuple[Window, ...]) -> torch.Tensor:
    """``visible`` narrowed to each of ``windows`` (``attention.windowed_visibility``)."""
    for window in windows:
        size = {window.kind: window.size}
        visible = windowed_visibility(visible, position_ids, sliding=size.get("sliding"),
                                      chunk=size.get("chunked"))
    return visible


def instantiate(transformers: Any, cfg: ModelConfig, config: Any, seed: int) -> nn.Module:
    """Load or create the model in ``cfg.dtype`` (float32: fp32 master weights, U2;
    a bf16 checkpoint's values are upcast exactly); random init from ``seed`` only (S5)."""
    auto = transformers.AutoModelForCausalLM
    dtype = getattr(torch, cfg.dtype)
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and not 0 <= pad < config.vocab_size:
        raise ModelError(f"the {config.model_type} config's pad_token_id ({pad}) lies outside its "
                         f"vocabulary of {config.vocab_size}; set pad_token_id in the model config")
    try:
        with isolated_rng():
            torch.default_generator.manual_seed(seed)
            if cfg.path is None:
                return auto.from_config(config, attn_implementation=cfg.attn_implementation,
                                        dtype=dtype)
            model, info = auto.from_pretrained(
                cfg.path, config=config, attn_implementation=cfg.attn_implementation,
                dtype=dtype, local_files_only=True, output_loading_info=True)
    except Exception as exc:  # any failure of HF constructors: one line
        if cfg.attn_implementation == "sdpa" and "scaled_dot_product_attention" in str(exc):
            name = str(exc).split(" ", 1)[0]
            raise ModelError(no_sdpa_message(config.model_type, name)) from None
        raise ModelError(f"building the {config.model_type} model with attn_implementation "
                         f"{cfg.attn_implementation!r} failed: {first_line(exc)}") from None
    lacking = sorted(info.get("missing_keys", ())) + sorted(info.get("mismatched_keys", ()))
    if lacking:
        raise ModelError(f"model.path {cfg.path}: the weights lack or mis-shape {len(lacking)} "
                         f"tensor(s), e.g. {lacking[0]}; exactstep never initialises them silently")
    model.train()  # from_pretrained leaves eval mode: train with the dropout the config declares
    return model


def decoder_name(model: nn.Module) -> str:
    """The dotted name of ``model``'s decoder stack: the module that maps ``input_ids``
    to the final hidden states, holds the input embedding and not the output head.

    Tried in order: ``base_model``, ``get_decoder()``, then ``DECODER_ATTRIBUTES``
    (Llama 4's and Mllama's CausalLMs name a ``base_model_prefix`` they do not have,
    so ``base_model`` and ``get_decoder()`` are the CausalLM itself). None fits: one
    ``ModelError`` naming the class (H1). That it returns hidden states is checked
    on every forward (``hidden_states_of``) and first by the build-time probe.
    """
    names = {id(module): name for name, module in model.named_modules() if name}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    candidates = [getattr(model, "base_model", None)]
    with contextlib.suppress(Exception):  # HF raises for models without the rule
        candidates.append(model.get_decoder())
    candidates += [getattr(model, name, None) for name in DECODER_ATTRIBUTES]
    for module in candidates:
        if not isinstance(module, nn.Module) or id(module) not in names:
            continue
        inside = {id(m) for m in module.modules()}
        if id(embedding) in inside and id(head) not in inside:
            return names[id(module)]
    raise ModelError(
        f"{type(model).__name__} (model type {model.config.model_type}): exactstep cannot find "
        "its decoder stack, the module that maps input_ids to last_hidden_state before the "
        "lm_head (neither its base_model, nor get_decoder(), nor an attribute named "
        f"{', '.join(DECODER_ATTRIBUTES)}); use a causal LM whose base_model is that module"
    )


@functools.cache
def cache_keyword_of(forward: Any) -> str:
    """The keyword a decoder's ``forward`` takes its key-value cache by: ``cache`` where
    transformers 5 has renamed it (model by model), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_keyword(decoder: nn.Module) -> str:
    return cache_keyword_of(type(decoder).forward)


def hidden_states_of(out: Any, adapter: HFCausalLM) -> torch.Tensor:
    """``out.last_hidden_state`` ``[B, T, H]``, or a ``ModelError`` naming the class."""
    hidden = getattr(out, "last_hidden_state", None)
    if not isinstance(hidden, torch.Tensor):
        raise ModelError(
            f"the decoder stack ({adapter.decoder_name!r}) of {type(adapter.hf).__name__} returns "
            "no last_hidden_state; exactstep trains causal LMs whose base model returns its "
            "final hidden states (H1); use another model"
        )
    return hidden


def enable_checkpointing(adapter: HFCausalLM) -> None:
    """HF's own activation checkpointing, non-reentrant (H5): each decoder layer keeps
    its input only and is rerun in the backward, with the RNG state of its forward
    (dropout replayed), while the layer is in training mode with gradients on. A model
    without it is one ``ConfigError`` naming ``model.activation_checkpointing``."""
    model, kwargs = adapter.hf, {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # the older name warns
    supported = getattr(model, "supports_gradient_checkpointing", False) is True
    try:
        if supported and callable(enable):
            enable(activation_checkpointing_kwargs=kwargs)
        elif supported:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError:  # HF: no layer of the model can be checkpointed
        supported = False
    if not supported:
        raise ConfigError(
            f"model.activation_checkpointing = true, but the {adapter.model_type} model "
            f"({type(model).__name__}) does not support activation checkpointing in this "
            "transformers; set model.activation_checkpointing = false"
        ) from None


def check_head(adapter: HFCausalLM) -> None:
    head = adapter.hf.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None or head.weight.ndim != 2:
        raise ModelError(f"model type {adapter.model_type} has no linear output head")
    if getattr(head, "bias", None) is not None:
        raise ModelError(
            f"model type {adapter.model_type} has an lm_head bias; exactstep fuses a bias-free "
            "linear head into its loss (L1) and cannot train it exactly; use another model"
        )


def check_vocab(adapter: HFCausalLM, vocab_size: int) -> None:
    """``V_model >= vocab_size``, else a ``ModelError`` naming both sizes. Extra model
    rows (a padded embedding) are allowed: never inputs or targets (R7), they stay
    classes of the softmax, so the objective runs over ``V_model`` classes."""
    rows = adapter.vocab_size
    embedding = adapter.hf.get_input_embeddings().weight.shape[0]
    if rows < vocab_size or embedding < vocab_size:
        raise ModelError(
            f"vocabulary mismatch: the tokenizer has {vocab_size} tokens but the "
            f"{adapter.model_type} model's vocabulary has {min(rows, embedding)}; the model "
            "must cover every tokenizer id (set vocab_size in the model config)"
        )


# ------------------------------------------------------------------------------ probe


def probe_batch(vocab_size: int, seed: int = 0, lengths: tuple[int, ...] = PROBE_LENGTHS) -> Batch:
    """Documents of ``lengths`` packed in one row, then one padding column (segment ids
    1, 2, ..., 0)."""
    generator = torch.Generator().manual_seed(seed)
    T = sum(lengths) + 1
    ids = torch.randint(0, vocab_size, (1, T), generator=generator)
    positions = torch.zeros(1, T, dtype=torch.long)
    segment_ids = torch.zeros(1, T, dtype=torch.int32)
    segments, start = [], 0
    for k, n in enumerate(lengths):
        positions[0, start : start + n] = torch.arange(n)
        segment_ids[0, start : start + n] = k + 1
        segments.append(Segment(example_id=k, piece=0, offset=0, start=start, length=n))
        start += n
    labels = torch.full_like(ids, IGNORE_INDEX)
    return Batch(ids, labels, positions, segment_ids, (tuple(segments),))


def probe_lengths(adapter: HFCausalLM, *, crossing: bool) -> tuple[int, int] | None:
    """The probe's two document lengths.

    ``crossing``: the second document is twice as long as the longest window the
    config declares up to ``PROBE_WINDOW_LIMIT``, plus 2, so its last queries lose
    half their keys to the window and a missing window moves their logits far above
    the tolerance whatever the window's size (one key of ``W`` moves them by about
    ``2 / W`` relative at random init); it starts after the first document, so a
    window read on the row index instead of its positions shows too. None when the
    config declares no such window or the row would pass the model's positions, a row
    limit or a window the probe does not cross. Otherwise ``PROBE_LENGTHS``, shortened
    to fit every refusal.
    """
    config = adapter.hf.config
    windows = used_windows(adapter.windows) + declared_windows(config)
    bounds = [limit.max_len for limit in adapter.row_limits]
    bounds += [adapter.max_positions] if adapter.max_positions is not None else []
    if crossing:
        crossed = [w.size for w in windows if w.size <= PROBE_WINDOW_LIMIT]
        bounds += [w.size for w in windows if w.size > PROBE_WINDOW_LIMIT]
        if not crossed:
            return None
        lengths = (PROBE_LENGTHS[0], 2 * max(crossed) + 2)
        return lengths if sum(lengths) + 1 <= min(bounds, default=sum(lengths) + 1) else None
    room = min(bounds + [w.size for w in adapter.refusals], default=sum(PROBE_LENGTHS) + 1) - 1
    if sum(PROBE_LENGTHS) <= room:
        return PROBE_LENGTHS
    first = max(1, room // 2)
    return first, max(1, room - first)


def perturbed_first_document(batch: Batch, vocab_size: int) -> Batch:
    """``batch`` with every token of its first document replaced by another id."""
    first = batch.segments[0][0]
    ids = batch.input_ids.clone()
    ids[0, first.start : first.stop] = (ids[0, first.start : first.stop] + 1) % vocab_size
    return dataclasses.replace(batch, input_ids=ids)


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """Eval mode, no gradients, every RNG stream restored; each module's mode after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), isolated_rng():
            yield
    finally:
        for module, training in modes:
            module.training = training


def probe(adapter: HFCausalLM, vocab_size: int) -> None:
    """``probe_realisation`` under every way the forward can realise visibility: for
    ``attn_implementation = "exactstep"`` under ``model.attention = "auto"``, both the
    per-document path and the dense mask (a batch may take either, R3)."""
    if adapter.attn_implementation != hf_attention.NAME or adapter.attention != "auto":
        probe_realisation(adapter, vocab_size)
        return
    try:
        for impl in ("segments", "dense"):
            adapter.attention = impl
            probe_realisation(adapter, vocab_size)
    finally:
        adapter.attention = "auto"


def probe_realisation(adapter: HFCausalLM, vocab_size: int) -> None:
    """Refuse a model whose head is not linear or whose packed documents interact;
    decide which windows the mask realises (R3).

    When the config declares a window the probe can cross, the probe runs on
    documents that cross every such window (``probe_lengths``), first with those
    windows realised in the mask, then with none (a model that applies a window
    itself, by index inside its attention, as GPT-Neo does); the first that passes
    is kept. If neither passes (or without such windows), no window is realised,
    every window the config declares becomes a refusal (``check_rows``), and the
    probe runs on documents within them; a failure there is the ``ModelError``. See
    ``probe_error`` for what is compared.
    """
    lengths = probe_lengths(adapter, crossing=True)
    if lengths is not None:
        used = used_windows(adapter.windows)
        crossed = frozenset(w for w in used if w.size <= PROBE_WINDOW_LIMIT)
        # exactstep's per-document attention realises no window: only the model's own
        within = frozenset() if adapter.attn_implementation == hf_attention.NAME else crossed
        for realised in (within, frozenset()) if within else (within,):
            adapter.realised = realised
            adapter.refusals = tuple(w for w in used if w not in crossed)
            if probe_error(adapter, vocab_size, lengths) is None:
                return
        adapter.realised = frozenset()
        adapter.refusals = tuple(dict.fromkeys(used + declared_windows(adapter.hf.config)))
    error = probe_error(adapter, vocab_size, probe_lengths(adapter, crossing=False))
    if error is not None:
        raise error


def probe_error(adapter: HFCausalLM, vocab_size: int,
                lengths: tuple[int, ...]) -> ModelError | None:
    """Why ``adapter`` fails the probe on documents of ``lengths``, or None.

    Three comparisons on ``probe_batch`` (two documents, then padding): HF's own
    logits against ``hidden @ W.T`` (the head is linear); each packed document's
    logits against HF's own forward of that document alone, with no mask and
    default positions (positions, visibility and windows mean what the model means);
    and the second document's logits when every token of the first changes, which
    under true isolation stay equal to rounding (a leak too small at random init
    to show against the first reference, e.g. a recurrent state, shows here).
    """
    batch = probe_batch(vocab_size, lengths=lengths)
    adapter.check_rows(batch.shape[1])
    second = batch.segments[0][1]
    with frozen(adapter):
        try:
            packed = adapter.logits(adapter(batch))[0]  # [T, V]
            moved = adapter.logits(adapter(perturbed_first_document(batch, vocab_size)))[0]
            head_error = isolation_error = 0.0
            scale = 1.0 + float(packed.abs().max())
            for segment in batch.segments[0]:
                doc = batch.input_ids[:, segment.start : segment.stop]  # [1, n]
                native = adapter.hf(input_ids=doc, use_cache=False).logits[0]  # [n, V]
                hidden = hidden_states_of(adapter.decoder(input_ids=doc, use_cache=False), adapter)
                head_error = max(head_error, max_error(adapter.logits(hidden)[0], native))
                isolation_error = max(
                    isolation_error, max_error(packed[segment.start : segment.stop], native)
                )
            leak = max_error(moved[second.start :], packed[second.start :])
        except (TypeError, ValueError, RuntimeError, IndexError, KeyError, AttributeError) as exc:
            return ModelError(
                f"model type {adapter.model_type} with attn_implementation "
                f"{adapter.attn_implementation!r} cannot take packed rows (position_ids and a 4D "
                f"attention mask): {first_line(exc)}"
            )
    if head_error / scale > PROBE_TOLERANCE:
        return ModelError(
            f"the output head of model type {adapter.model_type} is not a plain linear map of "
            f"its final hidden states (its logits differ from hidden @ W.T by "
            f"{head_error / scale:.1e} relative); exactstep fuses a linear head into its loss "
            "(L1) and cannot train it"
        )
    if isolation_error / scale > PROBE_TOLERANCE or leak / scale > LEAK_TOLERANCE:
        return ModelError(
            f"model type {adapter.model_type} with attn_implementation "
            f"{adapter.attn_implementation!r} does not isolate packed documents: a document's "
            f"logits move by {max(isolation_error, leak) / scale:.1e} (relative) when another "
            "shares its row (R3); use an architecture that honours a 4D attention mask and "
            "position_ids" + ("" if adapter.attn_implementation != hf_attention.NAME else
                              ", or set model.attn_implementation = 'sdpa'")
        )
    return None


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def backend_message(model_type: str, backend: str, suggestion: str = "sdpa") -> str:
    return (
        f"model type {model_type} with attn_implementation {backend!r} cannot isolate packed "
        f"documents here (R3): exactstep realises segment visibility for HF models as a 4D mask, "
        f"which only 'sdpa' and 'eager' honour, or per document ({hf_attention.NAME!r}); set "
        f"model.attn_implementation = {suggestion!r}"
    )


def first_line(exc: BaseException) -> str:
    """The first sentence of ``exc``'s message, on one line."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    sentence, dot, rest = line.partition(". ")
    return sentence + "." if dot and rest else line
