"""A protection set's payloads cut into stripes (pure): each member's payload is split into G−k pieces; stripe s
combines one piece of every data member of s into k parity blocks held by `ProtectionSet.parity_positions(s)`."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hpcft.agent.protection.codec import Codec, Unrecoverable
from hpcft.agent.protection.placement import Placement, ProtectionSet


def piece_bytes(size: int, pset: ProtectionSet) -> int:
    """Length of one piece (and one parity block) when the largest payload of the set has `size` bytes."""
    return -(-size // pset.data_pieces)


def piece(payload: np.ndarray, index: int, nbytes: int) -> np.ndarray:
    """Piece `index` of `payload` as a view, short (even empty) where the payload ends: the codecs read the missing
    tail as zeros, so nothing is copied to pad it."""
    return payload[index * nbytes:(index + 1) * nbytes]


def parity_block(parity: np.ndarray, pset: ProtectionSet, position: int, stripe: int, nbytes: int) -> np.ndarray:
    """The view of member `position`'s parity buffer that holds its block of stripe `stripe`."""
    i = pset.stripes_holding(position).index(stripe)
    return parity[i * nbytes:(i + 1) * nbytes]


def parity_bytes(pset: ProtectionSet, position: int, nbytes: int) -> int:
    """Size of member `position`'s parity buffer (k blocks of one piece each)."""
    return len(pset.stripes_holding(position)) * nbytes


def encode_set(pset: ProtectionSet, payloads: Sequence[np.ndarray], codec: Codec,
               out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Every member's parity buffer for `payloads` (uint8 arrays, any lengths), into `out` when given (buffers of
    `parity_bytes` each, pre-faulted: no page faults, no allocation)."""
    nbytes = piece_bytes(max(p.size for p in payloads), pset)
    sizes = [parity_bytes(pset, pos, nbytes) for pos in range(pset.size)]
    parities = [np.empty(n, dtype=np.uint8) for n in sizes] if out is None else [o[:n] for o, n in zip(out, sizes)]
    for stripe in range(pset.size):
        data = [piece(payloads[pos], pset.piece_of(pos, stripe), nbytes) for pos in pset.data_positions(stripe)]
        outs = [parity_block(parities[pos], pset, pos, stripe, nbytes) for pos in pset.parity_positions(stripe)]
        codec.encode(data, outs)
    return parities


ENCODE_SLICE = 4 << 20  # parity columns encoded between two `pace` calls (~10 ms of zfec RS on this CPU)


def encode_paced(codec: Codec, data: Sequence[np.ndarray], t: int, out: np.ndarray, pace: Callable[[], None],
                 slice_bytes: int = ENCODE_SLICE) -> None:
    """Parity block `t` of `data` (short blocks zero-padded) into `out`, in column slices with `pace()` before each:
    one encode over a whole stripe of a large snapshot is a burst of a second or more."""
    for lo in range(0, out.size, slice_bytes):
        pace()
        hi = min(out.size, lo + slice_bytes)
        codec.encode_some([d[lo:hi] for d in data], {t: out[lo:hi]})


def rebuild_set(pset: ProtectionSet, payloads: Sequence[np.ndarray | None], parities: Sequence[np.ndarray | None],
                sizes: Sequence[int], codec: Codec) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every missing (None) payload and parity buffer of a set, rebuilt from what survives; `sizes`: the payload
    lengths recorded at encode time. Unrecoverable if a stripe lost more than k."""
    nbytes = piece_bytes(max(sizes), pset)
    check_recoverable(pset, payloads, parities)
    full = [np.zeros(pset.data_pieces * nbytes, dtype=np.uint8) if p is None else p for p in payloads]
    par = [np.empty(parity_bytes(pset, pos, nbytes), dtype=np.uint8) if p is None else p
           for pos, p in enumerate(parities)]
    for stripe in range(pset.size):
        have, want = {}, {}
        for b, pos in enumerate(pset.data_positions(stripe)):
            i = pset.piece_of(pos, stripe)
            if payloads[pos] is None:
                want[b] = full[pos][i * nbytes:(i + 1) * nbytes]
            else:
                have[b] = piece(full[pos], i, nbytes)
        for t, pos in enumerate(pset.parity_positions(stripe)):
            block = parity_block(par[pos], pset, pos, stripe, nbytes)
            (want if parities[pos] is None else have)[pset.data_pieces + t] = block
        if want:
            codec.decode(have, want)
    return [f[:sizes[pos]] if payloads[pos] is None else f for pos, f in enumerate(full)], par


def check_recoverable(pset: ProtectionSet, payloads: Sequence[object | None],
                      parities: Sequence[object | None]) -> None:
    """Unrecoverable if some stripe of the set lost more blocks (None payloads or parity buffers) than k."""
    for stripe in range(pset.size):
        if (sum(payloads[p] is None for p in pset.data_positions(stripe))
                + sum(parities[p] is None for p in pset.parity_positions(stripe))) > pset.losses:
            lost = sorted({pos for pos in range(pset.size) if payloads[pos] is None or parities[pos] is None})
            raise Unrecoverable(f"protection set {pset.index} (slots {list(pset.members)}) lost members at "
                                f"positions {lost}; it tolerates {pset.losses} loss(es)")


def partner_copies(placement: Placement, payloads: Sequence[np.ndarray],
                   out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """What each slot holds: a copy of slot `partnered_by(slot)`'s payload (into `out[slot]` when given)."""
    if out is None:
        return [payloads[placement.partnered_by(slot)].copy() for slot in range(placement.slots)]
    copies = []
    for slot in range(placement.slots):
        src = payloads[placement.partnered_by(slot)]
        np.copyto(out[slot][:src.size], src)
        copies.append(out[slot][:src.size])
    return copies


def rebuild_partner(placement: Placement, payloads: Sequence[np.ndarray | None],
                    copies: Sequence[np.ndarray | None]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Rebuild lost payloads from their partner's copy and lost copies from their source payload."""
    out = list(payloads)
    for slot, p in enumerate(payloads):
        if p is None:
            holder = placement.partner_of(slot)
            if copies[holder] is None:
                raise Unrecoverable(f"slot {slot} and its partner slot {holder} are both lost")
            out[slot] = copies[holder].copy()
    held = [c if c is not None else out[placement.partnered_by(slot)].copy() for slot, c in enumerate(copies)]
    return out, held
