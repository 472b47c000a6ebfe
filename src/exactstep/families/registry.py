"""Objective families (R8): which examples, which compiler, which model.

A family is a compiler to the one ``Batch`` seam plus the model and data it needs;
every other stage is shared, so every contract holds for every family. ``resolve``
makes the run's family and data kind explicit before the manifest records them (S1),
``open_family`` builds its parts, and a family not built is refused (X4).
Design and derivations: docs/design/families.md#familiesregistrypy (R8, S1, X4).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from exactstep.config import RunConfig
from exactstep.data.tokenizer import Tokenizer, build_tokenizer
from exactstep.errors import ConfigError
from exactstep.rows.compiler import RowCompiler
from exactstep.rows.example import DataBundle
from exactstep.rows.sources import load_bundle

#: Every family the specification names (R8), built or not.
SPECIFIED = ("causal", "chat", "prefix", "encdec", "mlm", "span", "permutation",
             "scheduled_sampling", "policy", "mass", "bart", "professor")
DEFAULT_SOURCE = "stdlib"


@dataclass(frozen=True, kw_only=True)
class Family:
    """One objective family (R8), built with keywords.

    ``model`` / ``build_model(cfg, vocab_size)``: ``"decoder"``, ``"encoder"`` (the
    built-in stack run bidirectionally) or ``"encdec"``, weights depending only on
    ``(cfg.model, vocab, seed)``. ``data_kind``, ``default_source``, ``load``: what it
    reads. ``specials``: extra byte-tokenizer specials. ``compiler``: its
    ``RowCompiler``. ``objective``: the manifest's ``objective`` section (S1).
    ``score``: end-of-run held-out figures merged into ``summary.json``. ``inputs``: an
    input program when the model's outputs feed its inputs, else ``None``. ``program``
    (``(cfg, parts, model, device)``): a window program that turns a window's batches
    into the ones it trains on (rollouts, Q1), else ``None``; ``plan`` (``(cfg, rank)``):
    the window's plan function when the family's objective is not an L3 reduction of
    cross entropy (the policy objective, Q4), else ``None``. ``updates_per_window``:
    the optimizer steps a window takes at most (its program's ``next_pass``), which
    scales the schedule's horizon (U5).
    """

    name: str
    model: Literal["decoder", "encoder", "encdec"]
    data_kind: Literal["text", "chat", "pairs"]
    default_source: str
    compiler: Callable[[Any, Any], RowCompiler]
    objective: Callable[[Any], dict[str, Any]]
    build_model: Callable[[Any, int], Any]
    specials: Callable[[Any], tuple[str, ...]] = lambda cfg: ()
    load: Callable[..., DataBundle] = load_bundle  # (cfg, tokenizer, *, share)
    score: Callable[[Any, Any, Any, Any], dict[str, Any]] | None = None
    inputs: Callable[[Any], Any] = lambda cfg: None
    program: Callable[..., Any] = lambda cfg, parts, model, device: None
    plan: Callable[[Any, int], Any] = lambda cfg, rank: None
    updates_per_window: Callable[[Any], int] = lambda cfg: 1


@dataclass(frozen=True)
class FamilyParts:
    """What every entry point (train, eval, inspect) builds the same way for a run."""

    family: Family
    tokenizer: Tokenizer
    data: DataBundle
    compiler: RowCompiler


def open_family(cfg: RunConfig, *, share: tuple[int, int] = (0, 1)) -> FamilyParts:
    """The run's family, its tokenizer (with the specials it needs), both data splits
    and its compiler. Nothing is written; raises what each stage refuses.

    ``share = (rank, world)``: the part of a prepared directory's files whose sha256
    this process checks (``data.prepared.open_prepared``); a data-parallel run
    passes its rank, so the job reads the corpus once, not once per rank."""
    family = family_of(cfg)
    tokenizer = family_tokenizer(cfg)
    data = family.load(cfg, tokenizer, share=share)
    return FamilyParts(family, tokenizer, data, family.compiler(cfg, tokenizer))


def family_tokenizer(cfg: RunConfig) -> Tokenizer:
    """``data.tokenizer`` with the specials ``cfg``'s family needs (``<mask>``,
    sentinels): the tokenizer every entry point of the run, and ``prepare``, encode
    with, so prepared shards carry the run's tokenizer hash (S1)."""
    return build_tokenizer(cfg, family_of(cfg).specials(cfg))


#: The built families, each the folder ``families/<name>/`` whose ``family.py`` holds its
#: ``FAMILY``: adding a family is its folder, one line here and ``tests/families/<name>/``.
BUILT: tuple[str, ...] = (
    "causal",
    "chat",
    "scheduled_sampling",
    "permutation",
    "encdec",
    "prefix",
    "span",
    "mass",
    "bart",
    "mlm",
    "policy",
    "professor",
)


def family_name(cfg: RunConfig) -> str:
    """``objective.family`` with ``auto`` decided by ``data.kind``: ``chat`` for
    ``data.kind = "chat"``, ``causal`` otherwise."""
    name = cfg.objective.family
    if name == "auto":
        return "chat" if cfg.data.kind == "chat" else "causal"
    return name


def family_of(cfg: RunConfig) -> Family:
    """The run's family; ``ConfigError`` naming the built ones for one specified but
    not built yet. A family's ``FAMILY`` (in ``families/<name>/family.py``, imported only
    when chosen) is a ``Family`` or a function of ``cfg`` returning one (a family over a
    base, as scheduled sampling)."""
    name = family_name(cfg)
    if name not in BUILT:
        raise ConfigError(
            f"objective.family = {name!r} is not built yet; choose one of {', '.join(BUILT)}"
        )
    family = importlib.import_module(f"exactstep.families.{name}.family").FAMILY
    return family if isinstance(family, Family) else family(cfg)  # one built per run


def data_kind_of(family: Family) -> str:
    """The ``data.kind`` ``family`` reads: ``chat`` or ``text`` (pairs are texts)."""
    return "chat" if family.data_kind == "chat" else "text"


READS = {"text": "text", "chat": "conversations"}


def run_data_kind(cfg: RunConfig) -> str:
    """``data.kind`` as the run's family reads it (``auto`` made explicit); a kind the
    family does not read is a ``ConfigError`` naming both keys (R8, X4)."""
    family = family_of(cfg)
    kind = data_kind_of(family)
    if cfg.data.kind not in ("auto", kind):
        what = "pairs of texts" if family.data_kind == "pairs" else READS[kind]
        raise ConfigError(
            f"objective.family = {family.name!r} reads {what} (data.kind = {kind!r}), "
            f"but data.kind = {cfg.data.kind!r}; set data.kind = {kind!r} or leave it unset, "
            f"or leave objective.family at 'auto' to train on {READS[cfg.data.kind]}")
    return kind


def resolve(cfg: RunConfig) -> Any:
    """``cfg`` with its family and data kind explicit and its data pointed at the
    family's built-in source when the run left ``data.source`` at the default
    (``"stdlib"``), so ``--set objective.family=X`` alone is a working run. Raises ``ConfigError`` for a family not built yet or a ``data.kind``
    the family does not read (``run_data_kind``).
    """
    family = family_of(cfg)
    kind = run_data_kind(cfg)
    data = cfg.data
    source = data.source
    if source == DEFAULT_SOURCE and family.default_source != DEFAULT_SOURCE:
        source = family.default_source
    data = replace(data, source=source, kind=kind)
    return replace(cfg, data=data, objective=replace(cfg.objective, family=family.name))
