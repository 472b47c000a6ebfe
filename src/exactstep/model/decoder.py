"""The built-in Llama-style decoder: a Batch in, final-normed hidden states out (R2, R3, L1).

Pre-norm blocks of RoPE attention and a SwiGLU MLP, no biases, an optionally tied
head. Visibility comes from the Batch's structure only, through ``model.attention``,
and positions from ``batch.position_ids`` (R2, R3); ``forward`` returns hidden
states, not logits, because the loss fuses the head (L1). ``build_model`` builds it.
Design and derivations: docs/design/model.md#modeldecoderpy (R2, R3, L1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init
from torch.utils.checkpoint import checkpoint

from exactstep.errors import ConfigError, ModelError
from exactstep.model.attention import Visibility, attend_fused, prepare_visibility
from exactstep.model.config import LoRAConfig, ModelConfig
from exactstep.model.hf import build_hf_model, weights_digest
from exactstep.model.lora import (
    HEAD_TARGETED,
    adapted,
    adapter_state,
    adapting,
    inject_adapters,
    load_adapter_state,
    lora_config,
    lora_section,
)
from exactstep.rows.batch import Batch
from exactstep.update.window import head_for_loss


def rope_tables(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for the fused ``[B, T, 3, nH, Dh]`` projection: two ``[B, T, 3, 1, Dh]``.

    Slots 0 and 1 (queries, keys) hold ``cos`` and the signed ``sin`` of
    ``position * theta^(-2i/Dh)`` for the pairs (i, i + Dh/2); slot 2 (values) holds
    1 and 0, so values pass through exactly unchanged. Computed once per forward
    from ``position_ids`` (cheaper than a cached table lookup, exact for any
    position, no device sync) and shared by all layers.
    """
    # 1 / theta^(2i/Dh) in fp32, rounded as Llama's rotary embedding rounds it (not
    # theta^(-2i/Dh), which differs in the last bit), so an export matches (H3)
    inv_freq = 1.0 / (theta ** (
        torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    ))  # [Dh/2]
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    cos, sin = angles.cos(), angles.sin()  # [B, T, Dh/2]
    cos_qk = torch.cat([cos, cos], dim=-1)  # [B, T, Dh]
    sin_qk = torch.cat([-sin, sin], dim=-1)  # [B, T, Dh]: sign of the rotation folded in
    cos3 = torch.stack([cos_qk, cos_qk, torch.ones_like(cos_qk)], dim=2)  # [B, T, 3, Dh]
    sin3 = torch.stack([sin_qk, sin_qk, torch.zeros_like(sin_qk)], dim=2)  # [B, T, 3, Dh]
    return cos3[:, :, :, None], sin3[:, :, :, None]  # [B, T, 3, 1, Dh]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + Dh/2) of ``x [..., Dh]``: ``x * cos + swap_halves(x) * sin_signed``.

    ``swap_halves`` is a flip of the two halves (one operator forward and backward,
    no slicing, so no zero-filled gradient buffers).
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [..., Dh]: (x2, x1)
    return x * cos.to(x.dtype) + swapped * sin_signed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = skip_init(nn.Linear, cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = skip_init(nn.Linear, cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, vis: Visibility
    ) -> torch.Tensor:
        # nH: this rank's heads (all of them, or n_heads / tp under tensor parallel, D5);
        # unflatten infers nH from the last dimension alone: defined for B = 0 (an
        # empty share's rollout rows), where a view of [B, T, 3, -1, Dh] is ambiguous
        qkv = self.qkv(x).unflatten(-1, (3, -1, self.head_dim))  # [B, T, 3, nH, Dh]
        qkv = apply_rope(qkv, cos, sin)  # [B, T, 3, nH, Dh]; values unchanged
        y = attend_fused(qkv, vis)  # [B, T, nH, Dh]
        return self.out(y.flatten(2))  # [B, T, H]


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = skip_init(nn.Linear, cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = skip_init(nn.Linear, cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [B, T, F] each
        return self.down(F.silu(gate) * up)  # [B, T, H]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, vis: Visibility
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, vis)  # [B, T, H]
        return x + self.mlp(self.mlp_norm(x))  # [B, T, H]



def step_tables(tokens: torch.Tensor, start: int, cfg: ModelConfig,
                positions: torch.Tensor | None = None, keys: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RoPE tables of ``tokens [B, n]`` (columns ``start .. start + n - 1`` of the rows)
    and the mask of their queries over every cached key (None for one new column of
    unpadded rows). ``positions [B, n]``: the tokens' positions (default their columns:
    rows without left padding); ``keys [B, start + n]``: which columns are real tokens
    (default all). A query sees the real keys at or before its column, and always its
    own (a padding column's query sees itself alone: defined, and read by no one)."""
    B, n = tokens.shape
    if positions is None:
        positions = torch.arange(start, start + n, device=tokens.device).expand(B, n)
    cos, sin = rope_tables(positions, cfg.d_model // cfg.n_heads, cfg.rope_theta)
    if keys is None and n == 1:
        return cos, sin, None
    columns = torch.arange(start + n, device=tokens.device)
    queries = start + torch.arange(n, device=tokens.device)
    mask = columns[None, :] <= queries[:, None]  # [n, T]: query i sees keys 0 .. start + i
    if keys is not None:  # [B, 1, n, T]: only real keys, besides each query's own column
        mask = (mask & keys[:, None, None, :].bool()) | (columns[None, :] == queries[:, None])
    return cos, sin, mask


def cached_self_attention(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, mask: torch.Tensor | None,
                          past: tuple[torch.Tensor, torch.Tensor] | None
                          ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``attn`` (an ``Attention``) on the normed new columns ``x [B, n, H]`` against its
    cached rotated keys and values ``past`` (``[B, nH, T, Dh]`` each, or None): the
    output ``[B, n, H]`` and the cache with the new columns appended."""
    B, n, _ = x.shape
    qkv = attn.qkv(x).view(B, n, 3, attn.n_heads, attn.head_dim)
    q, k, v = (t.transpose(1, 2) for t in apply_rope(qkv, cos, sin).unbind(2))
    if past is not None:
        k = torch.cat([past[0], k], dim=2)  # [B, nH, T + n, Dh]
        v = torch.cat([past[1], v], dim=2)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, nH, n, Dh]
    return attn.out(y.transpose(1, 2).reshape(B, n, -1)), (k, v)

class Decoder(nn.Module):
    """Llama-style decoder returning final-normed hidden states ``[B, T, H]``.

    Parameters are initialised by ``init_weights(generator)``: normal(0, init_std),
    with residual output projections (``attn.out``, ``mlp.down``) scaled by
    ``1 / sqrt(2 * n_layers)``; norms at one. Submodules are created uninitialised, so
    the only random draws are these, from ``generator`` (the global RNG only when no
    generator is given). Use ``build_model`` for a seeded, deterministic model.
    """

    def __init__(
        self, cfg: ModelConfig, vocab_size: int, *, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ModelError(f"vocab_size must be >= 1; got {vocab_size}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed = skip_init(nn.Embedding, vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = (
            None
            if cfg.tie_embeddings
            else skip_init(nn.Linear, cfg.d_model, vocab_size, bias=False)
        )
        self.lora: LoRAConfig | None = None  # set by ``with_lora`` (H4)
        self.initial_weights_sha256: str | None = None  # the frozen base's, under LoRA
        self.init_weights(generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.embed.weight, 0.0, std, generator=generator)
        for block in self.layers:
            nn.init.normal_(block.attn.qkv.weight, 0.0, std, generator=generator)
            nn.init.normal_(block.attn.out.weight, 0.0, residual_std, generator=generator)
            nn.init.normal_(block.mlp.gate_up.weight, 0.0, std, generator=generator)
            nn.init.normal_(block.mlp.down.weight, 0.0, residual_std, generator=generator)
            nn.init.ones_(block.attn_norm.weight)
            nn.init.ones_(block.mlp_norm.weight)
        nn.init.ones_(self.final_norm.weight)
        if self.head is not None:
            nn.init.normal_(self.head.weight, 0.0, std, generator=generator)

    @property
    def head_weight(self) -> torch.Tensor:
        """``[V, H]``; the embedding Parameter itself when tied (U6 counts it once)."""
        return self.embed.weight if self.head is None else self.head.weight

    def forward(self, batch: Batch, visibility: Visibility | None = None) -> torch.Tensor:
        """Hidden states ``[B, T, H]`` after the final RMSNorm; not logits (the loss fuses
        the head, L1).

        Visibility comes from ``batch.segment_ids``, ``segments`` and ``causal`` only,
        positions from ``batch.position_ids`` (R2, R3); shifting every position of a
        segment by a constant changes nothing (RoPE reads ``pos_i - pos_j``).

        ``visibility`` may be passed to reuse one prepared for the same batch;
        otherwise it is prepared here once and shared by all layers. With
        ``model.activation_checkpointing``, in training mode with gradients on, each
        block is recomputed in the backward instead of keeping its activations (H5).
        """
        x = self.embed(batch.input_ids)  # [B, T, H]
        head_dim = self.cfg.d_model // self.cfg.n_heads
        if visibility is None:
            visibility = prepare_visibility(batch, self.cfg.attention, x.device,
                                            head_dim=head_dim)
        cos, sin = rope_tables(
            batch.position_ids.to(x.device),
            head_dim,
            self.cfg.rope_theta,
        )  # [B, T, 1, Dh]
        recompute = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.layers:
            if recompute:  # H5: keep the block's input only; rerun it in the backward
                x = checkpoint(block, x, cos, sin, visibility, use_reentrant=False)
            else:
                x = block(x, cos, sin, visibility)
        return self.final_norm(x)  # [B, T, H]

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: list | None = None, *,
                    positions: torch.Tensor | None = None, keys: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, list]:
        """Incremental decoding for rows of one causal segment each (the sampler's):
        ``tokens [B, n]`` continue the rows ``cache`` holds (``None``: from column 0)
        and attend to every cached key and causally among themselves. Returns the new
        tokens' final-normed hidden states ``[B, n, H]`` and the cache with their keys
        and values appended (per layer, rotated keys and values ``[B, nH, T, Dh]``).

        Rows of different lengths, left-padded (``sample_window``): ``positions
        [B, n]`` are the new tokens' positions within their rows (a padded row's
        first real token at 0) and ``keys [B, T + n]`` marks every column, cached and
        new, that holds a real token; a query sees only real keys (``step_tables``).

        The same computation as ``forward`` on the whole rows, column by column
        (equal within float rounding: the matrix shapes differ); without gradients.
        """
        start = 0 if cache is None else cache[0][0].shape[2]
        cos, sin, mask = step_tables(tokens, start, self.cfg, positions, keys)
        x = self.embed(tokens)  # [B, n, H]
        out = []
        for i, block in enumerate(self.layers):
            y, kv = cached_self_attention(block.attn, block.attn_norm(x), cos, sin, mask,
                                          None if cache is None else cache[i])
            out.append(kv)
            x = x + y
            x = x + block.mlp(block.mlp_norm(x))
        return self.final_norm(x), out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, H] -> [B, T, V]``. For evaluation and tests; training fuses the head (L1)."""
        return F.linear(hidden, head_for_loss(self))  # a tensor-parallel head gathered

    def num_parameters(self) -> int:
        """Unique parameters; a tied embedding/head is counted once."""
        return sum(p.numel() for p in self.parameters())

    def check_rows(self, seq_len: int) -> None:
        """Rows of any length are exact here (RoPE is computed for any position)."""

    def describe(self) -> dict | None:
        """The manifest's ``model`` section (S1): with LoRA, ``{"source": "builtin",
        "lora": ...}`` (the base's digest, the adapters' size, peft's version: H4), so a
        resume onto another base is refused naming ``model.lora.base_weights_sha256``
        (S4); without, ``None`` (the configuration describes the model whole)."""
        if self.lora is None:
            return None
        return {"source": "builtin", "lora": lora_section(self, self.initial_weights_sha256)}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds (S2): with LoRA the adapters only (the base is rebuilt
        from the seed and pinned by its digest, H4); else the whole state dict."""
        return self.state_dict() if self.lora is None else adapter_state(self)

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``checkpoint_state``'s tensors (``load_adapter_state`` under LoRA)."""
        if self.lora is None:
            self.load_state_dict(state)
        else:
            load_adapter_state(self, state)


def build_model(cfg: ModelConfig, vocab_size: int, *, seed: int,
                seq_len: int | None = None) -> nn.Module:
    """The model ``cfg`` declares, whose weights depend only on ``(cfg, vocab_size, seed)``.

    ``model.source = "builtin"``: the built-in ``Decoder``, initialised from a private
    ``torch.Generator``. ``"hf"``: a Hugging Face causal LM behind the same interface
    (``exactstep.model.hf.build_hf_model``: loaded from ``model.path`` or random-init
    from ``model.hf_config``; ``seq_len``, the run's ``batch.seq_len``, is what
    ``attn_implementation = "auto"`` weighs windows against). Either way the global
    RNG state is left untouched (S5).
    """
    if cfg.source == "hf":
        return build_hf_model(cfg, vocab_size, seed=seed, seq_len=seq_len)
    generator = torch.Generator().manual_seed(seed)
    decoder = Decoder(cfg, vocab_size, generator=generator)
    if cfg.lora.enabled:
        with_lora(decoder, cfg.lora, seed=seed)
    return decoder


def with_lora(decoder: Decoder, lora: LoRAConfig, *, seed: int) -> None:
    """Put peft's LoRA adapters on ``decoder`` in place (H4): its class, forward and
    ``head_weight`` stay; every base tensor is frozen and the adapters are the only
    trainable parameters (U6); their init comes from ``seed`` only (S5). ``all-linear``
    is every block's linear layer (``qkv``, ``out``, ``gate_up``, ``down``), never the
    head; a target whose weight is the head (``head``, or ``embed`` when tied) is
    refused: the loss fuses the plain head weight (L1). The base's digest is kept for
    the manifest (``describe``)."""
    decoder.initial_weights_sha256 = weights_digest(decoder)
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in decoder.layers.named_modules()
                     if isinstance(module, nn.Linear)})
    targets = linear if lora.targets == "all-linear" else lora.targets
    try:
        with adapting(seed):
            inject_adapters(lora_config(lora, targets), decoder)
    except ModelError as exc:
        raise ModelError(f"{exc}; the built-in decoder's linear layers are "
                         f"{', '.join(linear)}") from None
    if adapted(decoder.head) or (decoder.head is None and adapted(decoder.embed)):
        raise ModelError(HEAD_TARGETED)
    decoder.lora = lora


def refuse_checkpointing(cfg: ModelConfig, model: str) -> None:
    """A ``ConfigError`` naming ``model.activation_checkpointing`` when it is set for a
    model that does not recompute its blocks (H5: the flag is never a silent no-op)."""
    if cfg.activation_checkpointing:
        raise ConfigError(
            f"model.activation_checkpointing = true is not available for {model}; set "
            "model.activation_checkpointing = false"
        )


def refuse_lora(cfg: ModelConfig, model: str) -> None:
    """A ``ConfigError`` naming ``model.lora.r`` when adapters are asked of a model that
    takes none (H4: ``model.lora`` is never a silent no-op)."""
    if cfg.lora.enabled:
        raise ConfigError(
            f"model.lora.r = {cfg.lora.r} (LoRA adapters) is not available for {model}; set "
            "model.lora.r = 0"
        )


def model_note(model: nn.Module) -> str | None:
    """What the run's rank 0 says once about how ``model`` was built (a Hugging Face
    model's ``attn_implementation = "auto"`` fallback), or None."""
    return getattr(model, "backend_note", None)


def activation_bytes(model: nn.Module, tokens: int, vocab_size: int) -> tuple[int, int]:
    """``(widest, kept)``: the fp32 bytes of ``model``'s largest per-layer activation for
    a micro-batch of ``tokens`` tokens (its widest linear projection, the vocabulary
    head aside: the loss chunks its logits, L1) and of one ``[tokens, d_model]`` tensor
    (a layer's input: what activation checkpointing keeps per layer). For the host
    allocator's threshold (``run.host_memory.threshold_for``)."""
    widths = [max(m.in_features, m.out_features) for m in model.modules()
              if isinstance(m, nn.Linear) and vocab_size not in (m.in_features, m.out_features)]
    hidden = [m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)]
    widest = max(widths, default=0)
    return 4 * tokens * widest, 4 * tokens * (hidden[0] if hidden else widest)


def model_section(model: nn.Module) -> dict | None:
    """The manifest's ``model`` section (S1) for ``model``: its ``describe()`` (a Hugging
    Face model's resolved architecture, initial weights and library version), or
    ``None`` for the built-in decoder, which its configuration describes whole."""
    describe = getattr(model, "describe", None)
    return describe() if callable(describe) else None
