"""``lightning-megatron preprocess``: a jsonl corpus → megatron-core's indexed dataset (``.bin`` / ``.idx``).

    lightning-megatron preprocess --input corpus.jsonl.gz --output-prefix data/corpus \\
        --tokenizer tokenizer/ --append-eod --workers 8

One document per input line (``{"text": ...}``; ``.gz`` inputs are decompressed on the fly), written with
megatron-core's own ``IndexedDatasetBuilder`` so that ``GPTDataset`` / ``IndexedDataset`` read it as they
read the output of Megatron-LM's ``tools/preprocess_data.py``: one document per ``add_document``, one
sequence per non-empty document, token dtype from the vocabulary size (``DType.optimal_dtype``).

Why a tool of our own rather than Megatron-LM's script: megatron-core ships without it, and the script needs
Megatron-LM's tokenizer zoo (``transformers``, network downloads). Here tokenizers are local files
(:mod:`lightning_megatron.data.tokenizers`), or trained on the corpus itself with ``--tokenizer train:N``.

Output is all-or-nothing: the dataset is written under temporary names and renamed into place only after
the last document, so a malformed line (reported with file name and 1-based line number) or an interrupt
never leaves a half-written ``.bin``/``.idx`` that a later training run would silently read.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

import numpy as np

from lightning_megatron.data.tokenizers import Tokenizer, load_tokenizer, train_bpe_tokenizer

__all__ = ["PreprocessError", "PreprocessResult", "main", "preprocess_jsonl", "run"]

_TRAIN_PREFIX = "train:"


class PreprocessError(ValueError):
    """Input that cannot be tokenized: a malformed line (the message names the file and the 1-based line number)
    or a corpus without any text (a dataset of 0 documents and a tokenizer trained on nothing are no use)."""


@dataclass(frozen=True)
class PreprocessResult:
    """What was written, for callers that drive the preprocessor from Python."""

    documents: int
    tokens: int
    seconds: float
    bin_path: str
    idx_path: str
    tokenizer_path: Optional[str]


# A chunk of input: (1-based line number of its first line, raw lines as bytes).
_Chunk = tuple[int, list[bytes]]


def _open_input(path: str) -> IO[bytes]:
    """Bytes, not text: a bad UTF-8 sequence then fails in ``json.loads`` with its line number attached."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _read_chunks(path: str, chunk_size: int) -> Iterator[_Chunk]:
    with _open_input(path) as f:
        chunk: list[bytes] = []
        first = 1
        for lineno, line in enumerate(f, start=1):
            if not chunk:
                first = lineno
            chunk.append(line)
            if len(chunk) == chunk_size:
                yield first, chunk
                chunk = []
        if chunk:
            yield first, chunk


