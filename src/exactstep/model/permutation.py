"""Two-stream attention over natural positions: the permutation-LM model (XLNet-style, R8).

``TwoStreamDecoder`` runs the built-in decoder's weights on a content stream and a
query stream; ``forward`` returns the query stream, where column ``i`` predicts its
own token from the tokens before it in its segment's factorisation order. Visibility
depends only on ``segment_ids`` and ``order`` (R2) and is one dense mask, so
``model.attention`` must be ``auto`` or ``dense``.
Design and derivations: docs/design/model.md#modelpermutationpy (R8, R2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from exactstep.errors import ConfigError, ModelError
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import (
    Block,
    Decoder,
    apply_rope,
    refuse_checkpointing,
    refuse_lora,
    rope_tables,
)
from exactstep.rows.batch import Batch

#: The attention settings this model honours (both mean its dense two-stream masks).
ATTENTION = ("auto", "dense")


@dataclass(frozen=True)
class StreamMasks:
    """Both streams' visibility for one forward, shared by all layers.

    ``mask`` ``[B, 1, 2T, T]`` bool: rows ``0..T-1`` are the content queries, rows
    ``T..2T-1`` the query-stream queries, columns the content keys. ``live`` ``[B, 2T,
    1]`` bool: the row sees at least one key. A row that sees none has its own
    column switched on in ``mask`` (so SDPA stays finite) and its output zeroed by
    ``live``, so that column never reaches it.
    """

    mask: torch.Tensor
    live: torch.Tensor


def visibility(segment_ids: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(content [B, T, T], query [B, T, T])`` bool: may query ``i`` read key ``j``?

    ``content[b, i, j]`` iff ``i`` and ``j`` share a real segment and ``order[j] <=
    order[i]``, or ``i == j`` is padding; ``query[b, i, j]`` iff they share a real
    segment and ``order[j] < order[i]``.
    """
    seg_i, seg_j = segment_ids[:, :, None], segment_ids[:, None, :]  # [B, T, 1], [B, 1, T]
    same = (seg_i == seg_j) & (seg_i > 0)  # [B, T, T]
    rank_i, rank_j = order[:, :, None], order[:, None, :]
    T = segment_ids.shape[1]
    eye = torch.eye(T, dtype=torch.bool, device=segment_ids.device)  # [T, T]
    content = (same & (rank_j <= rank_i)) | (eye & (seg_i == 0))
    return content, same & (rank_j < rank_i)


def stream_masks(batch: Batch, device: torch.device | str) -> StreamMasks:
    """The ``StreamMasks`` of ``batch`` on ``device``; ``ModelError`` without an order."""
    if batch.order is None:
        raise ModelError(
            "the two-stream model needs Batch.order (a permutation-LM batch); this batch "
            "has none: train it with objective.family = 'permutation'"
        )
    content, query = visibility(batch.segment_ids.to(device), batch.order.to(device))
    return masks_from(content, query)


def masks_from(content: torch.Tensor, query: torch.Tensor) -> StreamMasks:
    """``StreamMasks`` from the two ``[B, T, T]`` visibilities (``visibility``)."""
    both = torch.cat([content, query], dim=1)  # [B, 2T, T]
    live = both.any(dim=-1, keepdim=True)  # [B, 2T, 1]
    T = content.shape[1]
    eye = torch.eye(T, dtype=torch.bool, device=content.device).repeat(2, 1)  # [2T, T]
    return StreamMasks(mask=(both | (eye & ~live))[:, None], live=live)


class TwoStreamBlock(nn.Module):
    """One decoder ``Block``'s weights (the same modules, the same names) run on both
    streams: ``x = [h; g]`` ``[B, 2T, H]`` in, the same out; the content rows project
    q, k and v, the query rows only q (see ``TwoStreamDecoder``)."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.attn_norm = block.attn_norm
        self.attn = block.attn
        self.mlp_norm = block.mlp_norm
        self.mlp = block.mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, masks: StreamMasks
    ) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), cos, sin, masks)  # [B, 2T, H]
        return x + self.mlp(self.mlp_norm(x))  # [B, 2T, H]

    def attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, masks: StreamMasks
    ) -> torch.Tensor:
        """Both streams' attention: content rows project q, k, v; query rows only q."""
        attn = self.attn
        B, T2, H = x.shape
        T, nH, Dh = T2 // 2, attn.n_heads, attn.head_dim
        content, stream = x[:, :T], x[:, T:]  # [B, T, H] each
        qkv = attn.qkv(content).view(B, T, 3, nH, Dh)  # [B, T, 3, nH, Dh]
        qkv = apply_rope(qkv, cos, sin)  # values unchanged
        q_g = F.linear(stream, attn.qkv.weight[:H]).view(B, T, nH, Dh)  # [B, T, nH, Dh]
        q_g = apply_rope(q_g, cos[:, :, 0], sin[:, :, 0])  # the query's own position
        q = torch.cat([qkv[:, :, 0], q_g], dim=1).transpose(1, 2)  # [B, nH, 2T, Dh]
        k = qkv[:, :, 1].transpose(1, 2)  # [B, nH, T, Dh]
        v = qkv[:, :, 2].transpose(1, 2)  # [B, nH, T, Dh]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.mask)  # [B, nH, 2T, Dh]
        y = y.transpose(1, 2).reshape(B, T2, H)  # [B, 2T, H]
        y = torch.where(masks.live, y, torch.zeros((), dtype=y.dtype, device=y.device))
        return attn.out(y)  # [B, 2T, H]


