"""Parquet, Arrow and sharded data sources, read through the ``datasets`` library (S1).

``data.source`` may name a ``.parquet`` or ``.arrow`` file or a directory of shards of
one format; this module reads them, offline, into the ``Document`` and ``Conversation``
values the JSONL readers produce, so the split, fingerprint, encoding and packing
downstream are unchanged.
Design and derivations: docs/design/data.md#datadatasets_sourcepy (S1, S5, X4).
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from exactstep.data.conversation import Conversation, parse_conversation
from exactstep.data.documents import Document, iter_jsonl, read_jsonl
from exactstep.data.jsonl import records, unicode_text
from exactstep.data.weights import WEIGHT_FIELD, parse_weight
from exactstep.errors import ConfigError, DataError

SHARD_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
COLUMNAR = ("parquet", "arrow")
# data files of formats exactstep does not read: refused, rather than read as JSONL
UNSUPPORTED_SUFFIXES = frozenset({
    ".csv", ".tsv", ".txt", ".feather", ".orc", ".avro", ".xlsx", ".gz", ".bz2", ".xz",
    ".zst", ".zip", ".tar",
})
PASSED_OVER_NAMES = frozenset({"dataset_info.json", "state.json"})
SUPPORTED = ".jsonl, .parquet or .arrow"
COLUMNAR_SUFFIXES = tuple(s for s, fmt in SHARD_FORMATS.items() if fmt in COLUMNAR)

Table = Any  # a pyarrow.Table (pyarrow is imported with datasets, on use)
Reader = Callable[[Path, str], Table | None]


def is_dataset_source(path: Path) -> bool:
    """Whether ``path`` is read here: a directory, a ``.parquet``/``.arrow`` path, or a
    file of a format exactstep refuses. Any other path is a JSONL file, read as before."""
    suffix = path.suffix.lower()
    return path.is_dir() or suffix in COLUMNAR_SUFFIXES or suffix in UNSUPPORTED_SUFFIXES


# --------------------------------------------------------------------------- files


def shard_files(path: Path) -> tuple[str, list[Path]]:
    """(format, files) of a source: a file alone, or a directory's shards in order."""
    if path.is_dir():
        return directory_shards(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; set data.source to an existing "
                        f"{SUPPORTED} file or a directory of them")
    fmt = SHARD_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"data file {path} is a {path.suffix} file, which exactstep does not "
                        f"read; convert it to {SUPPORTED} (or set data.source to 'stdlib')")
    return fmt, [path]


def directory_shards(root: Path) -> tuple[str, list[Path]]:
    """The shards under ``root`` (one format, sorted by relative POSIX path)."""
    files = sorted(walk_files(root), key=lambda p: p.relative_to(root).as_posix())
    by_format: dict[str, list[Path]] = {}
    for file in files:
        fmt = SHARD_FORMATS.get(file.suffix.lower())
        if fmt is None:
            raise DataError(
                f"data.source {root} holds {file.relative_to(root).as_posix()}, which is not a "
                f"{SUPPORTED} shard; remove it or point data.source at the shards' directory"
            )
        by_format.setdefault(fmt, []).append(file)
    if not by_format:
        raise DataError(f"data.source {root} is a directory with no {SUPPORTED} file; point "
                        "data.source at a directory of shards or at a data file")
    if len(by_format) > 1:
        found = ", ".join(f"{len(v)} .{k} ({v[0].relative_to(root).as_posix()})"
                          for k, v in sorted(by_format.items()))
        raise DataError(f"data.source {root} mixes shard formats ({found}); "
                        "keep the shards of one format in a directory")
    ((fmt, shards),) = by_format.items()
    return fmt, shards


def walk_files(root: Path) -> Iterator[Path]:
    """Every file under ``root`` that is not passed over: hidden entries and those
    starting with ``_``, ``*.md`` files, and ``dataset_info.json`` / ``state.json``;
    links to directories are not followed."""
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if not passed_over(d)]
        for name in names:
            if not passed_over(name) and name not in PASSED_OVER_NAMES:
                yield Path(directory) / name


def passed_over(name: str) -> bool:
    return name.startswith((".", "_")) or name.lower().endswith(".md")


def label_of(file: Path, source: Path) -> str:
    """A shard's name in document names: its path relative to the source directory,
    or its file name when the source is the file itself (machine-independent)."""
    return file.relative_to(source).as_posix() if source.is_dir() else file.name


# --------------------------------------------------------------------------- text


def read_text_source(path: Path, text_field: str = "text", columns: tuple[str, ...] = ()
                     ) -> tuple[str, list[Document]]:
    """(format, documents) of a Parquet/Arrow file or a shard directory (S1).

    Shards in the Python string order of their relative paths, rows in file order; a
    Parquet/Arrow row is named ``<relative path>#<row>``, a JSONL shard's line
    ``<relative path>:<line>`` (a single file by its file name). ``DataError`` names
    the file, the row and what to change; ``ConfigError`` when ``datasets`` is missing.
    """
    fmt, files = shard_files(path)
    documents: list[Document] = []
    if fmt == "jsonl":
        for file in files:
            documents += read_jsonl(file, text_field, label=label_of(file, path),
                                    columns=columns)
    else:
        with columnar_reader() as read:
            for file in files:
                table = read(file, fmt)
                if table is not None:
                    documents += table_documents(table, file, label_of(file, path),
                                                 text_field, columns)
    require_rows(path, fmt, files, len(documents))
    return fmt, documents