def _parse_line(line: bytes, lineno: int, path: str, key: str) -> Optional[str]:
    """The document text of one line; ``None`` for a blank line (a trailing newline is not a document)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise PreprocessError(f"{path}:{lineno}: invalid JSON ({e})") from None
    if not isinstance(record, dict):
        raise PreprocessError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    if key not in record:
        raise PreprocessError(f"{path}:{lineno}: missing key {key!r} (keys: {sorted(record)[:10]})")
    text = record[key]
    if not isinstance(text, str):
        raise PreprocessError(f"{path}:{lineno}: value of {key!r} is {type(text).__name__}, expected a string")
    return text


def _iter_texts(path: str, key: str) -> Iterator[str]:
    for first, lines in _read_chunks(path, 1024):
        for lineno, line in enumerate(lines, start=first):
            text = _parse_line(line, lineno, path, key)
            if text is not None:
                yield text


def _check_has_text(path: str, key: str) -> None:
    """Raise :class:`PreprocessError` unless some document of ``path`` has text (reads up to the first one)."""
    texts = _iter_texts(path, key)
    documents = 0
    try:
        for text in texts:
            if text:
                return
            documents += 1
    finally:
        texts.close()
    found = "no documents (it is empty or has only blank lines)"
    if documents:
        found = f"{documents} document(s) but no text (every {key!r} is empty)"
    raise PreprocessError(
        f"{path}: {found}; nothing to tokenize. Give a jsonl file with one {json.dumps({key: '...'})} per line."
    )


class _Encoder:
    """Parses and tokenizes chunks; one per worker process, so the tokenizer is loaded once per worker."""

    def __init__(self, tokenizer_path: str, path: str, key: str, append_eod: bool, dtype: type) -> None:
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer_path)
        self.path, self.key, self.append_eod, self.dtype = path, key, append_eod, dtype

    def __call__(self, chunk: _Chunk) -> list[np.ndarray]:
        first, lines = chunk
        docs = []
        for lineno, line in enumerate(lines, start=first):
            text = _parse_line(line, lineno, self.path, self.key)
            if text is None:
                continue
            ids = self.tokenizer.encode(text)
            # As Megatron-LM's preprocess_data.py: an empty document gets no end-of-document token either.
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod_id)
            # Narrow dtype here, in the worker: halves what is pickled back, and an id that does not fit
            # fails loudly (numpy raises OverflowError) instead of wrapping around.
            docs.append(np.array(ids, dtype=self.dtype))
        return docs


_WORKER_ENCODER: Optional[_Encoder] = None


def _init_worker(*args) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = _Encoder(*args)


def _encode_in_worker(chunk: _Chunk) -> list[np.ndarray]:
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER(chunk)


def _encoded_chunks(
    chunks: Iterator[_Chunk], encoder_args: tuple, workers: int, max_in_flight: int
) -> Iterator[list[np.ndarray]]:
    """Encoded chunks in input order.

    A bounded window of ``apply_async`` tasks rather than ``Pool.imap``: ``imap`` reads the whole input
    ahead into its task queue, which for a corpus larger than memory is a crash, not a speed-up.
    """
    if workers <= 1:
        encoder = _Encoder(*encoder_args)
        yield from map(encoder, chunks)
        return
    # fork where available: workers start at once, without re-importing torch/Lightning as spawn would.
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=encoder_args) as pool:  # exit: terminate()
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= max_in_flight:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _remove(*paths: Optional[str]) -> None:
    for path in paths:
        if path is not None:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def preprocess_jsonl(
    input: str,
    output_prefix: str,
    tokenizer: str,
    *,
    json_key: str = "text",
    append_eod: bool = False,
    workers: int = 1,
    chunk_size: int = 64,
    quiet: bool = False,
) -> PreprocessResult:
    """Tokenize ``input`` (jsonl, optionally gzip) into ``output_prefix.bin`` / ``output_prefix.idx``.

    ``tokenizer`` is a path for :func:`~lightning_megatron.data.tokenizers.load_tokenizer`, or ``train:N``
    to first train an ``N``-token byte-level BPE on the input and save it as ``<output_prefix>-tokenizer.json``.
    Raises :class:`PreprocessError` on a malformed line or an input without text, leaving no output files behind.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if workers < 1:
        raise ValueError(f"workers={workers}: need at least 1")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: need at least 1")
    if not os.path.isfile(input):
        raise FileNotFoundError(f"input file {input} does not exist")
    _check_has_text(input, json_key)
    start = time.perf_counter()
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)

    trained_path: Optional[str] = None
    tmp_prefix = f"{output_prefix}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp_bin, tmp_idx = tmp_prefix + ".bin", tmp_prefix + ".idx"
    bin_path, idx_path = output_prefix + ".bin", output_prefix + ".idx"
    try:
        if tokenizer.startswith(_TRAIN_PREFIX):
            try:
                vocab_size = int(tokenizer[len(_TRAIN_PREFIX) :])
            except ValueError:
                raise ValueError(f"--tokenizer {tokenizer!r}: expected train:<vocab_size>, e.g. train:8192") from None
            tokenizer = f"{output_prefix}-tokenizer.json"
            # The training pass reads every line, so a malformed one fails here, before anything is written.
            train_bpe_tokenizer(_iter_texts(input, json_key), vocab_size, tokenizer)
            trained_path = tokenizer
        tok = load_tokenizer(tokenizer)
        dtype = DType.optimal_dtype(tok.vocab_size)

        from tqdm.auto import tqdm

        progress = tqdm(
            desc="tokenizing", unit=" docs", disable=quiet or not sys.stderr.isatty(), file=sys.stderr, delay=0.5
        )
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        documents = tokens = 0
        encoder_args = (tokenizer, input, json_key, append_eod, dtype)
        encoded = _encoded_chunks(_read_chunks(input, chunk_size), encoder_args, workers, 4 * workers)
        try:
            for docs in encoded:
                for ids in docs:
                    builder.add_document(ids, [ids.size] if ids.size else [])
                    tokens += ids.size
                documents += len(docs)
                progress.update(len(docs))
        finally:
            encoded.close()  # stops the worker pool now, not whenever the generator is collected
            progress.close()
            builder.data_file.close()  # on error too, so the temporary file can be removed (Windows)
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    except BaseException:
        _remove(tmp_bin, tmp_idx, trained_path)
        raise
    return PreprocessResult(documents, tokens, time.perf_counter() - start, bin_path, idx_path, trained_path)


def run(args: argparse.Namespace) -> None:
    """Run ``lightning-megatron preprocess`` with the parsed arguments; prints a one-line summary."""
    result = preprocess_jsonl(
        args.input,
        args.output_prefix,
        args.tokenizer,
        json_key=args.json_key,
        append_eod=args.append_eod,
        workers=args.workers,
        chunk_size=args.chunk_size,
        quiet=args.quiet,
    )
    rate = result.tokens / result.seconds if result.seconds > 0 else 0.0
    extra = f", tokenizer saved to {result.tokenizer_path}" if result.tokenizer_path else ""
    print(
        f"{args.output_prefix}: {result.documents} documents, {result.tokens} tokens in {result.seconds:.1f} s "
        f"({rate:,.0f} tokens/s){extra}"
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``lightning-megatron preprocess`` (its arguments: :mod:`lightning_megatron.cli_commands`)."""
    from lightning_megatron.cli_commands import parse

    run(parse("preprocess", argv))


if __name__ == "__main__":
    main()
