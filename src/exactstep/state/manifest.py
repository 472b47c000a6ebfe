"""The run manifest: what the run optimizes, fixed before the first step (S1).

A tree of plain values serialised as canonical JSON, so one declaration has one
sha256 on every machine; immutable once written (progress lives in checkpoints), and
``diff_manifests`` names the fields behind an S4 resume refusal.
Design and derivations: docs/design/state.md#statemanifestpy (S1, S4).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exactstep import __version__
from exactstep.errors import CheckpointError, ConfigError, ResumeError
from exactstep.state.durable import create_durably

MANIFEST_FILE = "manifest.json"

#: Sections every run manifest declares (S1). Extra sections (e.g. ``model``) are allowed.
REQUIRED_SECTIONS: tuple[str, ...] = (
    "data",
    "representation",
    "batch",
    "objective",
    "update",
    "numerics",
    "parallel",
    "seeds",
    "code",
)

#: Section names that would smuggle mutable progress into the immutable manifest (S1).
FORBIDDEN_SECTIONS: tuple[str, ...] = ("progress",)


class FrozenDict(dict):
    """A ``dict`` that refuses mutation, so a manifest body can be handed to code
    expecting plain dicts (``isinstance(x, dict)``, ``json.dumps``) yet stay immutable."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a manifest is immutable (S1); use Manifest.to_dict() for a mutable copy")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=lambda kv: kv[0])))


@dataclass(frozen=True)
class Manifest:
    """An immutable run declaration and the sha256 of its canonical bytes (S1).

    ``body`` is deeply read-only (mappings are ``FrozenDict``, lists are tuples);
    ``to_dict()`` returns a plain, mutable copy. Two manifests are equal exactly when
    their digests are.
    """

    body: Mapping[str, Any]
    digest: str

    def to_dict(self) -> dict[str, Any]:
        """A plain ``dict``/``list`` copy of ``body``."""
        return _thaw(self.body)

    def section(self, name: str) -> Mapping[str, Any]:
        """One section; ``KeyError`` if the manifest has no such section."""
        return self.body[name]


def canonical_json(obj: Any) -> bytes:
    """The canonical UTF-8 bytes of ``obj`` (S1), ending in one newline.

    Keys sorted, separators ``(",", ":")``, no ``\\u`` escapes, floats as Python's
    shortest round-tripping ``repr`` (``1`` and ``1.0`` stay different), tuples as
    lists: one declaration, one sha256, on every machine and Python version.

    Raises ``ConfigError`` naming the dotted path of the first value that has no
    canonical form (NaN/Inf, non-string keys, objects that are not plain data).
    """
    plain = _to_plain(obj, path="")
    text = json.dumps(
        plain, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return (text + "\n").encode("utf-8")


def digest_of(obj: Any) -> str:
    """sha256 (hex) of ``canonical_json(obj)``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def build_manifest(sections: Mapping[str, Any]) -> Manifest:
    """Freeze ``sections`` into a ``Manifest`` with its digest (S1).

    Every name in ``REQUIRED_SECTIONS`` must be present and be a mapping (an empty
    mapping declares "nothing to say"); a ``progress`` section is refused because
    progress lives beside the manifest. Raises ``ConfigError`` naming the problem.
    """
    if not isinstance(sections, Mapping):
        raise ConfigError("a manifest is built from a mapping of section name -> mapping")
    missing = [name for name in REQUIRED_SECTIONS if name not in sections]
    if missing:
        raise ConfigError(
            f"manifest is missing section(s) {', '.join(missing)}; every run declares "
            f"{', '.join(REQUIRED_SECTIONS)} (use an empty mapping if there is nothing to say)"
        )
    for name, value in sections.items():
        if name in FORBIDDEN_SECTIONS:
            raise ConfigError(
                f"manifest section {name!r} is not allowed: counters and cursors are progress, "
                "saved in checkpoints beside the manifest, never in it"
            )
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"manifest section {name!r} must be a mapping, got {type(value).__name__}"
            )
    plain = _to_plain(sections, path="")
    return Manifest(body=_freeze(plain), digest=digest_of(plain))


def write_manifest(run_dir: Path, m: Manifest) -> None:
    """Write ``run_dir/manifest.json`` = ``{"digest": ..., "manifest": body}`` atomically.

    The file is written durably and linked into place (``durable.create_durably``),
    so a crash leaves either no manifest or the complete one. Writing the same manifest
    again is a no-op; writing a different one raises ``ResumeError`` naming the
    differing fields (the manifest of a run is immutable, S1).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / MANIFEST_FILE
    if target.exists():
        _refuse_if_different(run_dir, m)
        return
    data = canonical_json({"digest": m.digest, "manifest": m.body})
    if not create_durably(target, data):  # another writer got there first: never clobbers
        _refuse_if_different(run_dir, m)


def read_manifest(run_dir: Path) -> Manifest:
    """Read and verify ``run_dir/manifest.json`` (S1).

    Raises ``ResumeError`` when the file is absent (not a run directory) and
    ``CheckpointError`` when it is unreadable or its digest does not match its body.
    """
    path = Path(run_dir) / MANIFEST_FILE
    if not path.is_file():
        raise ResumeError(
            f"{path} does not exist; pass a run directory written by `exactstep train`"
        )
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path} is not valid JSON ({exc}); the run manifest is corrupted"
        ) from None
    if not isinstance(doc, dict) or set(doc) != {"digest", "manifest"}:
        raise CheckpointError(
            f"{path} must hold exactly the keys 'digest' and 'manifest'; it is corrupted"
        )
    body, recorded = doc["manifest"], doc["digest"]
    if not isinstance(body, dict):
        raise CheckpointError(f"{path}: 'manifest' must be a mapping of sections; it is corrupted")
    actual = digest_of(body)
    if actual != recorded:
        raise CheckpointError(
            f"{path} is corrupted: its body hashes to {actual[:12]}… but it records "
            f"digest {str(recorded)[:12]}…"
        )
    return Manifest(body=_freeze(body), digest=actual)


