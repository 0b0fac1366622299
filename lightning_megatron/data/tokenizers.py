"""Offline tokenizers for data preparation: everything is read from local files, nothing is downloaded.

Data preparation only needs four things from a tokenizer: ``encode``, ``decode``, the vocabulary size
(which fixes the on-disk token dtype) and the end-of-document id (which separates documents once
megatron-core concatenates them into training sequences). :func:`load_tokenizer` gives exactly that for
the three formats found in practice, without ``transformers`` or a network connection:

* GPT-2 style byte-level BPE: ``vocab.json`` + ``merges.txt``;
* a Hugging Face ``tokenizer.json`` (what ``tokenizers`` and ``transformers`` save);
* a sentencepiece ``*.model`` (Llama 1/2, T5, ...).

:func:`train_bpe_tokenizer` builds a small byte-level BPE from a corpus, so examples and tests can prepare
data with no pre-existing tokenizer at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, Union, runtime_checkable

__all__ = ["EOD_TOKEN", "Tokenizer", "load_tokenizer", "train_bpe_tokenizer"]

#: The end-of-document token of GPT-2 and of the tokenizers built by :func:`train_bpe_tokenizer`.
EOD_TOKEN = "<|endoftext|>"

# Looked up in this order when a Hugging Face / BPE tokenizer does not name its end-of-document token.
_EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]", "<|im_end|>")

PathLike = Union[str, "os.PathLike[str]"]


@runtime_checkable
class Tokenizer(Protocol):
    """What data preparation needs from a tokenizer (a structural type: any object with these works)."""

    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class _HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from tokenizer.json or vocab.json + merges.txt) behind the small interface.

    ``encode`` adds no special tokens (no BOS from a post-processor): documents are separated by the
    end-of-document id, which the preprocessor appends itself when asked, as megatron-core's own tool does.
    ``decode`` keeps special tokens so that a decoded document shows where its end-of-document marker was.
    """

    def __init__(self, tokenizer: object, eod_token: str | None, source: str) -> None:
        self._tok = tokenizer
        self.path = source
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod_id: int = _find_eod(tokenizer.token_to_id, eod_token, source)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class _SentencePieceTokenizer:
    """A sentencepiece model behind the small interface; the end-of-document id is the model's ``</s>``."""

    def __init__(self, model_file: str, eod_token: str | None) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.path = model_file
        self.vocab_size: int = self._sp.get_piece_size()
        if eod_token is not None:
            eod = self._sp.piece_to_id(eod_token)
            if eod == self._sp.unk_id() and eod_token != self._sp.id_to_piece(eod):
                raise ValueError(f"{model_file}: end-of-document token {eod_token!r} is not in the vocabulary")
        else:
            eod = self._sp.eos_id()
            if eod < 0:
                raise ValueError(
                    f"{model_file}: the sentencepiece model has no end-of-sentence piece (eos_id = -1); "
                    "pass eod_token= naming the piece that ends a document"
                )
        self.eod_id: int = eod

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def _find_eod(token_to_id, eod_token: str | None, source: str) -> int:
    """The end-of-document id: the named token, else the first well-known one in the vocabulary.

    Failing loudly matters here: a wrong or missing separator silently glues documents together.
    """
    candidates = (eod_token,) if eod_token is not None else _EOD_CANDIDATES
    for token in candidates:
        token_id = token_to_id(token)
        if token_id is not None:
            return token_id
    if eod_token is not None:
        raise ValueError(f"{source}: end-of-document token {eod_token!r} is not in the vocabulary")
    raise ValueError(
        f"{source}: none of the usual end-of-document tokens {list(_EOD_CANDIDATES)} is in the vocabulary; "
        "pass eod_token= naming the token that ends a document"
    )