def iter_text_source(path: Path, text_field: str = "text") -> Iterator[Document]:
    """The documents ``read_text_source`` returns, in the same order and with the same
    names, holding one shard file in memory at a time (``exactstep prepare``, P1).

    Unlike ``read_text_source`` it cannot refuse a source whose every file is empty
    before the first document: the caller counts what it was given.
    """
    fmt, files = shard_files(path)
    if fmt == "jsonl":
        for file in files:
            yield from iter_jsonl(file, text_field, label=label_of(file, path))
        return
    with columnar_reader() as read:
        for file in files:
            table = read(file, fmt)
            if table is not None:
                yield from table_documents(table, file, label_of(file, path), text_field)
                del table  # the next file replaces it, never joins it


def table_documents(table: Table, file: Path, label: str, field: str,
                    columns: tuple[str, ...] = ()) -> list[Document]:
    """One ``Document`` per row, named ``<label>#<row>``, with the declared columns."""
    texts = string_column(table, file, field)
    weights = weight_column(table, file)
    extra = declared_table_columns(table, file, columns)
    documents = []
    for row, text in enumerate(texts):
        where = f"{file} row {row}"
        if text is None:
            raise DataError(f"{where}: data.text_field {field!r} is null; give the row a "
                            "string or remove the row")
        documents.append(Document(name=f"{label}#{row}",
                                  text=unicode_text(text, where, f'"{field}"'),
                                  weight=row_weight(weights[row], where),
                                  columns=row_columns(extra, row)))
    return documents


def string_column(table: Table, file: Path, field: str) -> list[Any]:
    import pyarrow as pa

    kind = column_type(table, file, field, "data.text_field")
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
        raise DataError(f"data.text_field {field!r} of {file} is a column of {kind}, not of "
                        "strings; point data.text_field at the text column")
    return column_values(table, file, field)


# --------------------------------------------------------------------------- chat


def read_chat_source(path: Path, messages_field: str = "messages",
                     columns: tuple[str, ...] = ()) -> list[Conversation]:
    """Conversations of a Parquet/Arrow file or a shard directory, validated as chat
    JSONL is (``data.conversation.parse_conversation``) once the null fields Arrow
    gives absent message and tool-call keys are dropped."""
    fmt, files = shard_files(path)
    conversations = list(iter_chat_source(path, messages_field, columns))
    require_rows(path, fmt, files, len(conversations))
    return conversations


def iter_chat_source(path: Path, messages_field: str = "messages",
                     columns: tuple[str, ...] = ()) -> Iterator[Conversation]:
    """``read_chat_source``'s conversations in the same order, holding one shard file
    in memory at a time (``exactstep prepare``, P1); the caller counts them."""
    fmt, files = shard_files(path)
    if fmt == "jsonl":
        for file in files:
            for line in records(file, strict=True):
                yield parse_conversation(line.value, line.where, messages_field, columns)
        return
    with columnar_reader() as read:
        for file in files:
            table = read(file, fmt)
            if table is not None:
                yield from table_conversations(table, file, messages_field, columns)
                del table  # the next file replaces it, never joins it


def table_conversations(table: Table, file: Path, field: str,
                        columns: tuple[str, ...] = ()) -> list[Conversation]:
    """One ``Conversation`` per row, named ``<file> row <row>`` (the chat split and
    fingerprint use the content only)."""
    import pyarrow as pa

    kind = column_type(table, file, field, "data.messages_field")
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)
            or pa.types.is_fixed_size_list(kind) or pa.types.is_list_view(kind)):
        raise DataError(f"data.messages_field {field!r} of {file} is a column of {kind}, not "
                        "of lists of messages; point data.messages_field at the messages column")
    weights = weight_column(table, file)
    extra = declared_table_columns(table, file, columns)
    conversations = []
    for row, messages in enumerate(column_values(table, file, field)):
        record: dict[str, Any] = {field: without_nulls(messages)}
        if weights[row] is not None:
            record[WEIGHT_FIELD] = weights[row]
        record.update(row_columns(extra, row) or {})
        conversations.append(parse_conversation(record, f"{file} row {row}", field, columns))
    return conversations


def without_nulls(messages: Any) -> Any:
    """``messages`` with the null fields of every message and tool call dropped."""
    if not isinstance(messages, list):
        return messages
    return [drop_null_fields(m) if isinstance(m, dict) else m for m in messages]


