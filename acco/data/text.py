"""Reading raw data: documents for pretraining, records for instruction fine-tuning.

Local files (.txt, .jsonl, .json, .parquet), folders of them, or a Hugging Face Hub dataset
name. JSON and Parquet go through `datasets.load_dataset`, as users of the HF stack expect;
plain text is split here. Every failure a user can cause is a one-line `DataError` that names
the file (and the line or record where we can tell).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

from .errors import LOCAL_SUFFIXES, DataError, describe, looks_like_local_path, one_line, string_field_problem

EOS_LINE = "<|endoftext|>"


def load_documents(
    path_or_name: str | os.PathLike, text_column: str = "text", cache_dir: str | None = None
) -> list[str]:
    """The non-empty documents of a file, a folder of files, or a Hub dataset's train split.

    - .txt: documents are separated by lines that are exactly `<|endoftext|>` (the TinyStories
      files) when the file has such a line, otherwise by blank lines;
    - .jsonl / .json / .parquet: the `text_column` of every row;
    - a folder: every such file under it, in sorted path order;
    - anything else that is not a local path: `datasets.load_dataset(name, split="train")`.
    `cache_dir` is passed to `datasets` (where it keeps its Arrow copy of the data).
    """
    spec = os.fspath(path_or_name)
    docs: list[str] = []
    for source in corpus_sources(spec):
        if isinstance(source, Path) and source.suffix == ".txt":
            docs.extend(_read_txt(source))
            continue
        rows = _load_table(source, cache_dir)
        if text_column not in rows.column_names:
            raise _no_column(source, text_column, rows.column_names)
        for i, text in enumerate(rows[text_column]):
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(f"{_row(source, i)}: {text_column!r} is {describe(text)}, not a string")
            docs.append(text)

    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"{spec}: no documents (every text is empty)")
    return docs


def open_documents(
    path_or_name: str | os.PathLike, text_column: str = "text", cache_dir: str | None = None
):
    """The corpus of `load_documents`, without reading it into memory where it can be avoided.

    Table data (.jsonl/.json/.parquet, folders of only those, Hub datasets) comes back as a
    `datasets.Dataset` with the one column `text_column`: Arrow keeps it memory-mapped on disk,
    so an openwebtext-sized corpus costs every worker next to no memory, and packing tokenizes
    it with `Dataset.map`. Empty and missing texts are skipped when tokenizing. Anything with
    .txt files is read by `load_documents` into a list of strings.
    """
    spec = os.fspath(path_or_name)
    sources = corpus_sources(spec)
    if any(isinstance(s, Path) and s.suffix == ".txt" for s in sources):
        return load_documents(spec, text_column, cache_dir)
    import datasets

    tables = []
    for source in sources:
        rows = _load_table(source, cache_dir)
        if text_column not in rows.column_names:
            raise _no_column(source, text_column, rows.column_names)
        if getattr(rows.features[text_column], "dtype", None) not in ("string", "large_string"):
            raise DataError(_not_strings(source, rows, text_column))
        tables.append(rows.select_columns([text_column]))
    corpus = tables[0] if len(tables) == 1 else datasets.concatenate_datasets(tables)
    if len(corpus) == 0:
        raise DataError(f"{spec}: no documents")
    if any(isinstance(s, Path) for s in sources):  # datasets keys local files by path and mtime only
        signed = f"{corpus._fingerprint} {_files_signature(sources)}"
        corpus._fingerprint = hashlib.sha256(signed.encode()).hexdigest()
    return corpus


def _no_column(source: Path | str, text_column: str, columns: list[str]) -> DataError:
    """A table without the text column; instruction records (read as documents) say what reads them."""
    instruct = {"instruction", "output"} <= set(columns)
    hint = ("; these are instruction records: data=alpaca data.path=... fine-tunes on them "
            "(docs/training.md, 'Instruction data')") if instruct else ""  # fmt: skip
    return DataError(f"{_where(source)} has no column {text_column!r} (columns: {', '.join(columns)}){hint}")


def _not_strings(source: Path | str, rows, text_column: str) -> str:
    """Why the column `text_column` of the table `rows` (read from `source`) is not text: its
    first value that is neither a string nor null, by row (and line), or that it holds no value."""
    for start in range(0, len(rows), 1000):
        for i, value in enumerate(rows[start : start + 1000][text_column], start):
            if value is not None and not isinstance(value, str):
                return f"{_row(source, i)}: {text_column!r} is {describe(value)}, not a string"
    return f"{_where(source)}: column {text_column!r} holds no strings (every value is null)"


def _files_signature(files) -> str:
    """Each local file's path, size, modification time and its first and last MiB: an edit that
    keeps the file's timestamp (a copy with cp -p, touch -r) still changes the cache keys."""
    h = hashlib.sha256()
    for path in files:
        st = path.stat()
        h.update(f"{path.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            if st.st_size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                h.update(f.read(1 << 20))
    return h.hexdigest()


@contextlib.contextmanager
def quiet_datasets():
    """datasets' own logs (and bars, where it is imported already) while acco.validate checks the
    data: they would only repeat, in other words, the one line it prints ("Failed to load JSON
    ..."). Where datasets is not imported yet (it costs a second), DATASETS_VERBOSITY sets its
    first level."""
    module = sys.modules.get("datasets")
    if module is not None:
        verbosity, bars = module.logging.get_verbosity(), module.is_progress_bar_enabled()
        module.logging.set_verbosity(module.logging.CRITICAL)
        module.disable_progress_bars()
    with temporary_environ("DATASETS_VERBOSITY", "critical" if module is None else None):
        try:
            yield
        finally:
            if module is not None:
                module.logging.set_verbosity(verbosity)
                if bars:
                    module.enable_progress_bars()
            elif "datasets" in sys.modules:  # imported here: its default level from now on
                sys.modules["datasets"].logging.set_verbosity_warning()


@contextlib.contextmanager
def temporary_environ(name: str, value: str | None):
    """The environment variable `name` set to `value` inside the block (None: left as it is),
    restored after it."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def is_hf_dataset(data) -> bool:
    """True for a `datasets.Dataset` (checked without importing datasets, which is slow)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(data, module.Dataset)


def text_bytes(docs, text_column: str = "text") -> int:
    """UTF-8 bytes of the documents; for a memory-mapped Dataset its Arrow size (no reading)."""
    if is_hf_dataset(docs):
        return docs.data.nbytes
    return sum(len(d.encode("utf-8")) for d in docs)


def corpus_fingerprint(docs, text_column: str = "text") -> str:
    """A sha256 that changes whenever the documents' content does, for cache keys.

    A `datasets.Dataset` has its own fingerprint, derived by `datasets` from the source files
    and every transform since (`open_documents` adds each local file's size, time and ends):
    hashing it instead of the texts keeps a cache lookup instant on a large corpus. A list is
    hashed text by text.
    """
    h = hashlib.sha256()
    if is_hf_dataset(docs):
        h.update(f"dataset {docs._fingerprint} column={text_column}".encode())
        return h.hexdigest()
    h.update(f"texts n={len(docs)}\n".encode())
    for doc in docs:
        data = doc.encode("utf-8")
        # Length-prefixed, so that ["ab", "c"] and ["a", "bc"] get different keys.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def load_records(path_or_name: str | os.PathLike, cache_dir: str | None = None) -> list[dict]:
    """Instruction records (Alpaca form) from .jsonl/.json/.parquet, a folder of them, or the Hub.

    Every record needs string `instruction` and `output` fields; `input` is optional ("" when
    missing). Records are returned as dicts, in file order.
    """
    spec = os.fspath(path_or_name)
    records: list[dict] = []
    for source in corpus_sources(spec):
        if isinstance(source, Path) and source.suffix == ".txt":
            raise DataError(f"{source}: instruction records must be .jsonl, .json or .parquet, not .txt")
        table = _load_table(source, cache_dir).to_list()
        for i, record in enumerate(table):
            for key in ("instruction", "output"):
                if string_field_problem(record, key):
                    raise DataError(_bad_record(source, i, record, key))
            if record.get("input") is None:
                record["input"] = ""
        records.extend(table)
    if not records:
        raise DataError(f"{spec}: no records")
    return records


def _bad_record(source: Path | str, index: int, record: dict, key: str) -> str:
    """The message for record `index` of `source`, whose `key` is not a string: told from the file
    itself where it is JSON (the table holds a null where a row lacks a field that others have)."""
    located, raw = _json_line(source, index), None
    if located:
        raw = located[1]
    elif isinstance(source, Path) and source.suffix == ".json":  # one JSON array of the records
        with contextlib.suppress(ValueError):
            array = json.loads(source.read_text(encoding="utf-8"))
            raw = array[index] if isinstance(array, list) and index < len(array) else None
    problem = string_field_problem(raw, key) if isinstance(raw, dict) else None
    where = f"line {located[0]} (record {index})" if located else f"record {index}"
    return f"{_where(source)}, {where}: {problem or string_field_problem(record, key)}"


def _json_line(source: Path | str, index: int) -> tuple[int, dict] | None:
    """(line number, parsed object) of row `index` of a JSON Lines file (datasets skips blank
    lines); None for any other source, or a line that does not parse to an object."""
    if not isinstance(source, Path) or source.suffix not in (".jsonl", ".json"):
        return None
    n = -1
    with source.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                return None  # not JSON Lines (a JSON array over several lines)
            if not isinstance(value, dict):
                return None
            n += 1
            if n == index:
                return lineno, value
    return None


def _row(source: Path | str, index: int) -> str:
    """Where row `index` of `source` is: the file and its line (JSON Lines), else its index."""
    located = _json_line(source, index)
    return f"{_where(source)}, " + (f"line {located[0]} (row {index})" if located else f"row {index}")


def corpus_sources(spec: str) -> list[Path | str]:
    """The local files to read, in order, or [spec] itself when it is a Hub dataset name (nothing
    is read: a missing file or an empty folder is told at once)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and p.suffix in LOCAL_SUFFIXES and not p.name.startswith(".")
        )
        if not files:
            raise DataError(f"{spec}: folder has no {'/'.join(LOCAL_SUFFIXES)} files")
        return files
    if path.is_file():
        if path.suffix not in LOCAL_SUFFIXES:
            raise DataError(
                f"{spec}: unsupported file type {path.suffix!r} (expected {', '.join(LOCAL_SUFFIXES)})"
            )
        return [path]
    if looks_like_local_path(spec):
        raise DataError(f"{spec}: no such file or folder")
    return [spec]  # a Hub name


def _read_txt(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    if not text.strip():
        raise DataError(f"{path}: empty file")

    lines = text.splitlines()
    if any(line.strip() == EOS_LINE for line in lines):
        docs, current = [], []
        for line in lines:
            if line.strip() == EOS_LINE:
                docs.append("\n".join(current))
                current = []
            else:
                current.append(line)
        docs.append("\n".join(current))
    else:
        # Paragraphs: runs of non-blank lines.
        docs, current = [], []
        for line in lines + [""]:
            if line.strip():
                current.append(line)
            elif current:
                docs.append("\n".join(current))
                current = []
    return [d.strip("\n") for d in docs if d.strip()]


def _load_table(source: Path | str, cache_dir: str | None):
    """A `datasets.Dataset` for one local json/jsonl/parquet file or one Hub name."""
    import datasets  # imported here: it is slow to import and .txt corpora do not need it

    if isinstance(source, str):
        try:
            return datasets.load_dataset(source, split="train", cache_dir=cache_dir)
        except Exception as e:  # the Hub raises many types; say which name failed and why
            raise DataError(f"cannot load dataset {source!r} from the Hugging Face Hub: {one_line(e)}") from e

    if _is_blank(source):
        raise DataError(f"{source}: empty file")
    builder = "parquet" if source.suffix == ".parquet" else "json"
    try:
        return datasets.load_dataset(builder, data_files=str(source), split="train", cache_dir=cache_dir)
    except Exception as e:
        located = _locate_json_error(source) if builder == "json" else None
        raise DataError(located or f"{source}: cannot read as {builder}: {one_line(e)}") from e


def _is_blank(path: Path) -> bool:
    """True for a file of only whitespace; stops at the first other byte (files may be huge)."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _locate_json_error(path: Path) -> str | None:
    """After `datasets` failed on a JSON file, find the first bad line to point the user at."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            # Not one JSON document; it may still be JSON Lines named .json, checked below.
            if not text.lstrip().startswith("{") or e.msg != "Extra data":
                return f"{path}, line {e.lineno}: malformed JSON ({e.msg})"
        else:
            return None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            return f"{path}, line {lineno}: malformed JSON ({e.msg})"
        if not isinstance(value, dict):
            return f"{path}, line {lineno}: expected a JSON object per line, got {type(value).__name__}"
    return None


def _where(source: Path | str) -> str:
    return str(source) if isinstance(source, Path) else f"dataset {source!r}"


def load_corpus(data):
    """Documents (pretraining) or instruction records (fine-tuning), as the ``data`` config says.
    Documents from table files or the Hub are a memory-mapped `datasets.Dataset`, not a list: an
    openwebtext-sized corpus then costs each worker next to no memory."""
    if data["name"] == "synthetic":
        from .synthetic import synthetic_corpus

        return synthetic_corpus(int(data["n_docs"]), seed=0)
    if data["format"] == "instruct":
        return load_records(str(data["path"]))
    return open_documents(str(data["path"]), text_column=data.get("text_column") or "text")
