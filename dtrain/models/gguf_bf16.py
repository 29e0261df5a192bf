"""BF16 tensors of a GGUF file, read exactly; its tensors' names, shapes and types.

``mx.load`` returns GGUF BF16 tensors as float16 (MLX 0.32: values below 6e-5
lose precision, values above 65504 become inf), and ``gguf.GGUFReader`` parses
every metadata array in Python (slow for a large vocabulary). This module
walks the header with ``struct`` (skipping metadata values without decoding
them) to find the BF16 tensors and reads just those, as float32 (a BF16 value is
the upper half of a float32, so the widening is exact).

Layout (GGUF v2/v3, ggml/docs/gguf.md): magic, version u32, tensor count u64,
kv count u64; kv: key string, type u32, value; tensor info: name string,
n_dims u32, dims u64 x n_dims (fastest first), type u32, offset u64; tensor data
starts at the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

BF16 = 30  # GGMLQuantizationType.BF16
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class BadAlignment(ValueError):
    """``general.alignment`` is not a power of 2: the tensors' offsets cannot be read as llama.cpp reads them."""


def _u(f, fmt: str):
    return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]


def _text(f, size: int) -> bytes:
    """A GGUF string's bytes; a length past the file's end (a damaged header) is refused before
    ``f.read`` tries to allocate it (MemoryError)."""
    n = _u(f, "Q")
    if n > size - f.tell():
        raise ValueError(f"a string of {n} bytes at offset {f.tell() - 8}, past the end of the file")
    return f.read(n)


def _skip_value(f, vtype: int) -> None:
    if vtype in _FIXED:
        f.seek(_FIXED[vtype], 1)
    elif vtype == _STRING:
        f.seek(_u(f, "Q"), 1)
    elif vtype == _ARRAY:
        item, count = _u(f, "I"), _u(f, "Q")
        if item in _FIXED:
            f.seek(_FIXED[item] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_bf16_tensors(path: Path, header: tuple | None = None) -> dict:
    """``{name: float32 array}`` for every BF16 tensor of a GGUF file (shape as numpy: slowest first);
    ``header``: :func:`tensor_infos` of ``path`` when the caller has it (else it is read here).

    Raises:
        ValueError: not a GGUF v2/v3 file.
    """
    infos, start = header or tensor_infos(path)
    out = {}
    for name, shape, ttype, offset in infos:
        if ttype == BF16:
            bits = np.fromfile(path, dtype="<u2", count=int(np.prod(shape)), offset=start + offset)
            out[name] = (bits.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return out


def tensor_infos(path: Path) -> tuple:
    """``([(name, shape, type, offset)], data_start)`` from a GGUF file's header (shape as numpy: slowest
    first; type: the ``GGMLQuantizationType`` number).

    Raises:
        BadAlignment: ``general.alignment`` 0 or not a power of 2.
        ValueError: not a GGUF v2/v3 file, or a damaged header.
    """
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF" or _u(f, "I") not in (2, 3):
            raise ValueError(f"{path}: not a GGUF v2/v3 file")
        n_tensors, n_kv = _u(f, "Q"), _u(f, "Q")
        alignment = 32
        for _ in range(n_kv):
            key = _text(f, size).decode("utf-8", "replace")
            vtype = _u(f, "I")
            if key == "general.alignment" and vtype == _UINT32:
                alignment = _u(f, "I")
                if alignment <= 0 or alignment & (alignment - 1):  # else a ZeroDivisionError, or shifted tensors
                    raise BadAlignment(f"GGUF key 'general.alignment' = {alignment} is not supported (llama.cpp "
                                       "requires a power of 2)")
            else:
                _skip_value(f, vtype)
        infos = []
        for _ in range(n_tensors):
            name = _text(f, size).decode("utf-8")
            dims = [_u(f, "Q") for _ in range(_u(f, "I"))]
            ttype, offset = _u(f, "I"), _u(f, "Q")
            infos.append((name, tuple(reversed(dims)), ttype, offset))
        start = -(-f.tell() // alignment) * alignment
    return infos, start
