"""The resolved run configuration: TOML file + ``--set key=value`` overrides (X2).

Composes each stage's frozen, keyword-only section dataclass, coerces overrides to
the declared types and refuses unknown keys, out-of-range and non-finite values with
a ``ConfigError`` naming the key (X4), so the manifest records plain data (S1).
Design and derivations: docs/design/run.md#configpy (X2, S1).
"""

from __future__ import annotations

import dataclasses
import decimal
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from exactstep.data.arith import ArithSpec
from exactstep.data.config import DataConfig
from exactstep.errors import ConfigError
from exactstep.families.bart.config import BartConfig
from exactstep.families.encdec.config import EncDecConfig
from exactstep.families.mass.config import MassConfig
from exactstep.families.mlm.config import MLMConfig
from exactstep.families.permutation.config import PermutationConfig
from exactstep.families.policy.config import PolicyConfig
from exactstep.families.professor.config import ProfessorConfig
from exactstep.families.scheduled_sampling.config import ScheduledSamplingConfig
from exactstep.families.span.config import SpanConfig
from exactstep.generation.config import GenerationConfig
from exactstep.model.config import ModelConfig
from exactstep.objective.config import ObjectiveConfig
from exactstep.parallel.config import ParallelConfig
from exactstep.ranges import INT64_MAX, at_least, between, check, check_finite, check_int
from exactstep.rows.chat import ChatPolicy
from exactstep.rows.config import BatchConfig
from exactstep.state.config import CheckpointConfig
from exactstep.tracking import LogConfig
from exactstep.update.config import NumericsConfig, UpdateConfig


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How long to train and how often to report.

    ``steps`` counts windows (committed, skipped or no-objective alike).
    ``eval_every`` (windows, 0 = only at the end) and ``eval_tokens`` bound evaluation.
    ``prefetch``: batches packed and compiled ahead while the current window trains
    (0 = in line). ``loader`` says where, when ``prefetch > 0``: ``"thread"``, a worker
    thread (``rows.background``), or ``"process"``, a loader process started with
    ``spawn`` (``rows.loader_process``; a script that trains must then do so under
    ``if __name__ == "__main__":``). Neither changes the batches or the resume state,
    so a resume may change them. ``threads``: intra-op threads (0 = PyTorch's count);
    the count used is recorded (S9), a resume restores it, and a resume given another
    count is a declared, non-bitwise continuation. ``compile``: ``torch.compile`` the
    model's forward (``model.compiled``: the built-in decoder's blocks, an HF model's
    decoder stack; other models refused); recorded and restored like ``threads`` (S9).
    """

    steps: int = 800
    eval_every: int = 0
    eval_tokens: int = 131072
    log_every: int = 10
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = 0
    progress: bool = True
    prefetch: int = 0
    loader: Literal["thread", "process"] = "thread"
    compile: bool = False

    def __post_init__(self) -> None:
        check("train.steps", self.steps, at_least(1))
        check("train.eval_every", self.eval_every, at_least(0))  # 0 = only at the end
        check("train.eval_tokens", self.eval_tokens, at_least(1))
        check("train.log_every", self.log_every, at_least(1))
        check("train.threads", self.threads, at_least(0))  # 0 = PyTorch's default
        check("train.prefetch", self.prefetch, between(0, 64))  # 0 = in line


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The whole run. ``seed`` seeds every stream (data order, init, dropout).

    ``chat`` (ownership policy, R5) and ``arith`` (the built-in SFT demo) only matter
    when ``data.kind = "chat"``. A family's own section lives in its folder
    (``families/<name>/config.py``) and only matters for that family:
    ``permutation`` (the partial-prediction cutoff) when ``objective.family =
    "permutation"``; ``encdec`` (model depths, encoder columns, the built-in
    ``numwords`` pairs) for the encoder-decoder families, ``span`` for ``"span"``,
    ``bart`` (the noising composition, R9) for ``"bart"``,
    ``mass`` (the fragment fraction and replacement rates, R9) for ``"mass"``,
    ``mlm`` (selection and replacement rates) for ``"mlm"``, ``scheduled_sampling``
    for ``"scheduled_sampling"``, ``policy`` for ``"policy"`` (R8, Q1-Q4) and
    ``professor`` for ``"professor"`` (Professor Forcing, Q5).
    ``generation`` is the declared sampling policy (Q1) of a policy run's rollouts and
    of ``exactstep generate``.
    """

    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    chat: ChatPolicy = field(default_factory=ChatPolicy)
    arith: ArithSpec = field(default_factory=ArithSpec)
    log: LogConfig = field(default_factory=LogConfig)
    scheduled_sampling: ScheduledSamplingConfig = field(default_factory=ScheduledSamplingConfig)
    permutation: PermutationConfig = field(default_factory=PermutationConfig)
    encdec: EncDecConfig = field(default_factory=EncDecConfig)
    span: SpanConfig = field(default_factory=SpanConfig)  # family "span" (families.span.config)
    bart: BartConfig = field(default_factory=BartConfig)  # family "bart" (families.bart.config)
    mass: MassConfig = field(default_factory=MassConfig)  # family "mass" (families.mass.config)
    mlm: MLMConfig = field(default_factory=MLMConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    professor: ProfessorConfig = field(default_factory=ProfessorConfig)

    def __post_init__(self) -> None:
        # NumPy seeds only from non-negative integers; torch keeps seeds in 64 bits
        check("seed", self.seed, between(0, INT64_MAX))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def require(condition: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


def load_config(
    path: str | Path | None = None, overrides: typing.Sequence[str] = ()
) -> RunConfig:
    """Resolve a ``RunConfig`` from an optional TOML file and ``key=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(Path(path))
    for item in overrides:
        set_override(raw, item)
    return build(RunConfig, raw, prefix="")


def set_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``--set`` item to the raw tables: ``key=value``, or ``section={json}``,
    a JSON object whose keys are set one by one as ``section.key=value`` would be (the
    section's other keys keep their values); ``build`` then checks each one."""
    key, value = split_override(item)
    hint = key_hint(key)
    if dataclasses.is_dataclass(hint):
        set_section(raw, key, hint, section_object(key, hint, value))
    else:
        set_dotted(raw, key, in_table(key, value))


def key_hint(key: str) -> Any:
    """The declared type of dotted ``key``: a section's dataclass, a field's type,
    ``dict`` inside a free table, ``None`` where no such key exists."""
    hint: Any = RunConfig
    for part in key.split("."):
        if hint is dict or typing.get_origin(hint) is dict:
            return dict
        if not dataclasses.is_dataclass(hint):
            return None
        hint = typing.get_type_hints(hint).get(part)
    return hint


def section_object(key: str, cls: type, value: Any) -> dict[str, Any]:
    """The JSON object ``--set`` gave section ``key``; ``ConfigError`` naming the section
    and its keys when it is not one, or names a key twice (TOML refuses that too)."""
    detail = ""
    if isinstance(value, str):
        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            names = [name for name, _ in items]
            twice = next((name for name in names if names.count(name) > 1), None)
            if twice is not None:
                raise ConfigError(f"--set {key}: its JSON object gives the key {twice!r} twice")
            return dict(items)

        try:
            value = json.loads(value, object_pairs_hook=pairs)
        except json.JSONDecodeError as exc:
            detail = f" ({exc.msg} at character {exc.pos})"
    if isinstance(value, dict):
        return value
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    raise ConfigError(
        f"config key {key!r} is a section; give --set a JSON object of its keys "
        f"({', '.join(names)}), "
        f"e.g. '{key}={{\"{names[0]}\": ...}}'; got {value!r}{detail}"
    )


def set_section(raw: dict[str, Any], key: str, cls: type, table: dict[str, Any]) -> None:
    """Set each key of ``table`` under section ``key`` (nested sections likewise)."""
    hints = typing.get_type_hints(cls)
    for name, value in table.items():
        inner = hints.get(name)
        if dataclasses.is_dataclass(inner):
            set_section(raw, f"{key}.{name}", inner, section_object(f"{key}.{name}", inner, value))
        else:
            set_dotted(raw, f"{key}.{name}", value)


def in_table(key: str, value: str) -> Any:
    """A ``--set`` value for a key inside a free table (``model.hf_config.num_hidden_layers``)
    read as a JSON literal where it is one (``6``, ``1e-6``, ``true``), else kept as the
    string; every other key's value is coerced to its field's type by ``build``."""
    hint: Any = RunConfig
    for part in key.split(".")[:-1]:
        if hint is dict or typing.get_origin(hint) is dict:
            break
        if not dataclasses.is_dataclass(hint):
            return value
        hint = typing.get_type_hints(hint).get(part)
    if not (hint is dict or typing.get_origin(hint) is dict):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def apply_overrides(cfg: RunConfig, overrides: typing.Sequence[str]) -> RunConfig:
    """``cfg`` with ``key=value`` overrides applied and every value validated again."""
    if not overrides:
        return cfg
    raw = cfg.to_dict()
    for item in overrides:
        set_override(raw, item)
    return build(RunConfig, raw, prefix="")


def config_from_manifest(manifest: Any) -> RunConfig:
    """The ``RunConfig`` a run's manifest recorded (its ``config`` section, X2)."""
    return build(RunConfig, manifest.body["config"], prefix="")


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML table of ``path``; ``ConfigError`` naming the file when it is missing,
    unreadable, not UTF-8 or not TOML."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {what}; pass an existing .toml file")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start}); save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror}); "
                          "check its permissions") from None


