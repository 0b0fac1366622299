"""Offline tokenizers: every fixture is trained here, on a few lines of text, so nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_megatron.data.tokenizers import EOD_TOKEN, Tokenizer, load_tokenizer, train_bpe_tokenizer

CORPUS = [
    f"Document {i}: the quick brown fox jumps over the lazy dog; ünïcödé, 日本語, emoji 🦊 and tabs\tnewlines\n."
    for i in range(100)
] + ["Pipeline stages pass activations forward and gradients backward."] * 20

SAMPLES = [CORPUS[7], "  leading spaces, trailing  ", "unseen words: zyxwvut Ωμέγα 🐉", ""]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE, saved both as tokenizer.json and as GPT-2's vocab.json + merges.txt."""
    out = tmp_path_factory.mktemp("bpe")
    tok = train_bpe_tokenizer(iter(CORPUS), 400, out)
    tok._tok.model.save(str(out))  # the raw BPE model: vocab.json + merges.txt
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "vocab.json", "merges.txt"}
    return out


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sentencepiece

    out = tmp_path_factory.mktemp("sp")
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(line.replace("\n", " ") for line in CORPUS), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(out / "sp"),
        vocab_size=350,
        model_type="bpe",
        byte_fallback=True,  # unseen characters become bytes, so they still decode back
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    corpus.unlink()
    return out / "sp.model"


def test_trained_bpe_round_trips_and_ids(bpe_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir / "tokenizer.json")
    assert isinstance(tok, Tokenizer)
    assert tok.eod_id == 0  # the only special token, added first
    assert 258 <= tok.vocab_size <= 400
    for text in SAMPLES:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode(CORPUS[3])) < len(CORPUS[3].encode()) / 2  # merges were learned
    # the marker is one special token, and decode shows it
    ids = tok.encode(f"a{EOD_TOKEN}b")
    assert tok.eod_id in ids and tok.decode(ids) == f"a{EOD_TOKEN}b"
    assert tok.decode(tok.encode("end") + [tok.eod_id]) == f"end{EOD_TOKEN}"


def test_every_way_of_naming_the_bpe_files_gives_the_same_tokenizer(bpe_dir: Path) -> None:
    reference = load_tokenizer(bpe_dir / "tokenizer.json")
    gpt2_dir = bpe_dir.parent / "gpt2-style"
    gpt2_dir.mkdir(exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        (gpt2_dir / name).write_bytes((bpe_dir / name).read_bytes())
    variants = [
        load_tokenizer(str(bpe_dir)),  # directory with tokenizer.json
        load_tokenizer(gpt2_dir),  # directory with vocab.json + merges.txt
        load_tokenizer(gpt2_dir / "vocab.json"),
        load_tokenizer(gpt2_dir / "merges.txt"),
        load_tokenizer((gpt2_dir / "merges.txt", gpt2_dir / "vocab.json")),
    ]
    for tok in variants:
        assert (tok.vocab_size, tok.eod_id) == (reference.vocab_size, reference.eod_id)
        for text in SAMPLES + [f"x{EOD_TOKEN}y"]:
            assert tok.encode(text) == reference.encode(text)
            assert tok.decode(tok.encode(text)) == text


def test_sentencepiece(sp_model: Path) -> None:
    for tok in (load_tokenizer(sp_model), load_tokenizer(sp_model.parent)):
        assert tok.vocab_size == 350
        assert tok.eod_id == 2  # sentencepiece's default </s>
        for text in SAMPLES:
            assert tok.decode(tok.encode(text)) == text
        assert tok.eod_id not in tok.encode(CORPUS[0])
    assert load_tokenizer(sp_model, eod_token="<s>").eod_id == 1


def test_explicit_eod_token(bpe_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir, eod_token="Ġthe")  # byte-level spelling of " the"
    assert [tok.eod_id] == tok.encode(" the")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        load_tokenizer(bpe_dir, eod_token="<|no such token|>")


def test_errors(tmp_path: Path, bpe_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_tokenizer(tmp_path / "gpt2")  # a hub name is not fetched
    with pytest.raises(FileNotFoundError, match="no tokenizer in directory"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="merges.txt"):
        load_tokenizer(tmp_path / "vocab.json")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match="unrecognised tokenizer file"):
        load_tokenizer(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(iter(CORPUS), 100, tmp_path / "small")


def test_train_to_a_json_path(tmp_path: Path) -> None:
    tok = train_bpe_tokenizer((t for t in CORPUS), 300, tmp_path / "sub" / "corpus-tokenizer.json")
    assert (tmp_path / "sub" / "corpus-tokenizer.json").is_file()
    assert load_tokenizer(tmp_path / "sub" / "corpus-tokenizer.json").encode(CORPUS[1]) == tok.encode(CORPUS[1])
