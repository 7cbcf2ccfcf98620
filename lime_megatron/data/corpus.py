"""Corpus input and indexed-dataset output for the data tools.

Inputs (`find_sources`): JSON lines (``.jsonl``/``.json``/``.ndjson``), parquet (``.parquet``)
and plain text (``.txt``/``.text``), each optionally gzip or zstd compressed (detected from the
file's first bytes; parquet and zstd need the ``data`` extra), given as files, directories (searched
recursively, hidden entries skipped) or glob patterns. A plain text file is one document, or one
document per non-blank line.

Reading is split in two so that the parsing can run in worker processes: `iter_chunks` (main
process) cuts each source into `Chunk`s of about `chunk_bytes`, and `parse_chunk` (any process)
turns a chunk into records, one text per requested key. Bad input never stops a run here: each
problem is counted in an `InputReport` with the first few locations, and the record is skipped
(all of its keys, so that per-key outputs stay aligned). `BadInputError` is for callers that
run with ``--strict``.

Outputs (`DatasetWriter`): megatron-core ``IndexedDatasetBuilder`` files written under
``*.partial`` names and renamed only by `DatasetWriter.commit`, so an interrupted run never
leaves a ``.bin``/``.idx`` pair that looks complete.
"""

import argparse
import glob
import gzip
import json
import os
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from lime_megatron.extras import requires_extra

if TYPE_CHECKING:  # an optional dependency (the ``data`` extra)
    import pyarrow as pa

JSONL, PARQUET, TEXT, LINES = "jsonl", "parquet", "text", "lines"
INPUT_FORMATS = ("auto", JSONL, PARQUET, TEXT)
TEXT_UNITS = ("file", "line")
EXTENSIONS = {".jsonl": JSONL, ".json": JSONL, ".ndjson": JSONL, ".parquet": PARQUET, ".txt": TEXT, ".text": TEXT}
COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")
GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
READ_ERRORS = (OSError, EOFError, zlib.error)
PARTIAL = ".partial"

PROBLEMS = {
    "malformed_json": "lines that are not a JSON object",
    "missing_key": "records without a requested key (or with null)",
    "not_a_string": "records whose value is not a string",
    "invalid_utf8": "records or files that are not valid UTF-8",
    "empty_document": "documents without text (empty, blank or no tokens)",
    "prompt_boundary": "prompt/response records whose joint tokens do not start with the prompt's",
    "unreadable_file": "files that could not be opened or read to the end",
}
MAX_EXAMPLES = 5


class BadInputError(ValueError):
    """Bad input met while running with ``--strict``."""


