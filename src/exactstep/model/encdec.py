"""The built-in encoder-decoder (R8: encoder-decoder teacher forcing, T5 span corruption).

The encoder reads ``batch.source`` bidirectionally within each source segment; the
decoder is causal within each target segment and cross-attends only to its own
example's source segment. ``forward`` returns decoder hidden states aligned with
``batch.labels`` (R1) for the fused loss (L1); weights depend only on ``(cfg, vocab,
seed)`` (S5). ``greedy_decode`` answers sources for evaluation.
Design and derivations: docs/design/model.md#modelencdecpy (R8, R1, L1, S5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from exactstep.errors import ConfigError, ModelError
from exactstep.model.attention import Visibility, choose_buckets, prepare_visibility
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import (
    Attention,
    Block,
    SwiGLU,
    cached_self_attention,
    refuse_checkpointing,
    refuse_lora,
    rope_tables,
    step_tables,
)
from exactstep.rows.batch import (
    IGNORE_INDEX,
    Batch,
    SourceSide,
    single_segment_batch,
    source_rows,
)
from exactstep.rows.transfer import host_to_device

CROSS_IMPLEMENTATIONS = ("dense", "pairs")


# ----------------------------------------------------------------- cross visibility


@dataclass(frozen=True)
class _PairBucket:
    """``count`` (decoder segment, encoder segment) pairs at padded lengths (Lq, Lk)."""

    count: int
    q_len: int
    k_len: int
    q_index: torch.Tensor  # [count * q_len] rows of the [B*T] decoder positions
    k_index: torch.Tensor  # [count * k_len] rows of the [B*S] encoder positions
    key_mask: torch.Tensor  # [count, 1, 1, k_len] bool, True = a real key


@dataclass(frozen=True)
class CrossVisibility:
    """Which encoder positions each decoder position attends to, built once per forward
    (``prepare_cross_visibility``) and shared by every decoder layer."""

    impl: str  # "dense" | "pairs"
    shape: tuple[int, int, int]  # (B, T, S)
    dense_mask: torch.Tensor | None = None  # [B, 1, T, S] bool (padding queries: all)
    has_key: torch.Tensor | None = None  # [B, T, 1, 1] bool: the query sees some key
    buckets: tuple[_PairBucket, ...] = ()
    output_of: torch.Tensor | None = None  # [B*T] slot of each decoder position, or none


def check_pairs(batch: Batch, source: SourceSide) -> None:
    """R8: decoder segment ``s`` and encoder segment ``s`` of each row are one example.

    Both sides must list the same number of segments per row, and each pair the same
    ``(example_id, piece)``; raises ``ModelError`` naming the row otherwise (host data:
    no device sync).
    """
    if len(batch.segments) != len(source.segments):
        raise ModelError(
            f"the decoder side has {len(batch.segments)} rows but the encoder side "
            f"{len(source.segments)}; compile both sides with the encdec compiler"
        )
    for b, (dec, enc) in enumerate(zip(batch.segments, source.segments, strict=True)):
        if len(dec) != len(enc):
            raise ModelError(
                f"row {b}: {len(dec)} decoder segments but {len(enc)} encoder segments; "
                "decoder segment s cross-attends to encoder segment s of the same row"
            )
        for s, (d, e) in enumerate(zip(dec, enc, strict=True), start=1):
            if (d.example_id, d.piece) != (e.example_id, e.piece):
                raise ModelError(
                    f"row {b} segment {s}: decoder example {d.example_id} piece {d.piece} "
                    f"is paired with encoder example {e.example_id} piece {e.piece}"
                )


def dense_cross_mask(dec_segment_ids: torch.Tensor, src_segment_ids: torch.Tensor
                     ) -> torch.Tensor:
    """The reference ``[B, 1, T, S]``: query ``(b, i)`` sees key ``(b, j)`` iff
    ``dec_segment_ids[b, i] == src_segment_ids[b, j] != 0``."""
    q = dec_segment_ids[:, :, None]  # [B, T, 1]
    k = src_segment_ids[:, None, :]  # [B, 1, S]
    return ((q == k) & (q != 0))[:, None]  # [B, 1, T, S]


def prepare_cross_visibility(batch: Batch, source: SourceSide, impl: str,
                             device: torch.device) -> CrossVisibility:
    """The cross-attention visibility of ``batch`` (decoder side) over ``source``.

    ``impl``: ``"dense"`` (the reference mask) or ``"pairs"`` (per-pair SDPA over
    length buckets). Raises ``ModelError`` for an unknown ``impl`` or sides that do
    not pair up (``check_pairs``).
    """
    if impl not in CROSS_IMPLEMENTATIONS:
        raise ModelError(f"cross-attention must be one of {CROSS_IMPLEMENTATIONS}; got {impl!r}")
    check_pairs(batch, source)
    B, T = batch.shape
    S = source.shape[1]
    if impl == "dense":
        mask = dense_cross_mask(host_to_device(batch.segment_ids, device),
                                host_to_device(source.segment_ids, device))
        has_key = mask.any(dim=-1, keepdim=True)  # [B, 1, T, 1]
        # a query with no key (decoder padding) sees every key; its output is zeroed
        return CrossVisibility("dense", (B, T, S), dense_mask=mask | ~has_key,
                               has_key=has_key.permute(0, 2, 1, 3))  # [B, T, 1, 1]
    return _prepare_pairs(batch, source, device)


def _prepare_pairs(batch: Batch, source: SourceSide, device: torch.device) -> CrossVisibility:
    B, T = batch.shape
    S = source.shape[1]
    pairs = [(b * T + d.start, d.length, b * S + e.start, e.length)
             for b, (dec, enc) in enumerate(zip(batch.segments, source.segments, strict=True))
             for d, e in zip(dec, enc, strict=True) if d.length]
    output_of = np.full(B * T, -1, dtype=np.int64)
    buckets: list[_PairBucket] = []
    offset = 0
    if pairs:
        table = np.asarray(pairs, dtype=np.int64)  # [n, 4]: q0, Lq, k0, Lk
        lengths = choose_buckets(table[:, 1].tolist())
        which = np.searchsorted(lengths, table[:, 1])
        for bi, q_len in enumerate(lengths):
            members = table[which == bi]
            if not len(members):
                continue
            k_len = int(members[:, 3].max())
            q0, n_q, k0, n_k = members.T
            q_cols, k_cols = np.arange(q_len), np.arange(k_len)
            q_real = q_cols[None, :] < n_q[:, None]  # [n, Lq]
            k_real = k_cols[None, :] < n_k[:, None]  # [n, Lk]
            q_read = np.where(q_real, q0[:, None] + q_cols, q0[:, None])  # pad: first row
            k_read = np.where(k_real, k0[:, None] + k_cols, k0[:, None])
            slots = offset + np.arange(len(members) * q_len).reshape(len(members), q_len)
            output_of[(q0[:, None] + q_cols)[q_real]] = slots[q_real]
            buckets.append(_PairBucket(
                count=len(members), q_len=int(q_len), k_len=k_len,
                q_index=_index(q_read, device), k_index=_index(k_read, device),
                key_mask=host_to_device(torch.from_numpy(k_real[:, None, None, :]), device)))
            offset += len(members) * q_len
    output_of[output_of < 0] = offset  # decoder padding reads the zero row
    return CrossVisibility("pairs", (B, T, S), buckets=tuple(buckets),
                           output_of=_index(output_of, device))


def _index(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return host_to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64).reshape(-1)),
                          device)


def cross_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: CrossVisibility
                 ) -> torch.Tensor:
    """``q [B, T, nH, Dh]``, ``k, v [B, S, nH, Dh]`` -> ``[B, T, nH, Dh]`` under ``vis``.

    A query with no visible key (decoder padding) gets exactly 0, with exactly zero
    gradient to every key and value.
    """
    B, T, nH, Dh = q.shape
    if (B, T, k.shape[1]) != vis.shape:
        raise ModelError(f"cross-attention inputs {(B, T, k.shape[1])} but the visibility was "
                         f"prepared for {vis.shape}; prepare it from the same batch")
    if vis.impl == "dense":
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=vis.dense_mask
        ).transpose(1, 2)  # [B, T, nH, Dh]
        return torch.where(vis.has_key, out, 0.0)
    q_flat = q.reshape(B * T, nH, Dh)
    k_flat, v_flat = (x.reshape(-1, nH, Dh) for x in (k, v))
    results = []
    for bucket in vis.buckets:
        n, lq, lk = bucket.count, bucket.q_len, bucket.k_len
        qb = q_flat.index_select(0, bucket.q_index).view(n, lq, nH, Dh).transpose(1, 2)
        kb = k_flat.index_select(0, bucket.k_index).view(n, lk, nH, Dh).transpose(1, 2)
        vb = v_flat.index_select(0, bucket.k_index).view(n, lk, nH, Dh).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bucket.key_mask)
        results.append(out.transpose(1, 2).reshape(n * lq, nH, Dh))
    results.append(q.new_zeros((1, nH, Dh)))  # what a query with no key reads
    return torch.cat(results).index_select(0, vis.output_of).view(B, T, nH, Dh)


# ----------------------------------------------------------------------- layers


class CrossAttention(nn.Module):
    """Queries from the decoder stream, keys and values from the encoder output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = skip_init(nn.Linear, cfg.d_model, cfg.d_model, bias=False)
        self.kv = skip_init(nn.Linear, cfg.d_model, 2 * cfg.d_model, bias=False)
        self.out = skip_init(nn.Linear, cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, vis: CrossVisibility
                ) -> torch.Tensor:
        B, T, H = x.shape
        S = memory.shape[1]
        q = self.q(x).view(B, T, self.n_heads, self.head_dim)  # [B, T, nH, Dh]
        k, v = self.kv(memory).view(B, S, 2, self.n_heads, self.head_dim).unbind(2)
        y = cross_attend(q, k, v, vis)  # [B, T, nH, Dh]
        return self.out(y.reshape(B, T, H))  # [B, T, H]


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention, cross-attention and SwiGLU, each residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.cross_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.cross = CrossAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, vis: Visibility,
                memory: torch.Tensor, cross: CrossVisibility) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, vis)  # [B, T, H]
        x = x + self.cross(self.cross_norm(x), memory, cross)  # [B, T, H]
        return x + self.mlp(self.mlp_norm(x))  # [B, T, H]