class TwoStreamDecoder(Decoder):
    """The permutation-LM model (R8). ``forward(batch) -> [B, T, H]``: the query stream's
    final-normed hidden states, aligned with ``batch.labels``.

    The content stream starts from the token embeddings and sees its segment's keys
    with ``order[j] <= order[i]``; the query stream starts from the learned ``query``
    and sees content keys with ``order[j] < order[i]``, never its own token. A row
    with no visible key outputs exactly zero. Needs ``Batch.order`` (else
    ``ModelError``); same decoder weights as ``build_model`` for the same seed.
    """

    def __init__(
        self, cfg: ModelConfig, vocab_size: int, *, generator: torch.Generator | None = None
    ) -> None:
        refuse_checkpointing(cfg, "the two-stream model (objective.family = 'permutation')")
        refuse_lora(cfg, "the two-stream model (objective.family = 'permutation')")
        super().__init__(cfg, vocab_size, generator=generator)  # the decoder's draws first
        self.layers = nn.ModuleList(TwoStreamBlock(block) for block in self.layers)
        self.query = nn.Parameter(torch.empty(cfg.d_model))
        with torch.no_grad():
            nn.init.normal_(self.query, 0.0, cfg.init_std, generator=generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """The decoder's initialisation, then ``query`` ~ normal(0, init_std)."""
        super().init_weights(generator)
        if hasattr(self, "query"):
            nn.init.normal_(self.query, 0.0, self.cfg.init_std, generator=generator)

    def forward(self, batch: Batch, masks: StreamMasks | None = None) -> torch.Tensor:
        """The query stream's hidden states ``[B, T, H]`` (``masks`` may be passed to
        reuse, or in tests to replace, the batch's own)."""
        return self.streams(batch, masks)[1]

    def query_start(self, content: torch.Tensor) -> torch.Tensor:
        """The query stream's input ``[B, T, H]``: ``query`` at every column, never the
        token embedding of that column (``content`` gives only shape and dtype)."""
        return self.query.to(content.dtype).expand(content.shape)

    def streams(
        self, batch: Batch, masks: StreamMasks | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(content, query)``: both streams' final-normed hidden states ``[B, T, H]``."""
        h = self.embed(batch.input_ids)  # [B, T, H]
        B, T, H = h.shape
        if masks is None:
            masks = stream_masks(batch, h.device)
        g = self.query_start(h)  # [B, T, H]
        cos, sin = rope_tables(batch.position_ids.to(h.device), H // self.cfg.n_heads,
                               self.cfg.rope_theta)  # [B, T, 3, 1, Dh]
        x = torch.cat([h, g], dim=1)  # [B, 2T, H]
        for block in self.layers:
            x = block(x, cos, sin, masks)
        x = self.final_norm(x)
        return x[:, :T], x[:, T:]


def build_two_stream(cfg: ModelConfig, vocab_size: int, *, seed: int) -> TwoStreamDecoder:
    """The permutation-LM model, weights depending only on ``(cfg, vocab_size, seed)``
    (a private generator: the global RNG is untouched, S5). Its decoder weights equal
    ``model.decoder.build_model``'s for the same arguments.

    ``ConfigError`` for ``model.source = "hf"`` (the two streams are built from the
    built-in blocks) and for a ``model.attention`` other than ``auto``/``dense``.
    """
    if cfg.source != "builtin":
        raise ConfigError(
            "objective.family = 'permutation' trains the built-in two-stream decoder; set "
            "model.source = 'builtin'"
        )
    if cfg.attention not in ATTENTION:
        raise ConfigError(
            f"objective.family = 'permutation' realises its two attention streams with "
            f"dense masks; model.attention = {cfg.attention!r} does not apply: set "
            "model.attention = 'auto' or 'dense'"
        )
    generator = torch.Generator().manual_seed(seed)
    return TwoStreamDecoder(cfg, vocab_size, generator=generator)
