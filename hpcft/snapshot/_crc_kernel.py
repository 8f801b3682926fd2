"""The Triton kernel behind hpcft.snapshot.devcrc (imported only where triton is): raw crc32c of pieces of device
memory, each moved to its place in its chunk. Tables as devcrc builds them (int32, 4 × 256 per operator)."""
import triton
import triton.language as tl


@triton.jit
def _apply(tab, v):
    """op(v) through op's four byte tables at `tab`."""
    return (tl.load(tab + (v & 0xFF)) ^ tl.load(tab + 256 + ((v >> 8) & 0xFF))
            ^ tl.load(tab + 512 + ((v >> 16) & 0xFF)) ^ tl.load(tab + 768 + ((v >> 24) & 0xFF)))


@triton.jit
def crc_pieces(base, starts, lens, afters, out, step_tab, lane_tab, log_tab,
               LANES: tl.constexpr, WORDS: tl.constexpr, BITS: tl.constexpr):
    """Program i: the raw crc of piece i (`lens[i]` ≤ 4·LANES·WORDS bytes at `base + starts[i]`) moved by
    `afters[i]` zero bytes, into `out[i]`. Lane l runs a crc over words l, l + LANES, ... of the piece."""
    pid = tl.program_id(0)
    start = tl.load(starts + pid)
    n = tl.load(lens + pid)
    after = tl.load(afters + pid)
    pad = LANES * WORDS * 4 - n  # the piece sits at the end of LANES·WORDS words of zeros: a raw crc ignores them
    lane = tl.arange(0, LANES)
    byte = tl.arange(0, 4)
    acc = tl.zeros([LANES], dtype=tl.int32)
    for k in range(WORDS):
        pos = (k * LANES + lane)[:, None] * 4 + byte[None, :]
        b = tl.load(base + start + (pos - pad), mask=pos >= pad, other=0).to(tl.int32)
        acc = _apply(step_tab, acc) ^ tl.sum(b << (byte[None, :] * 8), axis=1)  # A^(4·LANES)(acc) ⊕ word
    # lane l's sum lacks its words' own A^4 and the 4·(LANES - 1 - l) bytes after its last word: A^(4·(LANES - l))
    acc = _apply(lane_tab + lane * 1024, acc)
    crc = tl.xor_sum(acc, axis=0)
    for bit in tl.static_range(BITS):  # A^after(crc): the piece moved to its place in its chunk
        crc = tl.where(((after >> bit) & 1) != 0, _apply(log_tab + bit * 1024, crc), crc)
    tl.store(out + pid, crc)
