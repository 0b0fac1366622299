"""The message header every transport carries before a tensor's bytes: tag, dtype, shape and size.

One encoding for all transports (``torch`` sends it as an int64 tensor, the native ones as bytes), so the dtype
codes live here and nowhere else. A header is ``HEADER_WORDS`` little-endian int64 words::

    word 0      MAGIC (format and version; a receiver rejects anything else)
    word 1      kind: KIND_DATA (a tensor follows, ``nbytes`` long), KIND_CLOSE (the sender closed its end),
                KIND_HELLO (a connection check; no tensor, no tag) or KIND_CUDA (a CUDA-IPC descriptor follows;
                the tensor's bytes move GPU to GPU)
    word 2      tag
    word 3      dtype code (``DTYPE_CODES``)
    word 4      nbytes of the payload (0 for 0-element tensors: no payload follows)
    word 5      ndim
    word 6..    shape (``MAX_NDIM`` slots, unused ones 0)

Payloads are the tensor's raw bytes (``as_bytes``): every dtype travels as uint8, so a backend that cannot send
a dtype (gloo and NCCL know no float8, bits or uint16..64 types) never sees it, and values round-trip
bit-exactly (NaN payloads, bool bytes, negative zeros).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_megatron.errors import TransportUsageError

__all__ = [
    "CODE_DTYPES",
    "DTYPE_CODES",
    "HEADER_BYTES",
    "HEADER_WORDS",
    "KIND_CLOSE",
    "KIND_CUDA",
    "KIND_DATA",
    "KIND_HELLO",
    "MAGIC",
    "MAX_NDIM",
    "Header",
    "as_bytes",
    "decode",
    "dtype_code",
    "encode",
    "from_bytes",
    "kind_of",
    "pack",
    "unpack",
]

HEADER_WORDS = 32
HEADER_BYTES = HEADER_WORDS * 8
MAX_NDIM = HEADER_WORDS - 6
MAGIC = 0x4C4D_5450_0000_0001  # "LMTP", format 1
KIND_DATA = 0
KIND_CLOSE = 1
KIND_HELLO = 2
KIND_CUDA = 3  # a CUDA-IPC descriptor follows the header (``transport.cuda_ipc``); the bytes move GPU to GPU
_STRUCT = struct.Struct(f"<{HEADER_WORDS}q")

# Stable codes: never renumber (a mismatch between two ranks' versions must be detectable, not silent).
_NAMED_CODES = {
    "bool": 1,
    "uint8": 2,
    "int8": 3,
    "int16": 4,
    "int32": 5,
    "int64": 6,
    "uint16": 7,
    "uint32": 8,
    "uint64": 9,
    "float16": 10,
    "bfloat16": 11,
    "float32": 12,
    "float64": 13,
    "complex32": 14,
    "complex64": 15,
    "complex128": 16,
    "float8_e4m3fn": 17,
    "float8_e4m3fnuz": 18,
    "float8_e5m2": 19,
    "float8_e5m2fnuz": 20,
    "float8_e8m0fnu": 21,
    "float4_e2m1fn_x2": 22,
    "bits8": 23,
    "bits16": 24,
    "bits1x8": 25,
    "bits2x4": 26,
    "bits4x2": 27,
    **{f"int{n}": 30 + n for n in range(1, 8)},  # sub-byte shell dtypes: one byte per element in storage
    **{f"uint{n}": 40 + n for n in range(1, 8)},
}
DTYPE_CODES: dict[torch.dtype, int] = {
    getattr(torch, name): code
    for name, code in _NAMED_CODES.items()
    if isinstance(getattr(torch, name, None), torch.dtype)
}
"""Every dtype a transport can carry (those this torch build has), with its wire code."""
CODE_DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    code = DTYPE_CODES.get(dtype)
    if code is None:
        quantized = str(dtype).startswith(("torch.qint", "torch.quint"))
        hint = " (quantized: send `t.int_repr()` and the scale/zero point)" if quantized else ""
        raise TransportUsageError(f"transports cannot send dtype {dtype}{hint}; supported: {_names()}.")
    return code


def _names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)


@dataclass(frozen=True)
class Header:
    tag: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    kind: int = KIND_DATA


def encode(tag: int, tensor: Optional[torch.Tensor], kind: int = KIND_DATA) -> list[int]:
    """The header words of ``tensor`` sent with ``tag``; for the control kinds (close, hello) pass ``tensor=None``."""
    if kind != KIND_DATA:
        return [MAGIC, kind, tag, 0, 0, 0] + [0] * MAX_NDIM
    assert tensor is not None
    if tensor.dim() > MAX_NDIM:
        raise TransportUsageError(
            f"transports send tensors of at most {MAX_NDIM} dimensions, not {tensor.dim()} (tag {tag}): "
            "reshape before sending."
        )
    shape = list(tensor.shape)
    nbytes = tensor.numel() * tensor.element_size()
    return [MAGIC, kind, tag, dtype_code(tensor.dtype), nbytes, len(shape)] + shape + [0] * (MAX_NDIM - len(shape))


def decode(words: list[int]) -> Header:
    """Inverse of :func:`encode`; ``ValueError`` for anything that is not a header of this format."""
    if len(words) != HEADER_WORDS or words[0] != MAGIC:
        raise ValueError(f"not a transport header (magic {words[0] if words else None:#x}, {len(words)} words)")
    kind, tag, code, nbytes, ndim = words[1:6]
    if kind in (KIND_CLOSE, KIND_HELLO):
        return Header(tag, torch.uint8, (0,), 0, kind)
    if kind not in (KIND_DATA, KIND_CUDA) or code not in CODE_DTYPES or not 0 <= ndim <= MAX_NDIM or nbytes < 0:
        raise ValueError(f"corrupt transport header: kind {kind}, dtype code {code}, ndim {ndim}, nbytes {nbytes}")
    dtype, shape = CODE_DTYPES[code], tuple(words[6 : 6 + ndim])
    numel = 1
    for n in shape:
        numel *= n
    if numel * dtype.itemsize != nbytes:
        raise ValueError(f"corrupt transport header: shape {shape} of {dtype} is not {nbytes} bytes")
    return Header(tag, dtype, shape, nbytes, kind)


def pack(words: list[int]) -> bytes:
    """Header words as the ``HEADER_BYTES`` bytes the native transports carry."""
    return _STRUCT.pack(*words)


def kind_of(data: bytes) -> int:
    """The kind word of a packed header (``data`` may continue past the header)."""
    return struct.unpack_from("<q", data, 8)[0]


def unpack(data: bytes) -> Header:
    if len(data) != HEADER_BYTES:
        raise ValueError(f"a transport header is {HEADER_BYTES} bytes, not {len(data)}")
    return decode(list(_STRUCT.unpack(data)))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a 1-d uint8 view (no copy); 0-d tensors included."""
    return tensor.reshape(-1).view(torch.uint8)


def from_bytes(data: torch.Tensor, header: Header) -> torch.Tensor:
    """View ``data`` (1-d uint8, ``header.nbytes`` long) as the tensor the header describes (no copy)."""
    if header.nbytes == 0:
        return torch.empty(header.shape, dtype=header.dtype, device=data.device)
    return data.view(header.dtype).view(header.shape)
