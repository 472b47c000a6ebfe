"""Training from prepared shards: a document table over memory maps (P2, R4, D3, S1).

``PreparedDocuments`` is the ``DocumentTable`` the packing planner reads: lengths,
targets and tokens come from memory maps, and each epoch's order is the block order
declared in ``prepared.json``, computed lazily, so the planner never holds the
corpus. ``load_prepared_bundle`` refuses a directory that does not match the run.
Design and derivations: docs/design/rows.md#rowspreparedpy (P2, R4, D3, S1, L3).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from exactstep.data.prepared import PreparedSplit, open_prepared
from exactstep.errors import ConfigError, DataError
from exactstep.rows import kernels
from exactstep.rows.chat import ChatPolicy
from exactstep.rows.config import run_section
from exactstep.rows.example import WEIGHTED_REDUCTIONS, DataBundle, Example

ORDER_RULE = "block-permutation"


class BlockOrder(Sequence[int]):
    """One epoch's document order for one rank; O(blocks) memory.

    Blocks of ``block`` consecutive ids are visited in
    ``default_rng([seed, epoch]).permutation(blocks)``, the documents of block ``b``
    in ``b * block + default_rng([seed, epoch, b]).permutation(size_b)``; rank ``r``
    of ``world`` takes positions ``r, r + world, ...`` (D3). Without ``shuffle`` the
    order is the identity. Design: docs/design/rows.md#rowspreparedpy.
    """

    def __init__(self, documents: int, block: int, seed: int, epoch: int, *,
                 shuffle: bool, rank: int, world: int) -> None:
        self.documents, self.block, self.seed, self.epoch = documents, block, seed, epoch
        self.shuffle, self.rank, self.world = shuffle, rank, world
        blocks = -(-documents // block)
        self.blocks = (np.random.default_rng([seed, epoch]).permutation(blocks) if shuffle
                       else np.arange(blocks))
        sizes = np.minimum(block, documents - self.blocks * block)
        self.starts: list[int] = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self._cached: tuple[int, np.ndarray] | None = None
        self._length = len(range(rank, documents, world))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._length))]
        if not 0 <= i < self._length:
            raise IndexError(i)
        return self.at(self.rank + i * self.world)

    def at(self, position: int) -> int:
        """The document id at ``position`` of the whole epoch order (all ranks)."""
        slot = bisect.bisect_right(self.starts, position) - 1
        block = int(self.blocks[slot])
        within = position - self.starts[slot]
        if not self.shuffle:
            return block * self.block + within
        return block * self.block + int(self.permutation(slot)[within])

    def permutation(self, slot: int) -> np.ndarray:
        """The in-block permutation of the ``slot``-th block visited (the last one is
        cached: a window or a run of ``at`` stays in one block for a while)."""
        block = int(self.blocks[slot])
        if self._cached is None or self._cached[0] != block:
            size = self.starts[slot + 1] - self.starts[slot]
            perm = np.random.default_rng([self.seed, self.epoch, block]).permutation(size)
            self._cached = (block, perm)
        return self._cached[1]

    def window(self, start: int, stop: int) -> np.ndarray:
        """``self[start:stop]`` as int64, computed a block at a time (same ids as ``at``)."""
        stop = min(stop, self._length)
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        positions = self.rank + np.arange(start, stop, dtype=np.int64) * self.world
        if not self.shuffle:
            return positions  # the identity order
        out = np.empty_like(positions)
        first = bisect.bisect_right(self.starts, int(positions[0])) - 1
        last = bisect.bisect_right(self.starts, int(positions[-1])) - 1
        for slot in range(first, last + 1):
            lo, hi = np.searchsorted(positions, self.starts[slot: slot + 2])
            if lo == hi:
                continue
            base = int(self.blocks[slot]) * self.block
            out[lo:hi] = base + self.permutation(slot)[positions[lo:hi] - self.starts[slot]]
        return out


class PreparedDocuments(Sequence[Example]):
    """One prepared split as the planner's ``DocumentTable`` (P2): memory-mapped, lazy.

    ``example_id`` of document ``d`` is ``d`` (its global id in the split, R6). As a
    ``Sequence`` it builds each ``Example`` only when indexed or iterated. The planner
    and the causal compiler read it in bulk instead (``columns``: a window of the
    index; ``piece_slices``: a batch's pieces), with the same values.

    The causal compiler reads the memory maps themselves (``kernel_maps``).
    """

    def __init__(self, split: PreparedSplit, block: int,
                 unigram: np.ndarray | None = None) -> None:
        self.split = split
        self.block = block
        self.unigram = unigram
        self.lengths = _Column(split, 1)
        self.targets = _Column(split, 2)
        self.min_length = split.min_length
        self._starts = np.asarray(split.starts, dtype=np.int64)
        self._chat = any(s.owned is not None for s in split.shards)
        self.plain = not self._chat  # every token but the first is a target (text)
        self._maps: ShardMaps | None = None

    def __getstate__(self) -> dict:
        """Pickled without ``kernel_maps`` (built again on use)."""
        return {**self.__dict__, "_maps": None}

    def kernel_maps(self) -> ShardMaps | None:
        """The shards' memory maps as the causal kernel reads them (built once), or
        ``None`` when the shards' token types differ (then NumPy slices them)."""
        if self._maps is None:
            self._maps = ShardMaps(self.split)
        return self._maps if self._maps.table is not None else None

    def __len__(self) -> int:
        return self.split.documents

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.split.documents))]
        if not 0 <= index < self.split.documents:
            raise IndexError(index)
        tokens, owned = self.split.tokens(index)
        return Example(example_id=index, tokens=tokens, owned=owned)

    def first_empty(self) -> int | None:
        return None  # the writer refuses empty documents

    def shard_order(self, seed: int, epoch: int, *, shuffle: bool, rank: int,
                    world: int) -> BlockOrder:
        return BlockOrder(self.split.documents, self.block, seed, epoch, shuffle=shuffle,
                          rank=rank, world=world)

    def target_histogram(self, vocab_size: int) -> np.ndarray | None:
        """Target counts per token id written by ``prepare`` (no corpus scan), or None."""
        return None if self.unigram is None else self.unigram[:vocab_size]

    def index_rows(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, index row ``[offset, length, targets]``) of each of ``docs``
        (int64 ``[n]``), read from the memory-mapped indexes a shard at a time."""
        split = self.split
        if len(docs) and (docs.min() < 0 or docs.max() >= split.documents):
            raise IndexError(int(docs.min() if docs.min() < 0 else docs.max()))
        if len(split.shards) == 1:
            return np.zeros(len(docs), dtype=np.int64), split.shards[0].index[docs]
        shard = np.searchsorted(self._starts, docs, side="right") - 1
        if not len(docs):
            return shard, np.zeros((0, 3), dtype=np.int64)
        low, high = int(shard.min()), int(shard.max())  # a window spans few shards
        if low == high:
            return shard, np.asarray(split.shards[low].index[docs - self._starts[low]],
                                     dtype=np.int64)
        rows = np.empty((len(docs), 3), dtype=np.int64)
        for k in range(low, high + 1):
            mine = shard == k
            if mine.any():
                rows[mine] = split.shards[k].index[docs[mine] - self._starts[k]]
        return shard, rows

    def columns(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lengths and owned targets of documents ``ids`` (the planner's window read)."""
        _, rows = self.index_rows(np.asarray(ids, dtype=np.int64))
        return rows[:, 1], rows[:, 2]

    def piece_slices(
        self, pieces: Sequence[Any]
    ) -> tuple[list[np.ndarray], list[np.ndarray] | None, list[int]]:
        """For each piece (``example``, ``offset``, ``length``): its tokens (a view of
        the token map), its ownership bits (bool; ``None`` for text shards) and its
        example id -- the values slicing ``self[p.example]`` gives, with the index
        read once for all pieces instead of one ``Example`` per piece."""
        docs = [p.example for p in pieces]
        if docs and (min(docs) < 0 or max(docs) >= self.split.documents):
            raise IndexError(min(docs) if min(docs) < 0 else max(docs))
        shards = self.split.shards
        maps = [s.tokens for s in shards]
        tokens: list[np.ndarray] = []
        owned: list[np.ndarray] | None = [] if self._chat else None
        shard, rows = self.index_rows(np.asarray(docs, dtype=np.int64))
        where = zip(shard.tolist(), rows[:, 0].tolist(), rows[:, 1].tolist(), strict=True)
        for p, (k, start, size) in zip(pieces, where, strict=True):
            if p.offset < 0 or p.offset + p.length > size:
                raise IndexError(f"piece {p} reaches past document {p.example}")
            a = start + p.offset
            tokens.append(maps[k][a: a + p.length])
            if owned is not None:
                owned.append(owned_bits(shards[k].owned, a, p.length))
        return tokens, owned, docs


