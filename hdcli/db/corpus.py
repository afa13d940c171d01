"""Reading user corpora for `hd build-stats`: files, globs and folders in, document texts out.

Formats (by extension, case-insensitive):
  .jsonl  one JSON object per line; the document is its `field` ("text" by default).
  .json   JSON lines too, or, when the file starts with `[`, one JSON array of objects (loaded
          whole, so JSON lines is the format for big corpora).
  .txt    documents are paragraphs: groups of lines separated by blank lines. A paragraph that grows
          past ~1 MB is cut there, so one huge paragraph never has to fit in memory.
  .parquet, .csv   read through `datasets` (streaming), same `field` rules.
  a folder saved by `datasets` (`save_to_disk`): read with `datasets.load_from_disk`; of a
          DatasetDict the "train" split, else the first one.

JSON lines are read here line by line rather than with `datasets`' json loader because a user corpus
is often a little dirty: we want to skip a malformed line and count it (or, with strict=True,
stop at it naming file:line), replace invalid UTF-8 and count where that happened, and name the
line and the fields present when `field` is missing. The json loader fails the whole file on the
first bad line and knows nothing about line numbers.

Every problem the user can fix is raised as a one-line HdError naming the file (and line).
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field as dc_field
from pathlib import Path

from hdcli.errors import HdError

SUPPORTED = (".jsonl", ".json", ".txt", ".parquet", ".csv")
SUPPORTED_TEXT = "supported: .jsonl .json .txt .parquet .csv, or a folder saved by datasets"
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

_TXT_CUT = 1 << 20   # a .txt document is cut when it grows past this many bytes
_HASH_BLOCK = 1 << 20
_BATCH = 1000        # rows per batch when iterating a `datasets` table
_GLOB_CHARS = re.compile(r"[*?[]")


@dataclass
class ReadReport:
    files: list[dict] = dc_field(default_factory=list)  # {"path", "bytes", "sha256"} per input
    documents: int = 0          # documents yielded
    skipped_malformed: int = 0  # malformed JSON lines, array items or records (text not a string) skipped
    first_malformed: str | None = None  # where and why, for the warning
    skipped_empty: int = 0      # records whose text was empty, whitespace or null
    replaced_non_utf8: int = 0  # json lines / txt documents / json array files with bytes replaced
    def counts(self) -> dict:
        """What was skipped or repaired, as reported by build-stats (--json "read")."""
        return {"skipped_malformed": self.skipped_malformed, "skipped_empty": self.skipped_empty,
                "replaced_non_utf8": self.replaced_non_utf8, "first_malformed": self.first_malformed}

    # The skipped_* and replaced_* counts cover every record read, also those another shard yields,
    # so each shard of a sharded run reports the same counts for the files it read in full.


# ---------------------------------------------------------------------------------------- inputs


def _is_datasets_folder(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in DATASETS_MARKERS)


def _supported_file(path: Path) -> bool:
    return path.suffix.lower() in SUPPORTED


def _expand_folder(top: Path) -> list[Path]:
    """Supported files under `top`, recursively; a datasets folder inside counts as one input."""
    found = []
    for root, dirs, files in os.walk(top):  # does not follow symlinked folders: no loops
        base = Path(root)
        keep = []
        for d in sorted(dirs):
            if d.startswith("."):  # .git, .cache, ...: never corpus data
                continue
            if _is_datasets_folder(base / d):
                found.append(base / d)  # its .json/.arrow files are not corpora of their own
            else:
                keep.append(d)
        dirs[:] = keep
        found += [base / f for f in sorted(files)
                  if not f.startswith(".") and _supported_file(base / f)]
    return found


def _inside_datasets_folder(path: Path, cache: dict) -> bool:
    for parent in path.parents:
        if parent not in cache:
            cache[parent] = _is_datasets_folder(parent)
        if cache[parent]:
            return True
    return False


def _expand_glob(pattern: str) -> list[Path]:
    matches = sorted(glob.glob(pattern, recursive=True))
    if not matches:
        raise HdError(f"corpus pattern {pattern} matches no files")
    found, cache = [], {}
    for m in map(Path, matches):
        # A pattern such as data/** also matches everything inside a datasets folder (its json
        # files, the split folders of a DatasetDict) and files such as README.md: those are not
        # corpora, so they are dropped rather than refused.
        if _inside_datasets_folder(m, cache):
            continue
        if m.is_dir():
            found += [m] if _is_datasets_folder(m) else _expand_folder(m)
        elif _supported_file(m):
            found.append(m)
    if not found:
        raise HdError(f"corpus pattern {pattern} matches no corpus files ({SUPPORTED_TEXT})")
    return found


_REMOTE: dict[Path, str] = {}  # local copy -> the URL it was fetched from (for messages, headers)


def _fetch_remote(url: str) -> list[Path]:
    """Local copies of the files an fsspec URL names (s3://, gs://, https://, hf://, file://, ...;
    globs allowed), fetched once per process by fsspec's simplecache under their own names."""
    import atexit
    import fsspec
    protocol = url.split("://", 1)[0]
    folder = Path(tempfile.mkdtemp(prefix="hd-corpus-"))
    atexit.register(shutil.rmtree, folder, True)
    try:
        local = fsspec.open_local(f"simplecache::{url}",
                                  simplecache={"cache_storage": str(folder), "same_names": True})
    except ImportError as e:
        raise HdError(f"{url}: reading {protocol}:// needs its fsspec filesystem package "
                      f"({_reason(e)}); install it where the build runs") from None
    except (FileNotFoundError, IndexError):
        raise HdError(f"corpus file {url} does not exist") from None
    except ValueError as e:
        raise HdError(f"{url}: {_reason(e)}") from None
    except OSError as e:
        raise HdError(f"cannot read corpus {url}: {_reason(e)}") from None
    paths = [Path(p) for p in (local if isinstance(local, list) else [local])]
    if not paths:
        raise HdError(f"corpus pattern {url} matches no files")
    remote = {Path(f.path).name: f"{protocol}://{f.path.lstrip('/')}" if protocol != "file" else
              f"file://{f.path}" for f in fsspec.open_files(url)} if _GLOB_CHARS.search(url) else {}
    for p in paths:
        _REMOTE[p] = remote.get(p.name, url)
    kept = [p for p in paths if _supported_file(p)]
    if not kept:
        raise HdError(f"corpus {url} has no corpus files ({SUPPORTED_TEXT})")
    return kept


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, glob patterns, folders and fsspec URLs -> the corpus inputs they name, sorted and
    deduplicated."""
    found: list[Path] = []
    for raw in inputs:
        if "://" in raw:
            found += _fetch_remote(raw)
            continue
        path = Path(raw)
        if path.is_dir():
            if _is_datasets_folder(path):
                found.append(path)
            else:
                inside = _expand_folder(path)
                if not inside:
                    raise HdError(f"corpus folder {raw} contains no corpus files "
                                  f"({SUPPORTED_TEXT})")
                found += inside
        elif path.exists():  # checked before globbing: a real file may have [ or * in its name
            if not _supported_file(path):
                raise HdError(f"corpus file {raw} has an unsupported type ({SUPPORTED_TEXT})")
            found.append(path)
        elif _GLOB_CHARS.search(raw):
            found += _expand_glob(raw)
        else:
            raise HdError(f"corpus file {raw} does not exist")
    unique: dict[Path, Path] = {}
    for p in found:
        unique.setdefault(p.resolve(), p)  # a.jsonl, ./a.jsonl and a glob hit are one input
    return sorted(unique.values())


# ------------------------------------------------------------------------------------ hashing


def _reason(e: BaseException) -> str:
    """One line saying what went wrong (messages of pyarrow and pandas can span lines)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _file_info(path: Path) -> dict:
    """Size and sha256 of an input, so a stats DB records exactly which data built it."""
    h = hashlib.sha256()
    try:
        if path.is_dir():
            # A datasets folder: its listing, then the contents of its .arrow files (the data; the
            # small json files beside them are covered by name and size).
            listing = []
            for root, dirs, files in os.walk(path):
                dirs.sort()
                for f in files:
                    full = Path(root) / f
                    listing.append((full.relative_to(path).as_posix(), full.stat().st_size))
            listing.sort()
            for name, size in listing:
                h.update(f"{name}\t{size}\n".encode())
            for name, _ in listing:
                if name.endswith(".arrow"):
                    _hash_file(path / name, h)
            size = sum(s for _, s in listing)
        else:
            size = _hash_file(path, h)
    except OSError as e:
        raise HdError(f"cannot read corpus file {path}: {_reason(e)}") from e
    return {"path": _REMOTE.get(path, str(path)), "bytes": size, "sha256": h.hexdigest()}