class InputReport:
    """Counts of input problems by kind, with the first `MAX_EXAMPLES` locations of each."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, kind: str, location: str, detail: str, count: int = 1) -> None:
        """Record `count` problems of `kind` (a key of `PROBLEMS`) at `location`."""
        self.counts[kind] += count
        examples = self.examples.setdefault(kind, [])
        if len(examples) < MAX_EXAMPLES:
            examples.append(f"{location}: {detail}")

    def merge(self, other: "InputReport") -> None:
        """Add the problems of `other` to this report."""
        for kind, count in other.counts.items():
            self.counts[kind] += count
            room = MAX_EXAMPLES - len(self.examples.setdefault(kind, []))
            self.examples[kind].extend(other.examples.get(kind, [])[: max(0, room)])

    @property
    def total(self) -> int:
        """Number of problems of all kinds."""
        return sum(self.counts.values())

    def first(self) -> str:
        """One line naming the first recorded problem."""
        kind = next(iter(self.examples))
        return f"{kind} ({PROBLEMS[kind]}) at {self.examples[kind][0]}"

    def lines(self) -> list[str]:
        """Human-readable summary, one problem kind per block."""
        if not self.total:
            return ["input problems: none"]
        out = [f"input problems: {self.total:,} (skipped)"]
        for kind, count in self.counts.items():
            out.append(f"  {kind}: {count:,} {PROBLEMS[kind]}")
            out.extend(f"    {example}" for example in self.examples[kind])
        return out


@dataclass(frozen=True)
class Source:
    """One input file and how to read it (`JSONL`, `PARQUET`, `TEXT` or `LINES`)."""

    path: str
    fmt: str


@dataclass
class Chunk:
    """A unit of parsing work: complete lines (bytes), a whole text file, or a parquet batch.

    `first` is the 1-based number of the first line, or the 0-based index of the first row;
    `disk_bytes` is how much of the file on disk it stands for (for progress bars).
    """

    source: Source
    payload: "bytes | pa.RecordBatch"  # a RecordBatch for PARQUET sources, bytes for the others
    first: int
    disk_bytes: int

    @property
    def nbytes(self) -> int:
        """Size of the uncompressed input it holds."""
        return len(self.payload) if isinstance(self.payload, bytes) else self.payload.nbytes


def format_of(path: str) -> str | None:
    """Input format implied by a file name (compression suffixes ignored), or None."""
    name = path.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return EXTENSIONS.get(os.path.splitext(name)[1])


def _walk(directory: str) -> Iterator[str]:
    """Files under `directory` in sorted order, skipping hidden files and directories."""
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        yield from (os.path.join(root, f) for f in sorted(files) if not f.startswith("."))


def _expand(path: str) -> tuple[list[str], bool]:
    """Files named by one input (file, directory or glob) and whether it was a directory/glob."""
    if os.path.isdir(path):
        return list(_walk(path)), True
    if os.path.exists(path):
        return [path], False
    matches = sorted(glob.glob(path, recursive=True))
    if not matches:
        raise FileNotFoundError(f"input not found: {path}")
    files = [f for m in matches for f in (_walk(m) if os.path.isdir(m) else [m])]
    return files, True


def _format_in(file: str, input_format: str, searched: bool) -> str | None:
    """Format to read `file` with, or None to ignore it (only for directory/glob members).

    A forced `input_format` applies to named files and to directory members without a known
    extension; members whose extension names another format are ignored.
    """
    fmt = format_of(file)
    if input_format == "auto" or fmt == input_format:
        return fmt
    return input_format if not searched or fmt is None else None


def find_sources(
    inputs: Sequence[str], input_format: str = "auto", text_unit: str = "file"
) -> tuple[list[Source], list[str]]:
    """Resolve input paths into sources, plus the directory/glob members that were ignored.

    A file named explicitly must have a known format unless `input_format` forces one.
    """
    sources, ignored = [], []
    for path in inputs:
        files, searched = _expand(path)
        for file in files:
            fmt = _format_in(file, input_format, searched)
            if fmt is None and not searched:
                raise ValueError(
                    f"cannot tell the format of {file} from its name; pass --input-format {'|'.join(INPUT_FORMATS[1:])}"
                )
            if fmt is None:
                ignored.append(file)
            else:
                sources.append(Source(file, LINES if fmt == TEXT and text_unit == "line" else fmt))
    if not sources:
        raise FileNotFoundError(f"no input files with a known format in: {' '.join(inputs)}")
    return sources, ignored


def add_input_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the input flags shared by the data tools (Megatron-LM names where they exist)."""
    group = parser.add_argument_group("input")
    group.add_argument("--input", nargs="+", required=True, help="files, directories or glob patterns")
    group.add_argument(
        "--input-format",
        default="auto",
        choices=INPUT_FORMATS,
        help="auto: from the file names (.jsonl/.json/.ndjson, .parquet, .txt/.text, each optionally .gz/.zst)",
    )
    group.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys / parquet columns to read")
    group.add_argument(
        "--text-unit",
        default="file",
        choices=TEXT_UNITS,
        help="plain text inputs: one document per file or per non-blank line",
    )
    group.add_argument("--strict", action="store_true", help="fail on the first bad input instead of skipping it")
    return parser


def sources_from_args(args: argparse.Namespace) -> tuple[list[Source], list[str]]:
    """`find_sources` for `add_input_args` flags; plain text allows a single key."""
    sources, ignored = find_sources(args.input, args.input_format, args.text_unit)
    if len(args.json_keys) > 1 and any(s.fmt in (TEXT, LINES) for s in sources):
        raise ValueError("plain text inputs have one field: pass a single --json-keys key")
    return sources, ignored


def check_strict(strict: bool, report: InputReport) -> None:
    """Raise `BadInputError` naming the first problem when `strict` and there is one."""
    if strict and report.total:
        raise BadInputError(f"bad input (--strict): {report.first()}")


def total_disk_bytes(sources: Sequence[Source]) -> int:
    """Sum of the sizes on disk of readable sources (0 for those that cannot be stat'ed)."""
    total = 0
    for source in sources:
        try:
            total += os.path.getsize(source.path)
        except OSError:
            pass
    return total


