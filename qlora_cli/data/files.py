"""Dataset files to rows: which files a dataset entry names, in which format, and which rows a split keeps.

Formats: JSON Lines (`.jsonl`, or lines inside a `.json`), a JSON list (`.json`), Parquet, Arrow (IPC file
or stream, as `datasets` saves it) and CSV; the columnar ones through pyarrow. The text ones may be
gzip-compressed (`rows.jsonl.gz`). A folder (a hub dataset repo's snapshot, or `save_to_disk` output) is
split into train/validation/test files by name the way the hub does it, and `split: train[10:20%]` slices
the chosen split's rows; its files of no format read here are named in a note, never passed over unsaid.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from qlora_cli.core.errors import QLoraError
from qlora_cli.core.files import sha256_file
from qlora_cli.core.jsonl import (
    RepeatedKey,
    Row,
    first_repeated,
    json_error,
    json_lines,
    json_type,
    repeated_key,
    unique_keys,
)
from qlora_cli.core.wording import count
from qlora_cli.sources.dataset_files import DATA_SUFFIXES, FORMATS, GZIP

# Files `datasets` writes next to its data or passes over in a hub repo (its FILES_TO_IGNORE: the older
# repos' dataset_infos.json, a config.json); they describe the data and are not rows.
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json", "config.json"}
# A hub repo's dataset card: a folder's file that is not rows and goes without a note, as the metadata does.
DATASET_CARD = "README.md"
# The hub's split names found in file or folder names (datasets.data_files.SPLIT_KEYWORDS).
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
# Parquet conversions and pushed datasets name shards `<split>-00000-of-00003.<suffix>`.
_SHARD_NAME = re.compile(r"(?P<split>[\w.]+?)-\d{5}-of-\d{5}(?:-.*)?")
_SLICE = re.compile(r"^(?P<name>[\w.-]+)(?:\[(?P<start>[^:\]]*)(?::(?P<stop>[^\]]*))?\])?$")
# What separates the items of a JSON list: whitespace and one comma.
_BETWEEN_ITEMS = re.compile(r"\s*,?\s*")


@dataclass(frozen=True)
class SplitPart:
    """One `name[start:stop]` of a split expression; bounds are row counts or percents (as given)."""

    name: str
    start: str = ""
    stop: str | None = None

    def bounds(self, rows: int) -> tuple[int, int]:
        """Python slice semantics on `rows` rows; percents round to the closest row, as `datasets` does."""
        if self.stop is None and self.start:
            index = _bound(self.start, rows, self.text)
            index = index + rows if index < 0 else index
            if not 0 <= index < rows:
                raise QLoraError(
                    f"split '{self.text}': row {self.start} is out of range ({count(rows, 'row')})"
                )
            return index, index + 1
        start = _bound(self.start, rows, self.text) if self.start else 0
        stop = _bound(self.stop, rows, self.text) if self.stop else rows
        return slice(start, stop).indices(rows)[:2]

    @property
    def text(self) -> str:
        if self.stop is None:
            return f"{self.name}[{self.start}]" if self.start else self.name
        return f"{self.name}[{self.start}:{self.stop}]"


def _bound(text: str, rows: int, split: str) -> int:
    value = text.strip()
    try:
        if value.endswith("%"):
            percent = float(value[:-1])
            if not -100 <= percent <= 100:
                raise ValueError
            return round(percent * rows / 100)
        return int(value)
    except ValueError:
        raise QLoraError(
            f"split '{split}': {text!r} is not a row index or a percent like 20%; "
            "write e.g. train, train[:20%], train[10:100]"
        ) from None


def parse_split(text: str) -> list[SplitPart]:
    """`train`, `train[:20%]`, `train[10:100]`, `train[5]`, or parts joined by `+` (rows concatenated)."""
    parts = []
    for piece in text.split("+"):
        match = _SLICE.match(piece.strip())
        if match is None:
            raise QLoraError(
                f"split {text!r} is not a split expression; write e.g. train, train[:20%], train[10:100]"
            )
        part = SplitPart(match["name"], match["start"] or "", match["stop"])
        if part.stop is None and not part.start and "[" in piece:
            raise QLoraError(f"split {text!r}: empty brackets; write e.g. train[:20%]")
        parts.append(part)
    return parts


# ----- which files -----


def _suffix(name: str) -> str:
    """The suffix that names a file's format: `.jsonl`, or `.jsonl.gz` for one compressed with gzip."""
    path = PurePosixPath(name)
    return "".join(path.suffixes[-2:]) if path.suffix == GZIP else path.suffix