def _hash_file(path: Path, h) -> int:
    n = 0
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
            n += len(block)
    return n


# ---------------------------------------------------------------------------------- documents


def _decode(data: bytes, report: ReadReport) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        report.replaced_non_utf8 += 1
        return data.decode("utf-8", errors="replace")


def _kind(value) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def _names(keys) -> str:
    keys = [str(k) for k in keys]
    return ", ".join(keys[:20]) + (", ..." if len(keys) > 20 else "") if keys else "none"


def _text(rec: dict, where: str, field: str, with_prompt: bool, report: ReadReport,
          strict: bool = False) -> str | None:
    """The document of one record, or None when its text is empty or not a string (both counted;
    a record of the wrong type is malformed like a broken line: skipped, or an error if strict).
    A missing field is an error: it means the wrong --field far more often than a bad record."""
    if field not in rec:
        raise HdError(f"{where}: no field {field!r} (fields: {_names(rec)}); pass --field NAME")
    text = rec[field]
    if text is None:  # JSON null, or an empty cell of a table: no text, like ""
        text = ""
    if not isinstance(text, str):
        _malformed(where, f"field {field!r} is {_kind(text)}, not a string", strict, report, "record")
        return None
    if not text.strip():
        report.skipped_empty += 1
        return None
    if with_prompt:
        prompt = rec.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            _malformed(where, f"field 'prompt' is {_kind(prompt)}, not a string", strict, report, "record")
            return None
        if prompt and prompt.strip():
            text = prompt + "\n\n" + text
    return text