class _ZstdReader:
    """Reads a zstd stream of one or more frames; a truncated frame raises EOFError.

    (zstandard's own stream_reader ends silently at a truncated frame.)  Corrupt data raises
    OSError, one of the ``READ_ERRORS``.
    """

    def __init__(self, raw) -> None:
        with requires_extra("data"):
            import zstandard

        self._raw, self._context, self._error = raw, zstandard.ZstdDecompressor(), zstandard.ZstdError
        self._frame: zstandard.ZstdDecompressionObj | None = None
        self._buffer, self._pos = b"", 0

    def read(self, size: int) -> bytes:
        while self._pos >= len(self._buffer):
            compressed = self._raw.read(1 << 20)
            if not compressed:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("zstd data ends inside a frame (truncated file)")
                return b""
            try:
                self._buffer, self._pos = self._decompress(compressed), 0
            except self._error as err:
                raise OSError(str(err)) from err
        out = self._buffer[self._pos : self._pos + size]
        self._pos += len(out)
        return out

    def _decompress(self, compressed: bytes) -> bytes:
        out = []
        while compressed:
            if self._frame is None or self._frame.eof:
                self._frame = self._context.decompressobj()
            out.append(self._frame.decompress(compressed))
            compressed = self._frame.unused_data if self._frame.eof else b""
        return b"".join(out)


def _decompressed(raw):
    """A readable stream over `raw` (a buffered binary file), decompressing gzip or zstd."""
    magic = raw.peek(4)[:4]
    if magic.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw)
    if magic == ZSTD_MAGIC:
        return _ZstdReader(raw)
    return raw


def _tell(raw, fallback: int) -> int:
    """Position in the file on disk, or `fallback` where there is none (a pipe)."""
    try:
        return raw.tell()
    except OSError:
        return fallback


def _read(stream, size: int) -> tuple[bytes, Exception | None]:
    """Up to `size` bytes (fewer only at the end), and the error that stopped reading, if any.

    Reads in pieces of at most 1 MiB so that an error loses little of what came before it.
    """
    parts, remaining = [], size
    try:
        while remaining > 0:
            part = stream.read(min(remaining, 1 << 20))
            if not part:
                break
            parts.append(part)
            remaining -= len(part)
    except READ_ERRORS as err:
        return b"".join(parts), err
    return b"".join(parts), None


def _line_chunks(source: Source, chunk_bytes: int, report: InputReport) -> Iterator[Chunk]:
    """Chunks of whole lines of a (possibly compressed) line-oriented file.

    When reading fails part way (a truncated archive), the complete lines read before the
    failure are kept and the rest of the file is reported as unreadable.
    """
    line, consumed, carry, total = 1, 0, b"", 0
    try:
        with open(source.path, "rb") as raw:
            stream = _decompressed(raw)
            while True:
                block, error = _read(stream, chunk_bytes)
                data, total = carry + block, total + len(block)
                cut = len(data) if not (block or error) else data.rfind(b"\n") + 1
                carry = data[cut:]
                if cut:
                    position = _tell(raw, total)
                    yield Chunk(source, data[:cut], line, position - consumed)
                    line, consumed = line + data.count(b"\n", 0, cut), position
                if error:
                    raise error
                if not block:
                    return
    except READ_ERRORS as err:
        report.add("unreadable_file", f"{source.path}:{line}", f"stopped reading: {err}")


def _file_chunk(source: Source, report: InputReport) -> Iterator[Chunk]:
    """The whole (possibly compressed) file as one chunk."""
    try:
        with open(source.path, "rb") as raw:
            data, error = _read(_decompressed(raw), 1 << 62)
            if error:
                raise error
            yield Chunk(source, data, 1, _tell(raw, len(data)))
    except READ_ERRORS as err:
        report.add("unreadable_file", source.path, str(err))


def _parquet_schema_problem(schema, keys: Sequence[str]) -> tuple[str, str] | None:
    """(problem kind, detail) when a requested column is absent or not a string column."""
    with requires_extra("data"):
        import pyarrow as pa

    for key in keys:
        if key not in schema.names:
            return "missing_key", f"no column {key!r} (columns: {', '.join(schema.names)})"
        kind = schema.field(key).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            return "not_a_string", f"column {key!r} has type {kind}"
    return None