def _passed_over(name: str, *, is_dir: bool) -> bool:
    """Hidden files and folders (`.git/`, `.gitattributes`) and special folders (`__pycache__/`),
    which `datasets` passes over too."""
    return name.startswith(".") or (is_dir and name.startswith("__"))


def _folder_files(folder: Path) -> list[Path]:
    def kept(path: Path) -> bool:
        *dirs, name = path.relative_to(folder).parts
        return not _passed_over(name, is_dir=False) and not any(_passed_over(d, is_dir=True) for d in dirs)

    return sorted(p for p in folder.rglob("*") if p.is_file() and kept(p))


def _data_files_in(folder: Path) -> list[Path]:
    return [
        p for p in _folder_files(folder) if _suffix(p.name) in DATA_SUFFIXES and p.name not in METADATA_FILES
    ]


def unread_files(
    path: Path,
    *,
    data_files: str | list[str] | dict[str, str | list[str]] | None = None,
    subset: str | None = None,
) -> list[str]:
    """The files of a dataset folder in no format qlora reads (`notes.txt`, `rows.tsv`), relative to it,
    for a note: a file left out of training is never left out unsaid. Empty where data_files names the
    files, since one it names in no format is an error."""
    if data_files is not None or not path.is_dir():
        return []
    folder = path if subset is None else path / subset
    return [
        p.relative_to(path).as_posix()
        for p in _folder_files(folder)
        if _suffix(p.name) not in DATA_SUFFIXES and p.name != DATASET_CARD
    ]


def _split_of(relative: str) -> str | None:
    """The split a file belongs to by its name, or None when its name names none."""
    shard = _SHARD_NAME.fullmatch(relative.rsplit("/", 1)[-1])
    if shard and shard["split"] != "data":  # save_to_disk names every shard data-*, in a folder per split
        return shard["split"]
    words = re.split(r"[/\\._\- 0-9]+", relative.lower())
    for split, keywords in SPLIT_KEYWORDS.items():
        if any(word in keywords for word in words):
            return split
    return None


def group_by_split(names: list[str]) -> dict[str, list[str]]:
    """Relative file names grouped by split; names that name no split are all `train`, as on the hub."""
    splits: dict[str, list[str]] = {}
    for name in names:
        splits.setdefault(_split_of(name.removesuffix(_suffix(name))) or "", []).append(name)
    unnamed = splits.pop("", [])
    if not splits:
        return {"train": unnamed}
    if unnamed:
        splits.setdefault("train", []).extend(unnamed)
    return splits


def files_for_split(names: list[str], split: str, subset: str | None = None) -> list[str]:
    """Of a dataset repo's data files (relative names), those a split expression reads; all of them when
    a split is not there, so that reading can name the splits there are."""
    prefix = f"{subset}/" if subset else ""
    grouped = group_by_split(
        [
            n.removeprefix(prefix)
            for n in names
            if n.startswith(prefix) and PurePosixPath(n).name not in METADATA_FILES
        ]
    )
    chosen: list[str] = []
    for part in parse_split(split):
        if part.name not in grouped:
            return names
        chosen += [prefix + n for n in grouped[part.name] if prefix + n not in chosen]
    return chosen


def _named_files(root: Path, patterns: list[str], where: str) -> list[Path]:
    """The files glob patterns name, relative to root (an absolute pattern stands alone)."""
    files: list[Path] = []
    for pattern in patterns:
        base, relative = root, pattern
        if Path(pattern).is_absolute():
            base = Path(Path(pattern).anchor)
            relative = str(Path(pattern).relative_to(base))
        found = sorted(p for p in base.glob(relative) if p.is_file()) if base.is_dir() else []
        if not found:
            raise QLoraError(f"{where}: data_files {pattern!r} matches no file in {root}")
        files += [p for p in found if p not in files]
    return files