def split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value (e.g. update.lr=3e-4), got {item!r}")
    return key.strip(), value.strip()


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {part!r} is a value, not a section; cannot set {key!r}")
        node = child
    node[parts[-1]] = value


def build(cls: type, raw: Any, prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from ``raw``, coercing strings and naming bad keys."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config key {prefix.rstrip('.')!r} is a section; give it a table")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        known = ", ".join(prefix + name for name in fields)
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}; known keys here: {known}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = coerce(hints[name], value, prefix + name)
    return cls(**kwargs)


def coerce(hint: Any, value: Any, key: str) -> Any:
    """Convert ``value`` (from TOML or a ``--set`` string) to the type ``hint``."""
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key + ".")
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if isinstance(value, str) and value not in choices:
            sample = choices[0]
            if not isinstance(sample, str):
                value = coerce(type(sample), value, key)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return coerce(args[0], value, key)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key} must be true or false; got {value!r}")
    if hint is dict or origin is dict:
        return coerce_table(value, key)
    if origin is tuple and typing.get_args(hint) == (str, Ellipsis):
        return coerce_names(value, key)
    if origin is tuple and typing.get_args(hint) == (dict, Ellipsis):
        return coerce_tables(value, key)
    if hint is int:
        return coerce_int(value, key)
    if hint is float:
        return coerce_float(value, key)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string; got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {hint!r}")


