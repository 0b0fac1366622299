"""``lightning-megatron preprocess``: jsonl → megatron-core indexed dataset, read back with megatron-core."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from lightning_megatron.cli_parser import UsageError
from lightning_megatron.data import preprocess
from lightning_megatron.data.tokenizers import load_tokenizer, train_bpe_tokenizer

TEXTS = [
    f"Doc {i}: "
    + " ".join(["tensor", "pipeline", "data", "sequence", "parallel", "ünï", "日本"][: 1 + i % 7]) * (1 + i % 3)
    for i in range(40)
]
TEXTS[5] = ""  # an empty document: no tokens, no end-of-document id (as Megatron-LM's tool)
TEXTS[9] = 'quotes " and \\ backslashes\nand a newline'


def write_jsonl(path: Path, texts: list[str], *, key: str = "text", extra_lines: dict[int, str] | None = None) -> Path:
    """One JSON object per line; ``extra_lines`` inserts raw lines before the given 0-based positions."""
    lines = [json.dumps({key: t, "id": i}) for i, t in enumerate(texts)]
    for pos, raw in sorted((extra_lines or {}).items(), reverse=True):
        lines.insert(pos, raw)
    data = ("\n".join(lines) + "\n").encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def read_documents(prefix: Path) -> list[list[int]]:
    """The dataset's documents, via megatron-core's reader (document index → sequences → tokens)."""
    ds = IndexedDataset(str(prefix))
    bounds = ds.document_indices
    docs = []
    for d in range(len(bounds) - 1):
        docs.append([int(t) for s in range(bounds[d], bounds[d + 1]) for t in ds[s]])
    return docs


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(iter(TEXTS * 3), 320, out)
    return out / "tokenizer.json"


def run(*args: object) -> None:
    preprocess.main([str(a) for a in args] + ["--quiet"])


@pytest.mark.parametrize("append_eod", [False, True])
def test_round_trip_matches_direct_tokenization(tmp_path: Path, tokenizer_path: Path, append_eod: bool, capsys) -> None:
    src = write_jsonl(tmp_path / "corpus.jsonl", TEXTS, extra_lines={12: "", 30: "   "})  # blank lines: skipped
    prefix = tmp_path / "out" / "corpus"
    run("--input", src, "--output-prefix", prefix, "--tokenizer", tokenizer_path, *(["--append-eod"] * append_eod))

    tok = load_tokenizer(tokenizer_path)
    expected = [tok.encode(t) + ([tok.eod_id] if append_eod and t else []) for t in TEXTS]
    assert read_documents(prefix) == expected
    ds = IndexedDataset(str(prefix))
    assert ds.index.dtype == np.uint16  # optimal dtype for a small vocabulary
    assert len(ds) == len(TEXTS) - 1  # one sequence per non-empty document
    assert tok.decode(read_documents(prefix)[9]) == TEXTS[9] + ("<|endoftext|>" if append_eod else "")
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["corpus.bin", "corpus.idx"]  # no temporaries

    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1
    n_tokens = sum(map(len, expected))
    assert f"{len(TEXTS)} documents, {n_tokens} tokens" in summary[0]


def test_gzip_json_key_and_workers_give_identical_output(tmp_path: Path, tokenizer_path: Path) -> None:
    texts = TEXTS * 5
    plain = write_jsonl(tmp_path / "plain.jsonl", texts)
    gz = write_jsonl(tmp_path / "body.jsonl.gz", texts, key="body")
    common = ["--tokenizer", tokenizer_path, "--append-eod"]
    run("--input", plain, "--output-prefix", tmp_path / "one", "--workers", 1, *common)
    run("--input", gz, "--json-key", "body", "--output-prefix", tmp_path / "gz", *common)
    run("--input", plain, "--output-prefix", tmp_path / "two", "--workers", 2, "--chunk-size", 3, *common)
    for suffix in (".bin", ".idx"):
        reference = (tmp_path / f"one{suffix}").read_bytes()
        assert (tmp_path / f"gz{suffix}").read_bytes() == reference
        assert (tmp_path / f"two{suffix}").read_bytes() == reference
    assert len(read_documents(tmp_path / "two")) == len(texts)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"text": "unterminated', "invalid JSON"),
        ('{"body": "wrong key"}', "missing key 'text'"),
        ('{"text": 42}', "value of 'text' is int, expected a string"),
        ('["text"]', "expected a JSON object, got list"),
        (b'{"text": "bad utf-8 \xff"}'.decode("latin-1"), "invalid JSON"),
    ],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_line_names_file_and_line_and_leaves_nothing(
    tmp_path: Path, tokenizer_path: Path, bad_line: str, message: str, workers: int
) -> None:
    src = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": t}) for t in TEXTS]
    lines.insert(22, bad_line)  # line 23 of the file
    src.write_bytes("\n".join(lines).encode("latin-1" if "\xff" in bad_line else "utf-8", errors="surrogateescape"))
    out = tmp_path / "out"
    with pytest.raises(preprocess.PreprocessError, match=message) as info:
        run("--input", src, "--output-prefix", out / "corpus", "--tokenizer", tokenizer_path, "--workers", workers)
    assert f"{src}:23:" in str(info.value)
    assert list(out.iterdir()) == []


def test_train_tokenizer_on_the_input(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "corpus.jsonl.gz", TEXTS)
    prefix = tmp_path / "data" / "corpus"
    run("--input", src, "--output-prefix", prefix, "--tokenizer", "train:300", "--append-eod", "--workers", 2)
    tok_file = tmp_path / "data" / "corpus-tokenizer.json"
    tok = load_tokenizer(tok_file)
    assert tok.vocab_size <= 300
    docs = read_documents(prefix)
    assert [tok.decode(d[:-1]) for d in docs if d] == [t for t in TEXTS if t]
    assert all(d[-1] == tok.eod_id for d in docs if d)


def test_train_tokenizer_with_malformed_input_writes_nothing(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "corpus.jsonl", TEXTS, extra_lines={3: "not json"})
    with pytest.raises(preprocess.PreprocessError, match=r"corpus.jsonl:4: invalid JSON"):
        run("--input", src, "--output-prefix", tmp_path / "out" / "c", "--tokenizer", "train:300")
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize(
    ("lines", "message"),
    [([], "no documents"), (["", "  "], "no documents"), (['{"text": ""}'], "1 document\\(s\\) but no text")],
)
def test_input_without_text_is_refused(tmp_path: Path, tokenizer_path: Path, lines: list[str], message: str) -> None:
    """A dataset of no tokens and a tokenizer trained on nothing are no use: say so, and write nothing."""
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(line + "\n" for line in lines))
    for tokenizer in ("train:300", str(tokenizer_path)):
        with pytest.raises(preprocess.PreprocessError, match=message):
            preprocess.preprocess_jsonl(str(src), str(tmp_path / "out" / "c"), tokenizer, quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


def test_sentencepiece_tokenizer(tmp_path: Path) -> None:
    import sentencepiece

    (tmp_path / "corpus.txt").write_text("\n".join(t.replace("\n", " ") for t in TEXTS * 3), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=50,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    src = write_jsonl(tmp_path / "corpus.jsonl", TEXTS[:10])
    run("--input", src, "--output-prefix", tmp_path / "c", "--tokenizer", tmp_path / "sp.model", "--append-eod")
    tok = load_tokenizer(tmp_path / "sp.model")
    assert read_documents(tmp_path / "c") == [tok.encode(t) + [tok.eod_id] if t else [] for t in TEXTS[:10]]


def test_bad_arguments(tmp_path: Path, tokenizer_path: Path) -> None:
    src = write_jsonl(tmp_path / "corpus.jsonl", TEXTS[:3])
    with pytest.raises(ValueError, match="train:<vocab_size>"):
        run("--input", src, "--output-prefix", tmp_path / "c", "--tokenizer", "train:lots")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        run("--input", tmp_path / "missing.jsonl", "--output-prefix", tmp_path / "c", "--tokenizer", tokenizer_path)
    with pytest.raises(ValueError, match="workers"):
        run("--input", src, "--output-prefix", tmp_path / "c", "--tokenizer", tokenizer_path, "--workers", 0)
    with pytest.raises(UsageError, match="required: --output-prefix, --tokenizer"):
        preprocess.main(["--input", str(src)])  # missing required options
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]