def diff_manifests(a: Manifest, b: Manifest) -> list[str]:
    """Sorted dotted paths of every field that differs between ``a`` and ``b``.

    A key present on one side only is reported by its path; lists that differ are
    reported element by element (``update.betas.1``) when their lengths agree, and
    as a whole otherwise. Equal manifests give ``[]``.
    """
    out: list[str] = []
    _diff(_thaw(a.body), _thaw(b.body), "", out)
    return sorted(out)


# Keys that change presentation only; they are left out of the manifest so that a
# resume may change them (S4).
PRESENTATION_KEYS = ("train.progress", "train.log_every", "train.prefetch", "train.loader")

# Keys that ask for a numerics environment: what the run actually got is recorded in
# the ``environment`` section (S9), so a resume that changes them is a declared,
# non-bitwise continuation rather than another run.
ENVIRONMENT_KEYS = ("train.threads", "train.compile", "numerics.flush_denormal")


# Keys of the parallel layout recorded only where they act: the model axes when a
# replica is split (tp, pp or cp > 1), the schedule when it is pipelined, ep above 1. A pure
# data-parallel run's sections are then what they were before the axes existed, so
# its manifest, and every checkpoint's digest of it, are unchanged (S4).
MODEL_AXIS_KEYS = ("tp", "pp", "cp")


