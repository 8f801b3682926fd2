"""crc32c of a snapshot's chunks computed on the GPU before they are copied out, so a device→host copy is not held to
the host's checksum rate (H200: 55 GB/s copy, 25-31 GB/s crc32c on 4-8 host cores). The values are the crc32c the
host computes: every check of the store verifies the bytes that landed against what the device held.

The Triton kernel takes pieces of at most 64 KiB of device memory; each of a program's LANES lanes runs a crc over
every LANES-th word (coalesced loads), the lanes' sums are moved to their places and xor-ed (hpcft.store.crcmath),
and the piece's crc moved to its place in its chunk. The host xors a chunk's pieces, adds the bytes it holds itself
(step counters of GPU parameters) and the initial value's part. Padding between pieces must be zeros (`zero_gaps`)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from hpcft.snapshot.plan import Chunk
from hpcft.store import chunk_crc
from hpcft.store import crcmath as cm

_log = logging.getLogger(__name__)
LANES = 128  # H200, 2.35 GB in 4 MiB chunks: 128 × 128 at 905 GB/s, 256 × 64 846, 512 × 32 780, 256 × 16 645
WORDS = 128  # words per lane per piece: a piece is 64 KiB
SHIFT_BITS = 40  # a piece's distance to its chunk's end is below 2^40 bytes


def for_device(device: torch.device) -> "DeviceCrc | None":
    """The device checksum for a copier of `device`'s state, or None (logged) where the kernel cannot run."""
    ok, why = available(device)
    if not ok:
        _log.info("snapshot checksums on the host: %s", why)
        return None
    return DeviceCrc(device)


def available(device: torch.device) -> tuple[bool, str]:
    """(True, "") where the kernel can run on `device`; else False and why (the host checksums then)."""
    if os.environ.get("HPCFT_DEVICE_CRC", "1") == "0":
        return False, "HPCFT_DEVICE_CRC=0"
    if torch.device(device).type != "cuda":
        return False, f"the state is on {device}, not a GPU"
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return False, f"triton is not importable ({exc})"
    return True, ""


def _i32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.uint32).view(np.int32)


@lru_cache(maxsize=8)
def _host_tables(lanes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's tables: a lane's step (4·lanes bytes), each lane's distance to its piece's end, and A^(2^b)."""
    per_lane = np.stack([cm.tables(cm.zeros(4 * (lanes - lane))) for lane in range(lanes)])
    return _i32(cm.tables(cm.zeros(4 * lanes))), _i32(per_lane), _i32(cm.log_tables(SHIFT_BITS))


@dataclass
class Plan:
    """One layout's pieces, reused for every snapshot of it: device-side piece table, host-side assembly."""
    base: torch.Tensor              # every piece's address is relative to this tensor's
    starts: torch.Tensor            # int64 [pieces]
    lens: torch.Tensor              # int32 [pieces]
    afters: torch.Tensor            # int64 [pieces]
    chunk: np.ndarray               # int64 [pieces]: each piece's chunk
    constant: np.ndarray            # uint32 [chunks]: the initial value's part and the final xor
    host: tuple[np.ndarray, ...]    # host-held segments: slot offset, nbytes, chunk, bytes after it in its chunk
    out: torch.Tensor               # pinned int32 [pieces]: the device's answer lands here

    @property
    def pieces(self) -> int:
        return int(self.lens.numel())


class DeviceCrc:
    """Chunk crc32c of device-resident sources, computed by the GPU (`launch`) and assembled on the host (`finish`)."""

    def __init__(self, device: torch.device, lanes: int = LANES, words: int = WORDS):
        self.device = torch.device(device)
        self.lanes, self.words, self.piece = lanes, words, 4 * lanes * words  # lanes: a power of two
        self._tables = [torch.from_numpy(t.reshape(-1).copy()).to(self.device) for t in _host_tables(lanes)]

    def plan(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk], on_host: set[int]) -> Plan:
        """Cut every device segment of `chunks` into pieces of at most `piece` bytes; note the host-held segments."""
        device_sources = [i for i, t in enumerate(sources) if i not in on_host]
        base = sources[device_sources[0]] if device_sources else torch.zeros(1, dtype=torch.uint8, device=self.device)
        base_ptr = base.data_ptr()
        addr = {i: sources[i].data_ptr() - base_ptr for i in device_sources}
        starts, lens, afters, chunk, host = [], [], [], [], []
        for ci, c in enumerate(chunks):
            end = c.offset + c.nbytes
            for s in c.segments:
                if s.source in on_host:
                    host.append((s.offset, s.nbytes, ci, end - s.offset - s.nbytes))
                    continue
                for lo in range(0, s.nbytes, self.piece):
                    n = min(self.piece, s.nbytes - lo)
                    starts.append(addr[s.source] + s.start + lo)
                    lens.append(n)
                    afters.append(end - (s.offset + lo + n))
                    chunk.append(ci)
        sizes = np.array([c.nbytes for c in chunks], dtype=np.uint64)
        constant = cm.finish(np.zeros(len(chunks), dtype=np.uint32), sizes)
        dev = dict(device=self.device)
        return Plan(base, torch.tensor(starts, dtype=torch.int64, **dev), torch.tensor(lens, dtype=torch.int32, **dev),
                    torch.tensor(afters, dtype=torch.int64, **dev), np.array(chunk, dtype=np.int64), constant,
                    tuple(np.array(col, dtype=np.int64) for col in zip(*host)) if host else (),
                    torch.empty(len(starts), dtype=torch.int32, pin_memory=self.device.type == "cuda"))

    def launch(self, plan: Plan) -> None:
        """Queue the kernel and the copy of its answer into `plan.out` on the current stream (the copy stream)."""
        from hpcft.snapshot._crc_kernel import crc_pieces

        if not plan.pieces:
            return
        out = torch.empty(plan.pieces, dtype=torch.int32, device=self.device)
        step_tab, lane_tab, log_tab = self._tables
        crc_pieces[(plan.pieces,)](plan.base, plan.starts, plan.lens, plan.afters, out, step_tab, lane_tab, log_tab,
                                  LANES=self.lanes, WORDS=self.words, BITS=SHIFT_BITS)
        plan.out.copy_(out, non_blocking=True)


def finish(plan: Plan, slot: np.ndarray) -> list[int]:
    """The chunks' crc32c once `DeviceCrc.launch`'s work completed: the pieces, the host-held bytes (from the slot)
    and the initial value's part."""
    crc = np.zeros(len(plan.constant), dtype=np.uint32)
    np.bitwise_xor.at(crc, plan.chunk, plan.out.numpy().view(np.uint32))
    if plan.host:
        offset, nbytes, chunk, after = plan.host
        width = int(nbytes.max())
        idx = offset[:, None] + np.arange(width) - (width - nbytes)[:, None]  # leading zeros: padded in front
        data = np.where(idx >= offset[:, None], slot[np.maximum(idx, 0)], 0).astype(np.uint8)
        np.bitwise_xor.at(crc, chunk, cm.shift(cm.raw(data), after.astype(np.uint64)))
    return (crc ^ plan.constant).astype(np.uint32).tolist()


def zero_gaps(slot: np.ndarray, chunks: Sequence[Chunk]) -> None:
    """Zero the bytes of `chunks` no segment covers (alignment padding, as `chunk_crc` walks it), which the device's
    crc takes for zeros; a slot that held another layout may hold anything there."""
    def zero(lo: int, hi: int, crc: int) -> int:
        slot[lo:hi] = 0
        return crc

    for c in chunks:
        chunk_crc(c, zero, lambda s, crc: crc)