def split_files(
    path: Path,
    split: str,
    *,
    data_files: str | list[str] | dict[str, str | list[str]] | None = None,
    subset: str | None = None,
) -> list[Path]:
    """The files of `split` (a split name, without slice) under `path`.

    A file is the split `train`; so are the files a list of `data_files` names (a mapping names each
    split's), relative to `path`.
    """
    where = f"dataset {path}"
    if isinstance(data_files, dict):
        if split not in data_files:
            raise QLoraError(
                f"{where}: split '{split}' is not in data_files (it names {', '.join(sorted(data_files))})"
            )
        chosen = data_files[split]
        return _named_files(path, [chosen] if isinstance(chosen, str) else list(chosen), where)
    if data_files is not None:
        files = _named_files(path, [data_files] if isinstance(data_files, str) else list(data_files), where)
        return files if split == "train" else _no_split(where, split, {"train": files})
    if path.is_file():
        if split != "train":
            raise QLoraError(f"{where} is one file, which is the split 'train'; it has no split '{split}'")
        return [path]
    if not path.is_dir():
        raise QLoraError(f"{path}: dataset path does not exist")
    folder = path
    if subset is not None:
        folder = path / subset
        if not folder.is_dir():
            names = sorted(
                p.name for p in path.iterdir() if p.is_dir() and not _passed_over(p.name, is_dir=True)
            )
            raise QLoraError(
                f"{where}: no subset '{subset}' (its folders: {', '.join(names) or 'none'}); check `name`"
            )
    files = _data_files_in(folder)
    if not files:
        raise QLoraError(f"{folder}: folder has no {', '.join(DATA_SUFFIXES)} files")
    by_name = {file.relative_to(folder).as_posix(): file for file in files}
    grouped = group_by_split(list(by_name))
    if split not in grouped:
        _no_split(where, split, grouped)
    return [by_name[name] for name in grouped[split]]


def _no_split(where: str, split: str, grouped: dict) -> list[Path]:
    raise QLoraError(f"{where} has no split '{split}' (its splits: {', '.join(sorted(grouped))})")


# ----- reading rows -----


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _gzip_error(file: Path, error: Exception) -> QLoraError:
    """A corrupt or cut-short .gz, named in one line as a bad row is."""
    return QLoraError(f"{file}: cannot read as gzip ({_one_line(error)})")


def _text(file: Path) -> str:
    """A file's text, decompressed when it ends in .gz. A byte-order mark, which Windows editors write,
    is skipped, as `datasets` skips it."""
    try:
        if file.suffix != GZIP:
            return file.read_text(encoding="utf-8-sig")
        with gzip.open(file, "rt", encoding="utf-8-sig") as stream:
            return stream.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise _gzip_error(file, error) from None
    except (OSError, UnicodeDecodeError) as error:
        raise QLoraError(f"{file}: cannot read ({_one_line(error)})") from None


def _one_object(file: Path, text: str) -> None:
    """A pretty-printed object is valid JSON but no JSON Lines: say so, rather than that line 1 is invalid.
    (json.loads stops at the end of a JSON Lines file's first row, so this costs little.)"""
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return
    lines = len(text.strip().splitlines())
    if isinstance(whole, dict) and lines > 1:
        raise QLoraError(
            f"{file}: one JSON object over {lines} lines, not rows; write a JSON list of "
            "objects, or JSON Lines (one object a line)"
        )


def _json_rows(file: Path) -> Iterator[Row]:
    text = _text(file)
    if _suffix(file.name).removesuffix(GZIP) == ".jsonl" or not text.lstrip().startswith("["):
        # A .json file that is not a list is read as JSON Lines, as `datasets` does.
        _one_object(file, text)
        yield from json_lines(file, text)
        return
    try:
        items = json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as error:
        raise QLoraError(f"{file}:{error.lineno}: {json_error(error)}") from None
    except RepeatedKey as error:
        raise repeated_key(_item(file, _item_with_repeated_key(text)), error) from None
    for index, row in enumerate(items):
        where = _item(file, index)
        if not isinstance(row, dict):
            raise QLoraError(f"{where}: expected a JSON object, got {json_type(row)}")
        yield where, row


def _item(file: Path, index: int) -> str:
    return f"{file}: item {index}"


def _item_with_repeated_key(text: str) -> int:
    """The index of the JSON list's item that sets a key twice. json.loads cannot say where its hook
    refused, so the list is read again an item at a time, on this error path only."""
    decoder = json.JSONDecoder(object_pairs_hook=unique_keys)
    position, index = text.index("[") + 1, 0
    while True:
        position = _BETWEEN_ITEMS.match(text, position).end()
        try:
            _, position = decoder.raw_decode(text, position)
        except RepeatedKey:
            return index
        index += 1


def _table(file: Path, file_format: str):
    """A pyarrow Table of a Parquet, Arrow or CSV file; every CSV column is read as text."""
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.ipc
    import pyarrow.parquet

    try:
        if file_format == "parquet":
            return pyarrow.parquet.read_table(file)
        if file_format == "csv":
            source = _gunzipped(file) if file.suffix == GZIP else file
            with pyarrow.csv.open_csv(source) as reader:
                names = reader.schema.names
            convert = pyarrow.csv.ConvertOptions(
                column_types={name: pa.string() for name in names}, strings_can_be_null=False
            )
            return pyarrow.csv.read_csv(source, convert_options=convert)
        with pa.memory_map(str(file)) as source:
            try:
                return pyarrow.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pyarrow.ipc.open_stream(source).read_all()
    except (OSError, pa.ArrowException) as error:
        raise QLoraError(f"{file}: cannot read as {file_format} ({_one_line(error)})") from None