def parallel_record(parallel: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """The ``parallel`` configuration as a manifest records it, given the layout's
    sizes ``layout`` (``Layout.section()``): without the axes that do not act."""
    record = dict(parallel)
    if all(layout.get(axis, 1) == 1 for axis in MODEL_AXIS_KEYS):
        for axis in MODEL_AXIS_KEYS:
            record.pop(axis, None)
    if layout.get("pp", 1) == 1:
        record.pop("schedule", None)
    if record.get("ep", 1) == 1:  # expert parallel: refused above 1 (ParallelConfig)
        record.pop("ep", None)
    return record


def run_sections(cfg: Any, data: Any, group_digest: str, layout: dict[str, Any],
                 parent: dict | None = None, model: dict | None = None,
                 objective: dict | None = None,
                 environment: dict | None = None) -> dict[str, Any]:
    """The S1 sections a training run declares, from its ``RunConfig`` and ``DataBundle``.

    The resolved configuration is recorded whole (X2) but for ``PRESENTATION_KEYS``
    and ``ENVIRONMENT_KEYS`` (``environment``, the numerics environment the run
    started in, S9, records what those asked for);
    ``parent`` (a warm start's origin, S4) becomes its own section, and so does
    ``model``, a model's own ``describe()`` where it has one (a Hugging Face model's
    resolved architecture, initial weights and library version). ``objective`` is
    the objective family's own description (R8: family, shift owner, ownership,
    estimator); without one it is derived from ``data.kind``. ``layout`` is the job's
    ``Layout.section()``: the ``parallel`` section records the world size and, where a
    replica is split, every axis (``parallel_record``).
    """
    config = cfg.to_dict()
    for key in PRESENTATION_KEYS + ENVIRONMENT_KEYS:
        section, name = key.split(".")
        config[section].pop(name, None)
    config["parallel"] = parallel_record(config["parallel"], layout)
    split = any(layout.get(axis, 1) > 1 for axis in MODEL_AXIS_KEYS)
    if objective is None:
        family = "chat_sft" if cfg.data.kind == "chat" else "causal_lm"
        objective = {"family": family, "shift_owner": "collator",
                     "ownership": "assistant_targets" if family == "chat_sft"
                     else "all_next_tokens"}
    sections: dict[str, Any] = {
        "config": config,
        "data": data.section,
        "representation": data.representation,
        "batch": config["batch"],
        "objective": {
            **objective,
            "ignore_index": -100,
            "smoothing": cfg.objective.smoothing,
            "label_smoothing": cfg.objective.label_smoothing,
            "reduction": cfg.objective.reduction,
        },
        "update": {**config["update"], "group_digest": group_digest},
        "numerics": config["numerics"],
        "parallel": {**config["parallel"], "world_size": layout["world_size"],
                     **({"layout": layout} if split else {})},
        "seeds": {"seed": cfg.seed},
        "code": {
            "exactstep": _version("exactstep"),
            "torch": _version("torch").split("+")[0],
            "python": platform.python_version(),
        },
    }
    if parent is not None:
        sections["parent"] = parent
    if model is not None:
        sections["model"] = model
    if environment is not None:
        sections["environment"] = environment
    return sections


def _version(package: str) -> str:
    if package == "exactstep":
        return __version__
    return importlib.metadata.version(package)


# ---------------------------------------------------------------- helpers


def _refuse_if_different(run_dir: Path, m: Manifest) -> None:
    existing = read_manifest(run_dir)
    if existing.digest != m.digest:
        fields = diff_manifests(existing, m)
        raise ResumeError(
            f"{run_dir} already holds a run with a different manifest (fields differ: "
            f"{', '.join(fields) or 'none named'}); choose a new output directory or resume "
            "that run with its own configuration"
        )


def _to_plain(obj: Any, path: str) -> Any:
    """Validate and convert to JSON-ready plain data, naming the path of bad values."""
    where = path or "<root>"
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ConfigError(
                f"manifest value {where} is {obj!r}; manifests hold finite numbers only"
            )
        return float(obj)
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"manifest key {key!r} under {where} is a {type(key).__name__}; keys must be strings"
                )
            out[key] = _to_plain(value, f"{path}.{key}" if path else key)
        return out
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)]
    raise ConfigError(
        f"manifest value {where} is a {type(obj).__name__}; convert it to plain data "
        "(str, int, float, bool, None, list, mapping) first"
    )


def _freeze(plain: Any) -> Any:
    if isinstance(plain, Mapping):
        return FrozenDict({k: _freeze(v) for k, v in plain.items()})
    if isinstance(plain, (list, tuple)):
        return tuple(_freeze(v) for v in plain)
    return plain


def _thaw(frozen: Any) -> Any:
    if isinstance(frozen, Mapping):
        return {k: _thaw(v) for k, v in frozen.items()}
    if isinstance(frozen, (list, tuple)):
        return [_thaw(v) for v in frozen]
    return frozen


def _same_scalar(x: Any, y: Any) -> bool:
    # 1 == 1.0 == True in Python, but they are different declarations.
    return type(x) is type(y) and x == y


def _diff(x: Any, y: Any, path: str, out: list[str]) -> None:
    if isinstance(x, dict) and isinstance(y, dict):
        for key in set(x) | set(y):
            sub = f"{path}.{key}" if path else key
            if key not in x or key not in y:
                out.append(sub)
            else:
                _diff(x[key], y[key], sub, out)
        return
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _diff(u, v, f"{path}.{i}" if path else str(i), out)
        return
    if isinstance(x, (dict, list)) or isinstance(y, (dict, list)):
        if x != y or type(x) is not type(y):
            out.append(path or "<root>")
        return
    if not _same_scalar(x, y):
        out.append(path or "<root>")