def _parquet_chunks(source: Source, keys: Sequence[str], chunk_bytes: int, report: InputReport) -> Iterator[Chunk]:
    """Record batches of about `chunk_bytes` (by the file's own size statistics)."""
    with requires_extra("data"):
        import pyarrow as pa
        import pyarrow.parquet as pq

    row = 0
    try:
        parquet = pq.ParquetFile(source.path)
        meta, size = parquet.metadata, os.path.getsize(source.path)
        problem = _parquet_schema_problem(parquet.schema_arrow, keys)
        if problem:
            report.add(problem[0], source.path, problem[1], count=meta.num_rows)
            return
        data_bytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        rows = max(1, chunk_bytes * meta.num_rows // max(1, data_bytes))
        for batch in parquet.iter_batches(batch_size=rows, columns=list(keys), use_threads=False):
            yield Chunk(source, batch, row, size * batch.num_rows // max(1, meta.num_rows))
            row += batch.num_rows
    except (*READ_ERRORS, pa.ArrowException) as err:
        report.add("unreadable_file", f"{source.path} row {row}", str(err))


def iter_chunks(
    sources: Sequence[Source], keys: Sequence[str], chunk_bytes: int, report: InputReport
) -> Iterator[Chunk]:
    """All chunks of all sources in order; unreadable files are recorded in `report`."""
    for source in sources:
        if source.fmt == PARQUET:
            yield from _parquet_chunks(source, keys, chunk_bytes, report)
        elif source.fmt == TEXT:
            yield from _file_chunk(source, report)
        else:
            yield from _line_chunks(source, chunk_bytes, report)


def location(chunk: Chunk, number: int) -> str:
    """Where record `number` of `chunk` is, for problem reports."""
    if chunk.source.fmt == PARQUET:
        return f"{chunk.source.path} row {number}"
    return f"{chunk.source.path}:{number}"


def _checked(
    values: Sequence, keys: Sequence[str], chunk: Chunk, number: int, report: InputReport
) -> tuple[str, ...] | None:
    """`values` as a tuple of texts, or None (reported) when one is missing, bad or empty."""
    for key, value in zip(keys, values):
        problem = None
        if value is None:
            problem = "missing_key", f"no {key!r} value"
        elif not isinstance(value, str):
            problem = "not_a_string", f"{key!r} is a {type(value).__name__}"
        elif not value.strip():
            problem = "empty_document", f"{key!r} has no text"
        else:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                problem = "invalid_utf8", f"{key!r} has an unpaired surrogate at {err.start}"
        if problem:
            report.add(problem[0], location(chunk, number), problem[1])
            return None
    return tuple(values)


def _decoded_lines(chunk: Chunk, report: InputReport) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a chunk; lines that are not UTF-8 are reported."""
    try:
        lines = chunk.payload.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        lines = None
    if lines is not None:
        yield from enumerate(lines, chunk.first)
        return
    for number, raw in enumerate(chunk.payload.split(b"\n"), chunk.first):
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as err:
            report.add("invalid_utf8", location(chunk, number), f"{err.reason} at byte {err.start}")


Record = tuple[int, tuple[str, ...]]


def _parse_jsonl(chunk: Chunk, keys: Sequence[str], report: InputReport) -> list[Record]:
    records = []
    for number, line in _decoded_lines(chunk, report):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as err:
            report.add("malformed_json", location(chunk, number), str(err))
            continue
        if not isinstance(obj, dict):
            report.add("malformed_json", location(chunk, number), f"a JSON {type(obj).__name__}, not an object")
            continue
        texts = _checked([obj.get(key) for key in keys], keys, chunk, number, report)
        if texts:
            records.append((number, texts))
    return records


def _parse_lines(chunk: Chunk, keys: Sequence[str], report: InputReport) -> list[Record]:
    return [(number, (line.rstrip("\r"),)) for number, line in _decoded_lines(chunk, report) if line.strip()]


def _parse_text(chunk: Chunk, keys: Sequence[str], report: InputReport) -> list[Record]:
    try:
        text = chunk.payload.decode("utf-8")
    except UnicodeDecodeError as err:
        line = chunk.payload.count(b"\n", 0, err.start) + 1
        report.add("invalid_utf8", location(chunk, line), f"{err.reason} at byte {err.start}")
        return []
    texts = _checked([text], keys, chunk, 1, report)
    return [(1, texts)] if texts else []


def _parse_parquet(chunk: Chunk, keys: Sequence[str], report: InputReport) -> list[Record]:
    batch = cast("pa.RecordBatch", chunk.payload)  # a PARQUET source's chunk (see _parquet_chunks)
    columns = [batch.column(key).to_pylist() for key in keys]
    records = []
    for number, values in enumerate(zip(*columns), chunk.first):
        texts = _checked(values, keys, chunk, number, report)
        if texts:
            records.append((number, texts))
    return records


_PARSERS = {JSONL: _parse_jsonl, LINES: _parse_lines, TEXT: _parse_text, PARQUET: _parse_parquet}


def parse_chunk(chunk: Chunk, keys: Sequence[str], report: InputReport) -> list[Record]:
    """Records ``(line or row number, (text per key))`` of a chunk; problems go to `report`.

    Plain text sources have one field, stored under the first key.
    """
    return _PARSERS[chunk.source.fmt](chunk, keys, report)


def iter_documents(
    sources: Sequence[Source], keys: Sequence[str], report: InputReport, chunk_bytes: int = 4 << 20
) -> Iterator[tuple[str, ...]]:
    """Texts (one per key) of every good record of `sources`, read in this process."""
    for chunk in iter_chunks(sources, keys, chunk_bytes, report):
        for _, texts in parse_chunk(chunk, keys, report):
            yield texts


def dataset_paths(prefix: str) -> tuple[str, str]:
    """The (.bin, .idx) paths of an indexed dataset prefix."""
    return prefix + ".bin", prefix + ".idx"


def dataset_prefix(path: str) -> str:
    """A dataset prefix from a prefix or a path to its .bin/.idx file."""
    root, ext = os.path.splitext(path)
    return root if ext in (".bin", ".idx") else path


def require_dataset(prefix: str) -> None:
    """Raise FileNotFoundError unless both files of the dataset at `prefix` exist."""
    missing = [p for p in dataset_paths(prefix) if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"dataset {prefix} is incomplete: no {', '.join(missing)}")


def token_dtype(vocab_size: int) -> type:
    """The token dtype megatron-core picks for a vocabulary (uint16 below 65500, else int32)."""
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


class DatasetWriter:
    """Indexed datasets written side by side under ``.partial`` names until `commit`.

    Use as a context manager: leaving it without `commit` (an error, Ctrl-C) removes the
    partial files; a killed process leaves only ``.partial`` files, never a ``.bin``/``.idx``
    pair. `commit` deletes any older ``.idx`` before moving the new ``.bin`` and ``.idx`` into
    place, so a pair under the final names is always complete and consistent.
    """

    def __init__(self, prefixes: Sequence[str], dtype: type) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefixes = list(prefixes)
        self._builders = []
        for prefix in self.prefixes:
            os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
            bin_path = dataset_paths(prefix)[0] + PARTIAL
            self._builders.append(IndexedDatasetBuilder(bin_path, dtype=dtype))

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.abort()

    def add_documents(self, index: int, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents (concatenated `tokens`) to dataset `index`; `lengths` ``[documents]``
        (one sequence each) or ``[documents, sequences]`` (the sequence lengths of each)."""
        builder = self._builders[index]
        per_document = lengths[:, None] if lengths.ndim == 1 else lengths
        ends = np.cumsum(per_document.sum(axis=1)).tolist()
        for start, end, sequences in zip([0] + ends[:-1], ends, per_document.tolist()):
            builder.add_document(tokens[start:end], sequences)

    def add_dataset(self, index: int, prefix: str) -> None:
        """Append every document of the existing dataset `prefix` to dataset `index`."""
        self._builders[index].add_index(prefix)

    def commit(self) -> None:
        """Write the indexes and move all datasets to their final names."""
        for builder, prefix in zip(self._builders, self.prefixes):
            builder.finalize(dataset_paths(prefix)[1] + PARTIAL)
        for prefix in self.prefixes:
            bin_path, idx_path = dataset_paths(prefix)
            if os.path.exists(idx_path):
                os.remove(idx_path)
            os.replace(bin_path + PARTIAL, bin_path)
            os.replace(idx_path + PARTIAL, idx_path)
        self._builders = []

    def abort(self) -> None:
        """Close and delete the partial files of an uncommitted write (no-op after commit)."""
        for builder, prefix in zip(self._builders, self.prefixes):
            builder.data_file.close()
            for path in dataset_paths(prefix):
                if os.path.exists(path + PARTIAL):
                    os.remove(path + PARTIAL)
        self._builders = []