def _gunzipped(file: Path):
    """A .gz file's bytes decompressed by Python's gzip, as the JSON formats are, not by pyarrow, which
    says a bad one differently."""
    import pyarrow as pa

    try:
        with gzip.open(file) as stream:
            return pa.py_buffer(stream.read())
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise _gzip_error(file, error) from None


def read_rows(file: Path, file_format: str | None = None) -> Iterator[Row]:
    """Yield (where, row): `where` names the file and line, item or row for error messages."""
    suffix = _suffix(file.name)
    if file_format is None and suffix in DATA_SUFFIXES:
        file_format = FORMATS[suffix.removesuffix(GZIP)]
    if file_format is None:
        raise QLoraError(
            f"{file}: unsupported dataset file type {suffix!r} "
            f"(expected {', '.join(DATA_SUFFIXES)}, or set ds_type)"
        )
    if file_format == "json":
        yield from _json_rows(file)
        return
    table = _table(file, file_format)
    _refuse_repeated_columns(file, table.column_names)
    for index, row in enumerate(table.to_pylist()):
        yield f"{file}: row {index}", row


def _refuse_repeated_columns(file: Path, names: list[str]) -> None:
    """A CSV header or an Arrow schema may name a column twice, and a row read from it keeps the last
    column's value without a word, as json does a key set twice (core/jsonl.py's unique_keys)."""
    name = first_repeated(names)
    if name is not None:
        raise QLoraError(f"{file}: column {name!r} appears twice; keep one")


def read_split(
    path: Path,
    split: str,
    *,
    data_files: str | list[str] | dict[str, str | list[str]] | None = None,
    subset: str | None = None,
    file_format: str | None = None,
) -> list[Row]:
    """The rows `split` (e.g. `train[:20%]`, `train+test`) selects from `path`, in file order."""
    rows: list[Row] = []
    for part in parse_split(split):
        files = split_files(path, part.name, data_files=data_files, subset=subset)
        part_rows = [row for file in files for row in read_rows(file, file_format)]
        start, stop = part.bounds(len(part_rows))
        rows += part_rows[start:stop]
    return rows


def split_file_list(
    path: Path,
    split: str,
    *,
    data_files: str | list[str] | dict[str, str | list[str]] | None = None,
    subset: str | None = None,
) -> list[Path]:
    """Every file read_split reads for `split`, once each."""
    files: list[Path] = []
    for part in parse_split(split):
        files += [
            f for f in split_files(path, part.name, data_files=data_files, subset=subset) if f not in files
        ]
    return files


def fingerprint(file: Path) -> dict:
    """What a run records of a local data file it read, so that a resume can tell it changed: its size
    and a hash of all its bytes (a touched file that reads the same is no change)."""
    return {"path": str(Path(file).resolve()), "size": Path(file).stat().st_size, "sha256": sha256_file(file)}


def moved_files(recorded: list[dict], current: list[dict]) -> list[tuple[str, str]] | None:
    """When the files read now hold the recorded bytes in the recorded order, those found at another path,
    as (then, now): wherever they are, they are the same rows in the same order. None when they differ."""
    if [(e["size"], e["sha256"]) for e in recorded] != [(e["size"], e["sha256"]) for e in current]:
        return None
    return [
        (then["path"], now["path"])
        for then, now in zip(recorded, current, strict=True)
        if then["path"] != now["path"]
    ]


def changed_files(recorded: list[dict], current: list[dict]) -> list[str]:
    """How the files read now differ from the recorded ones, each as '<path> changed', '<path> was added'
    or '<path> is no longer read': a file added to a dataset's folder or its data_files counts as much
    as one changed in place, and so does the same files' reading order."""
    before = {entry["path"]: entry for entry in recorded}
    now = {entry["path"]: entry for entry in current}
    changed = []
    for path in sorted(before.keys() | now.keys()):
        if path not in now:
            changed.append(f"{path} is no longer read")
        elif path not in before:
            changed.append(f"{path} was added")
        elif before[path] != now[path]:
            changed.append(f"{path} changed")
    if not changed and recorded != current:
        changed.append(
            f"the order the data files are read in ({', '.join(e['path'] for e in current)}) changed"
        )
    return changed