def _load_bpe_files(vocab: Path, merges: Path, eod_token: str | None) -> _HFTokenizer:
    """GPT-2 byte-level BPE from its two files, with GPT-2's pre-tokenizer and decoder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    for file in (vocab, merges):
        if not file.is_file():
            raise FileNotFoundError(f"byte-level BPE tokenizer: {file} does not exist")
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # GPT-2 keeps its end-of-text marker in vocab.json; registering it as special makes the literal string
    # in a text encode to the one id (as GPT-2's tokenizers do) instead of a run of byte pieces.
    for token in (eod_token,) if eod_token else _EOD_CANDIDATES:
        if tok.token_to_id(token) is not None:
            tok.add_special_tokens([AddedToken(token, special=True, normalized=False)])
            break
    return _HFTokenizer(tok, eod_token, f"{vocab} + {merges.name}")


def _load_tokenizer_json(file: Path, eod_token: str | None) -> _HFTokenizer:
    from tokenizers import Tokenizer

    return _HFTokenizer(Tokenizer.from_file(str(file)), eod_token, str(file))


def load_tokenizer(path_or_dir: PathLike | Sequence[PathLike], *, eod_token: str | None = None) -> Tokenizer:
    """Load a tokenizer from local files only.

    ``path_or_dir`` is one of:

    * a directory holding ``tokenizer.json``, or ``vocab.json`` + ``merges.txt``, or one ``*.model``
      (looked for in that order);
    * a ``tokenizer.json`` file (any ``*.json`` other than ``vocab.json``);
    * a ``vocab.json`` or ``merges.txt`` file (the other one is taken from the same directory), or the pair
      ``(vocab.json, merges.txt)``;
    * a sentencepiece ``*.model`` file.

    ``eod_token`` names the end-of-document token when the vocabulary's is not one of the usual ones
    (``<|endoftext|>``, ``</s>``, ...; sentencepiece: the model's eos piece).
    """
    if not isinstance(path_or_dir, (str, os.PathLike)):
        files = [Path(p) for p in path_or_dir]
        if len(files) != 2:
            raise ValueError(f"expected (vocab.json, merges.txt), got {len(files)} paths")
        vocab, merges = sorted(files, key=lambda p: p.suffix != ".json")
        return _load_bpe_files(vocab, merges, eod_token)

    path = Path(path_or_dir)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _load_tokenizer_json(path / "tokenizer.json", eod_token)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return _load_bpe_files(path / "vocab.json", path / "merges.txt", eod_token)
        models = sorted(path.glob("*.model"))
        if len(models) == 1:
            return _SentencePieceTokenizer(str(models[0]), eod_token)
        found = ", ".join(p.name for p in models) if models else "none"
        raise FileNotFoundError(
            f"no tokenizer in directory {path}: expected tokenizer.json, vocab.json + merges.txt, or exactly one "
            f"sentencepiece *.model (*.model files found: {found})"
        )
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer path {path} does not exist (tokenizers are never downloaded)")
    if path.name == "vocab.json":
        return _load_bpe_files(path, path.with_name("merges.txt"), eod_token)
    if path.name == "merges.txt":
        return _load_bpe_files(path.with_name("vocab.json"), path, eod_token)
    if path.suffix == ".json":
        return _load_tokenizer_json(path, eod_token)
    if path.suffix == ".model":
        return _SentencePieceTokenizer(str(path), eod_token)
    raise ValueError(
        f"unrecognised tokenizer file {path}: expected tokenizer.json, vocab.json/merges.txt or a sentencepiece *.model"
    )


def train_bpe_tokenizer(
    texts_iterator: Iterable[str], vocab_size: int, out_dir: PathLike, *, min_frequency: int = 2
) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style, ``<|endoftext|>`` as end of document) and save it.

    ``out_dir`` is a directory (the tokenizer goes to ``out_dir/tokenizer.json``) or, when it ends in
    ``.json``, the file to write. Returns the saved tokenizer, loaded back through :func:`load_tokenizer`
    so that what is returned is exactly what later runs will read. ``vocab_size`` counts the 256 byte
    symbols and the end-of-document token; a small corpus may yield fewer merges, hence a smaller
    ``vocab_size`` on the result.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size={vocab_size}: byte-level BPE needs at least 258 (256 bytes, eod, one merge)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        # Every byte is in the vocabulary, so any text encodes (no unknown tokens) and decodes back exactly.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts_iterator, trainer=trainer)

    out = Path(out_dir)
    file = out if out.suffix == ".json" else out / "tokenizer.json"
    file.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(file))
    return load_tokenizer(file)
