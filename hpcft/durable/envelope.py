"""The bytes `torch.save` writes around a tensor's data, so that the durable tier writes its chunks straight from
the store as records `torch.load` (and so `dcp.load`) reads, without a copy. Made once per (dtype, shape) with
torch's `skip_data` (which reserves the data's place); torch.save's own `compute_crc32=False` leaves the zip crc
0 the same way, and torch.load does not check it."""
from __future__ import annotations

import functools
import io
import struct
import zipfile


@functools.lru_cache(maxsize=4096)
def envelope(dtype: str, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """(prefix, suffix): prefix + the tensor's C-ordered bytes + suffix is a torch.save of it."""
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