def drop_null_fields(value: Any) -> Any:
    """Objects lose their null fields, recursively; everything else is kept as it is."""
    if isinstance(value, dict):
        return {k: drop_null_fields(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_null_fields(v) for v in value]
    return value


# --------------------------------------------------------------------------- columns


def declared_table_columns(table: Table, file: Path, columns: tuple[str, ...]
                           ) -> dict[str, list[Any]]:
    """Each declared column's values (``data.columns``); ``DataError`` listing the
    table's columns when one is absent."""
    for name in columns:
        column_type(table, file, name, "data.columns entry")
    return {name: column_values(table, file, name) for name in columns}


def row_columns(extra: dict[str, list[Any]], row: int) -> dict[str, Any] | None:
    """Row ``row``'s values of the declared columns, or ``None`` when none are."""
    return {name: values[row] for name, values in extra.items()} if extra else None


def column_type(table: Table, file: Path, field: str, key: str) -> Any:
    """The Arrow type of column ``field``; ``DataError`` listing the columns if absent."""
    if field not in table.column_names:
        columns = ", ".join(table.column_names) or "none"
        raise DataError(f"{key} {field!r} is not a column of {file}; columns: {columns}")
    return table.schema.field(field).type


def column_values(table: Table, file: Path, field: str) -> list[Any]:
    """Column ``field`` as Python values; a string that is not UTF-8 (Parquet does not
    check) is refused naming its row, never repaired."""
    column = table.column(field)
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        row = next(r for r in range(len(column)) if not decodes(column, r))
        raise DataError(f"{file} row {row}: column {field!r} holds text that is not valid "
                        "UTF-8; re-encode the data as UTF-8 or remove the row") from None


def decodes(column: Any, row: int) -> bool:
    try:
        column[row].as_py()
    except UnicodeDecodeError:
        return False
    return True


def weight_column(table: Table, file: Path) -> list[Any]:
    """The ``weight`` column's values (None per row when there is no such column)."""
    if WEIGHT_FIELD not in table.column_names:
        return [None] * table.num_rows
    return column_values(table, file, WEIGHT_FIELD)


def row_weight(value: Any, where: str) -> float | None:
    """A row's weight (L3): null means none; anything else is checked as in JSONL."""
    return None if value is None else parse_weight({WEIGHT_FIELD: value}, where)


def require_rows(path: Path, fmt: str, files: list[Path], rows: int) -> None:
    if not rows:
        raise DataError(f"data.source {path} holds no rows ({len(files)} .{fmt} file"
                        f"{'s' if len(files) != 1 else ''}); point data.source at data "
                        "with examples")


# --------------------------------------------------------------------------- datasets


@contextmanager
def columnar_reader() -> Iterator[Reader]:
    """A ``read(file, format)`` that loads one Parquet/Arrow file through ``datasets``
    (a ``pyarrow.Table``, or None for a file with no rows), offline and quiet, into
    memory, with a cache directory removed when the ``with`` block ends. The library's
    settings are process-wide: do not use ``datasets`` in another thread meanwhile."""
    datasets = import_datasets()
    with tempfile.TemporaryDirectory(prefix="exactstep-datasets-") as cache:
        with offline_and_quiet(datasets):
            yield lambda file, fmt: load_file(datasets, file, fmt, cache)


def import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError("reading Parquet or Arrow data needs the datasets library; install "
                          "exactstep[hf] or point data.source at a .jsonl file") from None
    return datasets


@contextmanager
def offline_and_quiet(datasets: Any) -> Iterator[None]:
    """The library offline, without download counting, progress bars, log lines or
    warnings, for the ``with`` block; its previous settings come back afterwards."""
    config = datasets.config
    switches = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_UPDATE_DOWNLOAD_COUNTS")
    saved = {name: getattr(config, name) for name in switches if hasattr(config, name)}
    bars_were_off = datasets.are_progress_bars_disabled()
    logger = logging.getLogger("datasets")
    level = logger.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True
        config.HF_UPDATE_DOWNLOAD_COUNTS = False
        logger.setLevel(logging.CRITICAL + 1)
        datasets.disable_progress_bars()
        try:
            yield
        finally:
            if not bars_were_off:
                datasets.enable_progress_bars()
            logger.setLevel(level)
            for name, value in saved.items():
                setattr(config, name, value)


def load_file(datasets: Any, file: Path, fmt: str, cache: str) -> Table | None:
    """One file as a ``pyarrow.Table`` in file order; None when it holds no rows."""
    import pyarrow as pa
    from datasets.exceptions import DatasetsError

    try:
        dataset = datasets.load_dataset(fmt, data_files=[glob.escape(str(file))],
                                        split="train", cache_dir=cache, keep_in_memory=True)
    except (DatasetsError, pa.ArrowException, ValueError, OSError) as exc:
        if count_rows(file, fmt) == 0:
            return None  # the library refuses an empty file; it holds no example
        reason = str(exc.__cause__ or exc).strip().splitlines()[0]
        raise DataError(f"{file} cannot be read as .{fmt} ({reason}); check or replace "
                        "the file") from None
    return dataset.with_format("arrow")[:] if dataset.num_rows else None


def count_rows(file: Path, fmt: str) -> int | None:
    """Rows of a Parquet/Arrow file read with pyarrow itself; None when unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            return pq.read_metadata(file).num_rows
        with pa.memory_map(str(file)) as source:
            try:
                return pa.ipc.open_stream(source).read_all().num_rows
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_file(source).read_all().num_rows
    except (pa.ArrowException, OSError):
        return None