def no_documents(sources: list[dict], inputs, field: str, read: dict) -> HdError:
    """The error for a corpus that gave no documents: what was read and what was skipped."""
    names = ", ".join(Path(f["path"]).name for f in sources) or ", ".join(map(str, inputs))
    first = f" (first: {read['first_malformed']})" if read["first_malformed"] else ""
    return HdError(f"no documents in {names} (field '{field}'): {read['skipped_empty']} empty "
                   f"records, {read['skipped_malformed']} malformed lines or records{first}; "
                   "check the files and --field")


def _malformed(where: str, detail: str, strict: bool, report: ReadReport, what="line") -> None:
    if strict:
        raise HdError(f"{where}: malformed {'' if what == 'record' else 'JSON '}{what} ({detail})")
    report.skipped_malformed += 1
    if report.first_malformed is None:
        report.first_malformed = f"{where}: {detail}"


def _first_byte(path: Path) -> bytes:
    """The first non-whitespace byte of a file (after a UTF-8 BOM), b"" if there is none."""
    with open(path, "rb") as f:
        block = f.read(1 << 16).removeprefix(b"\xef\xbb\xbf")
        while block:
            if rest := block.lstrip():
                return rest[:1]
            block = f.read(1 << 16)
    return b""


def _json_records(path: Path, strict: bool, report: ReadReport) -> Iterator[tuple[str, dict]]:
    """(where, record) of a JSON-lines file or of a .json file holding one array of objects."""
    if path.suffix.lower() == ".json" and _first_byte(path) == b"[":
        yield from _json_array_records(path, strict, report)
        return
    # Binary lines: only b"\n" ends a line (text mode would also split at U+2028 and friends, which
    # JSON allows raw inside strings), and a line of any length is read whole.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue  # blank lines are formatting, not data
            line = _decode(raw, report)
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # BOM written by some Windows editors
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                _malformed(where, f"{e.msg} at column {e.colno}", strict, report)
                continue
            except (ValueError, RecursionError) as e:  # huge integers, absurd nesting
                _malformed(where, _reason(e), strict, report)
                continue
            if not isinstance(rec, dict):
                _malformed(where, f"{_kind(rec)}, not a JSON object", strict, report)
                continue
            yield where, rec