# ------------------------------------------------------------------------ model


class EncoderDecoder(nn.Module):
    """The built-in encoder-decoder (R8); ``forward(batch) -> [B, T, H]`` decoder hidden
    states aligned with ``batch.labels`` (R1), for the fused loss (L1).

    Decoder segment ``s`` of a row cross-attends only to encoder segment ``s`` of the
    same row, which must be the same example (``check_pairs``, else ``ModelError``);
    a decoder padding query's cross-attention output is exactly 0.

    ``encoder_layers`` / ``decoder_layers`` default to ``cfg.n_layers``.
    ``share_embeddings`` (default) uses one table for both sides; ``source_vocab_size``
    (default ``vocab_size``) sizes a separate source table and implies
    ``share_embeddings = False`` when it differs. ``cfg.tie_embeddings`` ties the head
    to the target table. ``cross_attention``: ``"dense"`` or ``"pairs"``; default
    ``"dense"`` when ``cfg.attention = "dense"``, else ``"pairs"``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        *,
        generator: torch.Generator | None = None,
        encoder_layers: int | None = None,
        decoder_layers: int | None = None,
        share_embeddings: bool = True,
        source_vocab_size: int | None = None,
        cross_attention: str | None = None,
    ) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ModelError(f"vocab_size must be >= 1; got {vocab_size}")
        refuse_checkpointing(cfg, "the encoder-decoder model (objective.family = 'encdec')")
        refuse_lora(cfg, "the encoder-decoder model (objective.family = 'encdec')")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.source_vocab_size = source_vocab_size or vocab_size
        self.encoder_layers = encoder_layers or cfg.n_layers
        self.decoder_layers = decoder_layers or cfg.n_layers
        self.cross_impl = cross_attention or ("dense" if cfg.attention == "dense" else "pairs")
        if self.cross_impl not in CROSS_IMPLEMENTATIONS:
            raise ModelError(f"cross_attention must be one of {CROSS_IMPLEMENTATIONS}; "
                             f"got {self.cross_impl!r}")
        self.embed = skip_init(nn.Embedding, vocab_size, cfg.d_model)
        separate = not share_embeddings or self.source_vocab_size != vocab_size
        self.source_embed = (skip_init(nn.Embedding, self.source_vocab_size, cfg.d_model)
                             if separate else None)
        self.encoder = nn.ModuleList(Block(cfg) for _ in range(self.encoder_layers))
        self.encoder_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.decoder = nn.ModuleList(DecoderBlock(cfg) for _ in range(self.decoder_layers))
        self.final_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = (None if cfg.tie_embeddings
                     else skip_init(nn.Linear, cfg.d_model, vocab_size, bias=False))
        self.init_weights(generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, ``init_std``); residual output projections scaled by ``1 / sqrt(2 *
        encoder_layers)`` (encoder) and ``1 / sqrt(3 * decoder_layers)`` (decoder); norms
        at one. All draws from ``generator`` in a fixed order: embeddings, encoder,
        decoder, head (S5)."""
        std = self.cfg.init_std
        enc_std = std / math.sqrt(2 * self.encoder_layers)
        dec_std = std / math.sqrt(3 * self.decoder_layers)

        def normal(w: torch.Tensor, s: float) -> None:
            nn.init.normal_(w, 0.0, s, generator=generator)

        normal(self.embed.weight, std)
        if self.source_embed is not None:
            normal(self.source_embed.weight, std)
        for block in self.encoder:
            normal(block.attn.qkv.weight, std)
            normal(block.attn.out.weight, enc_std)
            normal(block.mlp.gate_up.weight, std)
            normal(block.mlp.down.weight, enc_std)
        for block in self.decoder:
            normal(block.attn.qkv.weight, std)
            normal(block.attn.out.weight, dec_std)
            normal(block.cross.q.weight, std)
            normal(block.cross.kv.weight, std)
            normal(block.cross.out.weight, dec_std)
            normal(block.mlp.gate_up.weight, std)
            normal(block.mlp.down.weight, dec_std)
        for module in self.modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        if self.head is not None:
            normal(self.head.weight, std)

    @property
    def head_weight(self) -> torch.Tensor:
        """``[V, H]``; the target embedding Parameter itself when tied (counted once)."""
        return self.embed.weight if self.head is None else self.head.weight

    @property
    def layers(self) -> list[nn.Module]:
        """Every block, encoder then decoder (what FSDP shards one by one, D4)."""
        return [*self.encoder, *self.decoder]

    @property
    def head_dim(self) -> int:
        return self.cfg.d_model // self.cfg.n_heads

    def encode(self, source: SourceSide) -> torch.Tensor:
        """Encoder output ``[B, S, H]`` (final-normed), bidirectional within each source
        segment; source padding rows hold their own (isolated) values."""
        table = self.embed if self.source_embed is None else self.source_embed
        device = table.weight.device
        x = table(source.input_ids.to(device))  # [B, S, H]
        vis = prepare_visibility(source_batch(source), self.cfg.attention, device,
                                 head_dim=self.head_dim)
        cos, sin = rope_tables(source.position_ids.to(device), self.head_dim,
                               self.cfg.rope_theta)
        for block in self.encoder:
            x = block(x, cos, sin, vis)
        return self.encoder_norm(x)  # [B, S, H]

    def decode(self, batch: Batch, memory: torch.Tensor, source: SourceSide) -> torch.Tensor:
        """Decoder hidden states ``[B, T, H]`` given the encoder output ``memory`` of
        ``source`` (e.g. encoded once for greedy decoding)."""
        device = memory.device
        x = self.embed(batch.input_ids.to(device))  # [B, T, H]
        vis = prepare_visibility(batch, self.cfg.attention, device, head_dim=self.head_dim)
        cross = prepare_cross_visibility(batch, source, self.cross_impl, device)
        cos, sin = rope_tables(batch.position_ids.to(device), self.head_dim, self.cfg.rope_theta)
        for block in self.decoder:
            x = block(x, cos, sin, vis, memory, cross)
        return self.final_norm(x)  # [B, T, H]

    def forward(self, batch: Batch) -> torch.Tensor:
        """Decoder hidden states ``[B, T, H]`` aligned with ``batch.labels``.

        Reads the encoder side from ``batch.source``; a padding microbatch without one
        (``meta["padding"]``, the distributed end of data) gets a padding source.
        Raises ``ModelError`` for a batch without an encoder side otherwise.
        """
        source = batch.source
        if source is None:
            if not batch.meta.get("padding"):
                raise ModelError(
                    "the encoder-decoder needs batch.source (the encoder side); compile the "
                    "rows with the encdec compiler (objective.family = 'encdec' or 'span')"
                )
            source = padding_source(batch)
        check_pairs(batch, source)  # before the encoder reads the segments
        return self.decode(batch, self.encode(source), source)

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: dict | None = None, *,
                    source: SourceSide | None = None, positions: torch.Tensor | None = None,
                    keys: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Incremental decoding for rows of one causal segment each, every row reading
        one source segment (the sampler's). The first call (``cache`` None) encodes
        ``source`` once and keeps each decoder layer's cross-attention keys and values;
        each call runs ``tokens [B, n]`` against the cached self-attention keys and
        values. Returns the new tokens' final-normed hidden states ``[B, n, H]`` and
        the cache.

        Sources of different lengths: right-padded (segment 0, as ``source_rows``
        pads them), each row's queries see its own source tokens only. Decoder rows of
        different lengths: left-padded, with ``positions`` and ``keys`` as
        ``Decoder.decode_step`` takes them (``model.decoder.step_tables``).

        The same computation as ``forward`` on the whole rows, column by column (equal
        within float rounding: the matrix shapes differ); without gradients.
        """
        if cache is None:
            if source is None or bool(((source.segment_ids != 1) & (source.segment_ids != 0))
                                      .any()) or bool((source.segment_ids[:, 0] != 1).any()):
                raise ModelError("decode_step needs a source of one segment per row (padding "
                                 "after it) on its first call")
            memory = self.encode(source)  # [B, S, H]
            B, S, _ = memory.shape
            cross = [block.cross.kv(memory).view(B, S, 2, self.cfg.n_heads, self.head_dim)
                     .unbind(2) for block in self.decoder]
            padded = bool((source.segment_ids == 0).any())
            cache = {"cross": [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in cross],
                     "self": None,  # [B, 1, 1, S]: each row's source tokens (None: all)
                     "source": (source.segment_ids.to(memory.device) == 1)[:, None, None, :]
                     if padded else None}
        past = cache["self"]
        start = 0 if past is None else past[0][0].shape[2]
        cos, sin, mask = step_tables(tokens, start, self.cfg, positions, keys)
        x = self.embed(tokens)  # [B, n, H]
        B, n, H = x.shape
        out = []
        for i, block in enumerate(self.decoder):
            y, kv = cached_self_attention(block.attn, block.attn_norm(x), cos, sin, mask,
                                          None if past is None else past[i])
            out.append(kv)
            x = x + y
            q = block.cross.q(block.cross_norm(x)).view(B, n, self.cfg.n_heads, self.head_dim)
            k, v = cache["cross"][i]  # each row's source keys (all, or its own tokens)
            z = F.scaled_dot_product_attention(q.transpose(1, 2), k, v,
                                               attn_mask=cache.get("source"))  # [B, nH, n, Dh]
            x = x + block.cross.out(z.transpose(1, 2).reshape(B, n, H))
            x = x + block.mlp(block.mlp_norm(x))
        return self.final_norm(x), {**cache, "self": out}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, H] -> [B, T, V]``. For evaluation and tests; training fuses the head (L1)."""
        return F.linear(hidden, self.head_weight)

    def num_parameters(self) -> int:
        """Unique parameters; a tied embedding/head is counted once."""
        return sum(p.numel() for p in self.parameters())

    def check_rows(self, seq_len: int) -> None:
        """Rows of any length are exact here (RoPE is computed for any position)."""


def source_batch(source: SourceSide) -> Batch:
    """The encoder side as a bidirectional ``Batch`` (what the self-attention reads)."""
    return Batch(input_ids=source.input_ids,
                 labels=torch.full_like(source.input_ids, IGNORE_INDEX),
                 position_ids=source.position_ids, segment_ids=source.segment_ids,
                 segments=source.segments, causal=False)


def padding_source(batch: Batch) -> SourceSide:
    """A padding microbatch's encoder side: its own rows (padding tokens, one segment
    each), so every decoder query has keys and nothing is supervised."""
    return SourceSide(batch.input_ids, batch.position_ids, batch.segment_ids, batch.segments)


def build_encoder_decoder(cfg: Any, vocab_size: int) -> EncoderDecoder:
    """The run's encoder-decoder: ``cfg.model`` sizes it, ``cfg.encdec`` (when the
    config has the section) gives the depths and the embedding sharing, and the
    weights come from a private generator seeded with ``cfg.seed`` (global RNG
    untouched, S5). Raises ``ConfigError`` unless ``model.source = "builtin"``."""
    if cfg.model.source != "builtin":
        raise ConfigError(
            f"objective.family = {cfg.objective.family!r} trains the built-in encoder-decoder; "
            "set model.source = 'builtin' (Hugging Face models are causal LMs here)"
        )
    encdec = getattr(cfg, "encdec", None)
    generator = torch.Generator().manual_seed(cfg.seed)
    return EncoderDecoder(
        cfg.model, vocab_size, generator=generator,
        encoder_layers=getattr(encdec, "encoder_layers", 0) or None,
        decoder_layers=getattr(encdec, "decoder_layers", 0) or None,
        share_embeddings=getattr(encdec, "share_embeddings", True),
    )


# ------------------------------------------------------------------ greedy decoding


@torch.no_grad()
def greedy_fragments(model: EncoderDecoder, sources: Sequence[Sequence[int]],
                     starts: Sequence[int], lengths: Sequence[int], *, start_id: int,
                     source_pad_id: int, device: torch.device | str = "cpu") -> list[list[int]]:
    """MASS's greedy reconstruction: for each source, ``lengths[i]`` argmax tokens
    decoded from ``start_id`` at decoder positions ``starts[i], starts[i] + 1, ...``
    (the fragment's own positions), one source at a time, without a KV cache. Runs
    under ``no_grad``; the caller chooses the model's mode and RNG isolation (E1)."""
    answers: list[list[int]] = []
    for source_ids, start, length in zip(sources, starts, lengths, strict=True):
        source = source_rows([source_ids], source_pad_id).map(lambda t: t.to(device))
        memory = model.encode(source)  # [1, S, H]
        tokens = torch.full((1, 1), start_id, dtype=torch.int64, device=device)
        for _ in range(length):
            batch = single_segment_batch(tokens)
            batch = replace(batch, position_ids=batch.position_ids + int(start))
            hidden = model.decode(batch, memory, source)  # [1, L, H]
            next_id = model.logits(hidden[:, -1:, :])[:, -1].argmax(dim=-1)  # [1]
            tokens = torch.cat([tokens, next_id[:, None]], dim=1)
        answers.append(tokens[0, 1:].tolist())
    return answers


@torch.no_grad()
def greedy_decode(model: EncoderDecoder, sources: Sequence[Sequence[int]], *, bos_id: int,
                  eos_id: int, source_pad_id: int, max_new_tokens: int,
                  device: torch.device | str = "cpu", batch_size: int = 64) -> list[list[int]]:
    """The greedy answer to each source: decoded from ``[BOS]``, one argmax token per
    step, without a KV cache, each answer cut before its first ``EOS`` (an answer
    that never ends within ``max_new_tokens`` gets a trailing ``-1``, so it matches no
    target). The source is encoded once per chunk of ``batch_size``; sources of
    different lengths share a chunk (padding is never attended). Runs under
    ``no_grad``; the caller chooses the model's mode and RNG isolation (E1)."""
    answers: list[list[int]] = []
    for start in range(0, len(sources), batch_size):
        chunk = sources[start:start + batch_size]
        source = source_rows(chunk, source_pad_id).map(lambda t: t.to(device))
        memory = model.encode(source)  # [G, S, H]
        tokens = torch.full((len(chunk), 1), bos_id, dtype=torch.int64, device=device)
        finished = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            hidden = model.decode(single_segment_batch(tokens), memory, source)  # [G, L, H]
            next_ids = model.logits(hidden[:, -1:, :])[:, -1].argmax(dim=-1)  # [G]
            next_ids = torch.where(finished, torch.full_like(next_ids, eos_id), next_ids)
            tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
            finished |= next_ids == eos_id
            if bool(finished.all()):
                break
        for row in tokens[:, 1:].tolist():
            answers.append(row[: row.index(eos_id)] if eos_id in row else row + [-1])
    return answers