class ShardMaps:
    """A split's shards as the causal kernel (``rows.kernels.CausalFill``) reads
    them: ``table [S, MAP_FIELDS]``, each shard's token map, index map ``[documents,
    3]`` (int64) and packed ownership bits (``chat``) as addresses and element
    counts; ``sample``, an empty array of the token dtype; ``starts``, the first
    global document id of each shard and the count. It keeps the arrays (read-only views of the maps)
    alive for as long as the addresses are used. ``table`` is ``None`` when the
    shards' token types differ or a map is not contiguous."""

    def __init__(self, split: PreparedSplit) -> None:
        shards = split.shards
        self.chat = any(s.owned is not None for s in shards)
        self.starts = np.asarray(split.starts, dtype=np.int64)
        self.arrays = [(read_only(s.tokens), read_only(np.asarray(s.index, dtype=np.int64)),
                        read_only(s.owned if self.chat else np.zeros(1, dtype=np.uint8)))
                       for s in shards]
        usable = (len({t.dtype for t, _, _ in self.arrays}) == 1
                  and all(t.dtype in (np.uint16, np.uint32) for t, _, _ in self.arrays)
                  and all(a.flags.c_contiguous for arrays in self.arrays for a in arrays)
                  and all(o.dtype == np.uint8 for _, _, o in self.arrays))
        self.sample = self.arrays[0][0][:0] if self.arrays else np.zeros(0, np.uint16)
        self.shards = len(self.arrays)
        self.table = None if not usable else np.array(
            [[t.ctypes.data, t.size, i.ctypes.data, i.size, o.ctypes.data, o.size]
             for t, i, o in self.arrays], dtype=np.int64).reshape(-1, kernels.MAP_FIELDS)
        if self.table is not None and self.sample.itemsize not in (2, 4):
            self.table = None  # the kernel reads uint16 or uint32 tokens
        self.table_address = None if self.table is None else kernels.address(self.table)
        self.starts_address = kernels.address(self.starts)
        self._fills: dict[tuple, kernels.CausalFill] = {}

    def causal_fill(self, seq_len: int, pad_id: int, keep: bool, reset: bool,
                    screen: tuple[int, bool, bool] | None) -> kernels.CausalFill:
        """The causal kernel over these maps for one stream's settings (``CausalFill``'s
        arguments), made once per settings."""
        key = (seq_len, pad_id, keep, reset, screen)
        fill = self._fills.get(key)
        if fill is None:
            fill = self._fills[key] = kernels.CausalFill(self, *key)
        return fill


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only plain view of ``array`` (memory maps and arrays in memory then
    have one type for the kernels, which are compiled once per type)."""
    view = np.asarray(array).view(np.ndarray)
    view.flags.writeable = False
    return view


def owned_bits(packed: np.ndarray | None, start: int, length: int) -> np.ndarray:
    """Ownership of tokens ``[start, start + length)`` of a shard (``numpy.packbits``,
    big bit order); every token is owned in a shard without bits (text)."""
    if packed is None:
        return np.ones(length, dtype=bool)
    first = start // 8
    bits = np.unpackbits(packed[first: (start + length + 7) // 8])
    return bits[start - 8 * first: start - 8 * first + length].astype(bool)


class _Column(Sequence[int]):
    """Column ``column`` of the document index (1: length, 2: owned targets)."""

    def __init__(self, split: PreparedSplit, column: int) -> None:
        self.split, self.column = split, column

    def __len__(self) -> int:
        return self.split.documents

    def __getitem__(self, doc):  # type: ignore[override]
        return self.split.entry(doc, self.column)


def load_prepared_bundle(cfg: Any, tokenizer: Any, representation: dict[str, Any], *,
                         share: tuple[int, int] = (0, 1)) -> DataBundle:
    """Both splits of the prepared directory ``cfg.data.source`` (P2), checked against
    the run: same tokenizer hash and template hash (``representation`` is the run's
    own, S1), same ``data.kind``, no weighted reduction (prepared documents carry no
    weights, L3); for chat, the same chat policy, and the run's ``batch.seq_len``
    must be the length the conversations were truncated to. Raises ``ConfigError``
    naming what differs, ``DataError`` for an empty split.
    ``share``: the files whose sha256 this process checks (``open_prepared``)."""
    source = cfg.data.source
    prepared = open_prepared(source, share=share)
    meta = prepared.meta
    kind = "chat" if cfg.data.kind == "chat" else "text"  # "auto" (unresolved) reads text
    if meta["kind"] != kind:
        raise ConfigError(f"{source} was prepared as data.kind = {meta['kind']!r} but the run "
                          f"sets data.kind = {kind!r}; set data.kind = "
                          f"{meta['kind']!r}")
    check_representation(source, meta["representation"], representation)
    if meta["kind"] == "chat" and meta.get("max_len") != cfg.batch.seq_len:
        raise ConfigError(f"{source} truncated conversations to {meta.get('max_len')} tokens "
                          f"but batch.seq_len = {cfg.batch.seq_len}; set batch.seq_len = "
                          f"{meta.get('max_len')} or prepare again with this batch.seq_len")
    policy = asdict(run_section(cfg, "chat", ChatPolicy))  # as rows.sources reads it
    if meta["kind"] == "chat" and meta.get("chat_policy") != policy:
        differing = sorted(k for k, v in policy.items() if meta.get("chat_policy", {}).get(k) != v)
        raise ConfigError(f"{source} was prepared under another chat policy (differing: "
                          f"{', '.join('chat.' + k for k in differing)}); set them as "
                          f"{meta.get('chat_policy')} or prepare again with this policy")
    if cfg.objective.reduction in WEIGHTED_REDUCTIONS:
        raise ConfigError(f"objective.reduction = {cfg.objective.reduction!r} needs example "
                          "weights, which prepared shards do not carry; use token_mean, "
                          "sequence_mean or microbatch_mean, or train from the source itself")
    block = int(meta["order"]["block_documents"])
    train = PreparedDocuments(prepared.splits["train"], block, prepared.unigram("train"))
    val = PreparedDocuments(prepared.splits["val"], block)
    if len(train) == 0 or len(val) == 0:
        raise DataError(f"{source} has an empty {'train' if len(train) == 0 else 'val'} split; "
                        "prepare it again with more documents or another data.val_fraction")
    section = {
        "source": str(source),
        "kind": meta["kind"],
        "format": "prepared",
        "fingerprint": prepared.fingerprint,
        "source_fingerprint": meta["source_fingerprint"],
        "split": meta["split_rule"],
        "order": meta["order"],
        "train_documents": len(train),
        "val_documents": len(val),
    }
    if isinstance(meta.get("teacher"), dict):  # teacher targets (R10): the manifest says so
        section["teacher"] = meta["teacher"]
    return DataBundle(train, val, section, representation)  # type: ignore[arg-type]


def check_representation(source: str, prepared: dict[str, Any], run: dict[str, Any]) -> None:
    """Refuse a directory prepared with another tokenizer or template, both hashes named."""
    for key, what in (("tokenizer_hash", "tokenizer"), ("template_hash", "chat template")):
        if prepared.get(key) != run.get(key):
            raise ConfigError(
                f"{source} was prepared with a different {what} ({key} {prepared.get(key)}) "
                f"than this run's ({run.get(key)}); prepare it again with the run's "
                f"data.tokenizer and objective.family settings (a family's special tokens "
                f"are part of the tokenizer), or use the ones it was prepared with"
            )