def _json_array_records(path: Path, strict: bool, report: ReadReport) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        text = _decode(f.read(), report).removeprefix("\ufeff")
    try:
        items = json.loads(text)
    except (ValueError, RecursionError) as e:
        # Not skipped even without strict: that would silently drop the whole file.
        detail = (f"{e.msg} at line {e.lineno} column {e.colno}"
                  if isinstance(e, json.JSONDecodeError) else _reason(e))
        raise HdError(f"{path}: not valid JSON ({detail}); expected JSON lines or one array "
                      f"of objects") from e
    for i, rec in enumerate(items, 1):
        where = f"{path}: item {i}"
        if isinstance(rec, dict):
            yield where, rec
        else:
            _malformed(where, f"{_kind(rec)}, not a JSON object", strict, report, "item")


def _utf8_boundary(data: bytes) -> int:
    """Where to cut `data` without splitting a UTF-8 character (before an unfinished last one)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            need = 1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return len(data) - back if need > back else len(data)
    return len(data)


def _txt_documents(path: Path, report: ReadReport) -> Iterator[str]:
    """Paragraphs of a text file, each cut into pieces of ~1 MB at most."""
    first = True

    def finish(data: bytes) -> str | None:
        nonlocal first
        text = _decode(data, report)
        if first:
            text, first = text.removeprefix("\ufeff"), False
        text = text.rstrip("\r\n")
        return text if text.strip() else None

    parts: list[bytes] = []
    size, line_start = 0, True
    with open(path, "rb") as f:
        # readline with a limit: a file that is one giant line still comes in 1 MB pieces.
        while piece := f.readline(_TXT_CUT):
            blank = line_start and not piece.strip()
            line_start = piece.endswith(b"\n")
            if blank:
                if parts and (doc := finish(b"".join(parts))):
                    yield doc
                parts, size = [], 0
                continue
            parts.append(piece)
            size += len(piece)
            if size >= _TXT_CUT:
                data = b"".join(parts)
                # cut mid-line: keep characters whole, the unfinished one goes to the next piece
                cut = len(data) if line_start else _utf8_boundary(data)
                if doc := finish(data[:cut]):
                    yield doc
                parts = [data[cut:]] if cut < len(data) else []
                size = len(data) - cut
    if parts and (doc := finish(b"".join(parts))):
        yield doc


def _table_records(path: Path, field: str, with_prompt: bool) -> Iterator[tuple[str, dict]]:
    """(where, row) of a parquet or csv file or of a datasets folder, through `datasets`."""
    kind = "folder saved by datasets" if path.is_dir() else path.suffix.lower()[1:] + " file"
    try:
        with _quiet_datasets():
            ds = _open_table(path, field, with_prompt)
        if ds is None:
            return
        batches = ds.iter(batch_size=_BATCH)
        row = 0
        while True:
            with _quiet_datasets():
                batch = next(batches, None)
            if batch is None:
                return
            for i in range(len(batch[field])):
                row += 1
                yield f"{path}: row {row}", {c: batch[c][i] for c in batch}
    except HdError:
        raise
    except Exception as e:  # corrupt file, bad CSV quoting, non-UTF-8 CSV, unreadable folder, ...
        raise HdError(f"cannot read corpus {kind} {path}: {_reason(e)}") from e


def _open_table(path: Path, field: str, with_prompt: bool):
    """The dataset of `path` with only the columns needed; None for a DatasetDict of no splits."""
    import datasets  # imported here: it takes a second or two and most commands never need it

    def wanted(columns: list[str]) -> list[str]:
        if field not in columns:
            raise HdError(f"{path}: no column {field!r} (columns: {_names(columns)}); "
                          f"pass --field NAME")
        return list(dict.fromkeys([field] + (["prompt"] if with_prompt and "prompt" in columns
                                             else [])))

    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if not ds:
                return None
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return _text_columns(path, ds.select_columns(wanted(ds.column_names)))  # only what is used
    # glob.escape: data_files is a pattern to datasets, and file names may contain [ or *.
    data_files = glob.escape(str(path))
    if path.suffix.lower() == ".parquet":
        ds = datasets.load_dataset("parquet", data_files=data_files, split="train", streaming=True)
        return _text_columns(path, ds.select_columns(wanted(list(ds.column_names or []))))
    # CSV: only the needed columns, all read as strings. Otherwise pandas guesses types per chunk (a
    # column of years becomes int, then fails at the first chunk with words) and turns cells such as
    # "NA" or "null" into missing values. Its column names are not known before reading: read the
    # header ourselves.
    columns = wanted(_csv_header(path))
    features = datasets.Features({c: datasets.Value("string") for c in columns})
    return datasets.load_dataset("csv", data_files=data_files, split="train", streaming=True,
                                 features=features, usecols=columns, na_filter=False)


def _text_columns(path: Path, ds):
    """A table's column has one type: a column that is not text fails the file, not each row
    (a JSON record of the wrong type, by contrast, is one malformed record)."""
    import datasets
    for name, feature in (ds.features or {}).items():
        if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            what = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__
            raise HdError(f"{path}: column {name!r} holds {what}, not text; pass --field NAME of a "
                          "text column")
    return ds


class _quiet_datasets:
    """datasets logs an error before raising it; we raise it as one HdError line: mute the log."""

    def __enter__(self):
        self.logger = logging.getLogger("datasets")
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def _csv_header(path: Path) -> list[str]:
    import csv
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        return next(csv.reader(f), [])


def _documents_of(path: Path, field: str, with_prompt: bool, strict: bool,
                  report: ReadReport) -> Iterator[str]:
    if path.is_dir():
        if not _is_datasets_folder(path):
            raise HdError(f"{path} is a directory, not a corpus file or a folder saved by datasets")
        records = _table_records(path, field, with_prompt)
    else:
        suffix = path.suffix.lower()
        if suffix == ".txt":  # no fields in plain text: field and with_prompt do not apply
            yield from _txt_documents(path, report)
            return
        if suffix in (".jsonl", ".json"):
            records = _json_records(path, strict, report)
        elif suffix in (".parquet", ".csv"):
            records = _table_records(path, field, with_prompt)
        else:
            raise HdError(f"corpus file {path} has an unsupported type ({SUPPORTED_TEXT})")
    for where, rec in records:
        if (text := _text(rec, where, field, with_prompt, report, strict)) is not None:
            yield text


def iter_documents(paths: list[Path], field: str = "text", with_prompt: bool = False,
                   limit: int | None = None, shard: tuple[int, int] = (0, 1), strict: bool = False,
                   report: ReadReport | None = None) -> Iterator[str]:
    """Document texts of `paths`, in order: files as given, records in file order.

    shard=(i, n) keeps the documents whose index in the unsharded stream is i mod n, so n runs with
    i = 0..n-1 split a corpus without overlap; limit then caps the documents this call yields.
    """
    i, n = shard
    if n < 1 or not 0 <= i < n:
        raise HdError(f"invalid shard {i}/{n}: need 0 <= i < n")
    if limit is not None and limit < 0:
        raise HdError(f"invalid limit {limit}: need 0 or more")
    # Arguments are checked above, eagerly; the reading itself is lazy.
    return _iter_documents([Path(p) for p in paths], field, with_prompt, limit, i, n, strict,
                           report if report is not None else ReadReport())


def _iter_documents(paths, field, with_prompt, limit, i, n, strict, report) -> Iterator[str]:
    if limit == 0:
        return
    index = yielded = 0
    for path in paths:
        try:
            for text in _documents_of(path, field, with_prompt, strict, report):
                index += 1
                if (index - 1) % n != i:
                    continue
                report.documents += 1
                yielded += 1
                yield text
                if limit is not None and yielded >= limit:
                    return  # stop reading: a limit is often used to sample a huge corpus quickly
        except OSError as e:
            raise HdError(f"cannot read corpus file {path}: {_reason(e)}") from e


def read_corpus(inputs: list[str], **kwargs) -> tuple[Iterator[str], ReadReport]:
    """expand_inputs, then the size and sha256 of every input, then iter_documents over them.

    The report's files are filled at once; its counts grow as the iterator is consumed.
    """
    paths = expand_inputs(inputs)
    report = ReadReport(files=[_file_info(p) for p in paths])
    return iter_documents(paths, report=report, **kwargs), report
