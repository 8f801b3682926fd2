"""The bytes `torch.save` writes around a tensor's data, so the durable tier writes its chunks straight from the store
as records `torch.load` (and `dcp.load`) reads, without importing torch in the node agents (an import per agent from
a shared file system, while a requeue waits for the flush).

A record is torch's zip layout (format 3, 64-byte aligned records, data descriptors, zip64 end records) around a
protocol-2 pickle of `torch._utils._rebuild_tensor_v2`, as `torch.save` writes it under `skip_data()`: the data
record's crc is 0 (torch.load does not check it); tests/unit/test_durable_writer.py compares the bytes with torch's.
Unknown dtypes and records beyond 4 GiB are made by torch itself."""
from __future__ import annotations

import functools
import io
import math
import struct
import zlib

from hpcft.durable.items import ELEMENT

ALIGN = 64
STORAGE = {"float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage",
           "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
           "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage", "complex64": "ComplexFloatStorage",
           "complex128": "ComplexDoubleStorage"}
_SERIAL_ID = b"0" * 40  # torch writes a random decimal id; nothing reads it back for a tensor


def _int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -2 ** 31 <= n < 2 ** 31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _tuple(items: tuple[int, ...], memo: list[int]) -> bytes:
    if not items:
        return b")"  # the empty tuple is not memoized
    body = b"".join(_int(x) for x in items)
    body = body + {1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(items)] if len(items) <= 3 else b"(" + body + b"t"
    return body + _put(memo)


def _put(memo: list[int]) -> bytes:
    memo[0] += 1
    return b"q" + bytes([memo[0] - 1])


def _text(s: str, memo: list[int]) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw + _put(memo)


def pickle_of(dtype: str, shape: tuple[int, ...]) -> bytes:
    """data.pkl of a contiguous tensor of `shape` on the CPU, as torch.save pickles it."""
    memo = [0]
    stride = tuple(math.prod(max(1, n) for n in shape[i + 1:]) for i in range(len(shape)))  # as torch: 0 counts as 1
    out = b"\x80\x02" + b"ctorch._utils\n_rebuild_tensor_v2\n" + _put(memo) + b"(("
    out += _text("storage", memo) + f"ctorch\n{STORAGE[dtype]}\n".encode() + _put(memo)
    out += _text("0", memo) + _text("cpu", memo) + _int(math.prod(shape)) + b"t" + _put(memo) + b"Q"
    out += _int(0) + _tuple(shape, memo) + _tuple(stride, memo) + b"\x89"
    out += b"ccollections\nOrderedDict\n" + _put(memo) + b")R" + _put(memo) + b"t" + _put(memo) + b"R" + _put(memo)
    return out + b"."


def _zip(records: list[tuple[str, bytes | int]]) -> tuple[bytes, bytes]:
    """torch's zip around `records` (name and bytes; or name and the size of the one record whose bytes are left
    out): (the bytes before the left-out record's, the bytes after). Records are aligned at their absolute
    offsets, the left-out bytes counted; an empty record has no data descriptor, as torch writes it."""
    head, tail, central = bytearray(), bytearray(), bytearray()
    pos, hole = 0, None
    for name, data in records:
        key = f"archive/{name}".encode()
        size = data if isinstance(data, int) else len(data)
        crc = 0 if isinstance(data, int) else zlib.crc32(data)
        flag = 0x808 if size else 0x800
        pad = (ALIGN - (pos + 30 + len(key) + 4) % ALIGN) % ALIGN
        local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, flag, 0, 0, 0, 0, 0, 0, len(key), 4 + pad) + key
        local += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, flag, 0, 0, 0, crc, size, size, len(key),
                               0, 0, 0, 0, 0, pos) + key
        out = head if hole is None else tail
        out += local
        if isinstance(data, int):
            hole = True
        else:
            (head if hole is None else tail).extend(data)
        if size:
            (head if hole is None else tail).extend(struct.pack("<4sIII", b"PK\x07\x08", crc, size, size))
        pos += len(local) + size + (16 if size else 0)
    count = len(records)
    end64 = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 0x2D, 0, 0, count, count, len(central), pos)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, pos + len(central), 1)
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count, count, len(central), pos, 0)
    return bytes(head), bytes(tail + central + end64 + locator + end)


@functools.lru_cache(maxsize=4096)
def envelope(dtype: str, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """(prefix, suffix): prefix + the tensor's C-ordered bytes + suffix is a torch.save of it."""
    nbytes = math.prod(shape) * ELEMENT.get(dtype, 0)
    if dtype not in STORAGE or nbytes >= 2 ** 32 - 2 ** 20:
        return _torch_envelope(dtype, shape)
    return _zip([("data.pkl", pickle_of(dtype, shape)), (".format_version", b"1"), (".storage_alignment", b"64"),
                 ("byteorder", b"little"), ("data/0", nbytes), ("version", b"3\n"),
                 (".data/serialization_id", _SERIAL_ID)])


def _torch_envelope(dtype: str, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The envelope as torch itself writes it (under skip_data), for what `envelope` does not build."""
    import zipfile

    import torch

    t = torch.empty(shape, dtype=getattr(torch, dtype))
    buf = io.BytesIO()
    with torch.serialization.skip_data():
        torch.save(t, buf)
    raw = buf.getvalue()
    info = next(i for i in zipfile.ZipFile(io.BytesIO(raw)).infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    nbytes = t.numel() * t.element_size()
    if info.file_size != nbytes:
        raise RuntimeError(f"torch.save reserved {info.file_size} bytes for a {dtype} {list(shape)} tensor, "
                           f"not {nbytes}")
    return raw[:start], raw[start + nbytes:]