def coerce_names(value: Any, key: str) -> tuple[str, ...]:
    """A list of strings (``tuple[str, ...]`` keys, e.g. ``bart.noise``): a TOML array,
    or from ``--set`` a JSON array (``'["a", "b"]'``) or names separated by commas
    (``a,b``; an empty value is the empty list)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{key} must be a list of strings, e.g. '[\"a\", \"b\"]' "
                                  f"({exc.msg} at character {exc.pos})") from None
        else:
            value = [name.strip() for name in text.split(",") if name.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key} must be a list of strings; got {value!r}")
    return tuple(value)


def coerce_tables(value: Any, key: str) -> tuple[dict[str, Any], ...]:
    """A list of tables (``tuple[dict, ...]`` keys, e.g. ``policy.rewards``): a TOML
    array of tables, or from ``--set`` a JSON array of objects."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key} must be a list of tables, e.g. '[{{\"name\": "
                              f"\"exact_match\", \"weight\": 1}}]' ({exc.msg} at "
                              f"character {exc.pos})") from None
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{key} must be a list of tables; got {value!r}")
    return tuple(coerce_table(v, f"{key}.{i}") for i, v in enumerate(value))


def coerce_table(value: Any, key: str) -> dict[str, Any]:
    """A table from TOML, or from ``--set`` a JSON object string (``'{"a": 1}'``).

    Returns a deep copy made of plain data only; anything else (a TOML date, NaN, a
    non-string key) is refused naming the dotted key inside the table.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{key} must be a table: a TOML table, or from --set a JSON object such as "
                f"'{{\"model_type\": \"llama\"}}' ({exc.msg} at character {exc.pos})"
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a table (a TOML table or a JSON object); got {value!r}")
    return plain_value(value, key)


def plain_value(value: Any, key: str) -> Any:
    """``value`` copied as plain data (X2): str, finite float, int, bool, None, list, table."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        check_int(key, value)
        return value
    if isinstance(value, float):
        check_finite(key, value)
        return value
    if isinstance(value, list | tuple):
        return [plain_value(v, f"{key}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for name in value:
            if not isinstance(name, str):
                raise ConfigError(f"{key} has a key {name!r} that is not a string")
        return {name: plain_value(v, f"{key}.{name}") for name, v in value.items()}
    raise ConfigError(
        f"{key} must hold plain values (strings, numbers, booleans, lists, tables); "
        f"got a {type(value).__name__}: {value!r}"
    )


def coerce_int(value: Any, key: str) -> int:
    """An exact integer from TOML (``3``, ``3.0``) or a string (``"3"``, ``"1e3"``).

    Parsed without going through a binary float, so a long integer keeps every digit;
    refused unless it is integral and fits in 64 bits (``ranges.check_int``).
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{key} must be an integer; got {value!r}")
    try:
        exact = decimal.Decimal(value.strip() if isinstance(value, str) else value)
    except (decimal.InvalidOperation, ValueError):
        raise ConfigError(f"{key} must be an integer; got {value!r}") from None
    if not exact.is_finite() or exact != exact.to_integral_value():
        raise ConfigError(f"{key} must be an integer; got {value!r}")
    if exact.adjusted() > 19:  # more digits than any 64-bit integer: refuse before int()
        raise ConfigError(f"{key} must be an integer in [-2**63, 2**63 - 1]; got {value!r}")
    number = int(exact)
    check_int(key, number)
    return number


def coerce_float(value: Any, key: str) -> float:
    """A finite float from TOML or a string; NaN and the infinities are refused here,
    for every float key (no key gives them a meaning)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{key} must be a number; got {value!r}")
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise ConfigError(f"{key} must be a number; got {value!r}") from None
    check_finite(key, number)
    return number


def config_keys(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """Every leaf key as (dotted name, default, type description), for docs and errors."""
    out: list[tuple[str, Any, str]] = []
    hints = typing.get_type_hints(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.extend(config_keys(hint, prefix + f.name + "."))
        else:
            out.append((prefix + f.name, getattr(default, f.name), describe(hint)))
    return out


def describe(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return "list of table" if typing.get_args(hint)[0] is dict else "list of str"
    if typing.get_origin(hint) is Literal:
        return " | ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(describe(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))
