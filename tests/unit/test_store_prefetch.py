"""A relaunched rank's newest slot mapped ahead (hpcft.store.prefetch) on real /dev/shm-style files: adopted by the
store's Slot only while it is the same file, dropped otherwise, started by hpcft.init and by a Checkpointer; its pieces
shared by every thread that populates (checked in the page table itself, /proc/self/pagemap)."""
import mmap
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcft.checkpointer import Checkpointer
from hpcft.options import Options
from hpcft.runtime import init
from hpcft.store import RankStore, ntcopy, prefetch


@pytest.fixture(autouse=True)
def _nothing_left_pending():
    yield
    prefetch.release()


def _commit(store: RankStore, step: int, nbytes: int = 3 << 20) -> int:
    slot = store.begin(nbytes)
    slot.array[:nbytes] = step % 251
    store.commit(slot, {"step": step})
    return slot.index


def _pending(path: Path) -> prefetch._Ahead:
    return prefetch._pending[str(path)]


def test_the_newest_slot_is_mapped_ahead_and_adopted_by_the_restoring_store(tmp_path: Path) -> None:
    writer = RankStore("9", 2, root=tmp_path)
    _commit(writer, 1)
    newest = _commit(writer, 2)
    writer.close()
    thread = prefetch.ahead("9", 2, tmp_path)
    assert thread is not None
    thread.join()
    path = tmp_path / writer.job.name / "rank-00002" / f"slot-{newest}.data"
    entry = _pending(path)
    assert entry.mm is not None and prefetch.seconds(path) is not None
    assert prefetch.ahead("9", 2, tmp_path) is None  # under way already
    reader = RankStore("9", 2, root=tmp_path)
    [v] = [v for v in reader.versions() if v.step == 2]
    slot = reader.slot(v.slot, create=False)
    assert slot._mm is entry.mm and str(path) not in prefetch._pending
    assert int(slot.array[0]) == 2 and slot.array.flags.writeable
    reader.close()


def test_a_file_replaced_since_is_mapped_afresh_and_what_nobody_adopted_is_released(tmp_path: Path) -> None:
    writer = RankStore("9", 0, root=tmp_path)
    k = _commit(writer, 5)
    writer.close()
    prefetch.ahead("9", 0, tmp_path).join()
    path = writer.dir / f"slot-{k}.data"
    stale = _pending(path).mm
    fresh = path.with_name("fresh")
    shutil.copyfile(path, fresh)
    os.chmod(fresh, 0o600)
    with open(fresh, "r+b") as f:
        f.write(b"\x07")
    os.replace(fresh, path)  # another inode at the same path
    reader = RankStore("9", 0, root=tmp_path)
    slot = reader.slot(k, create=False)
    assert slot._mm is not stale and stale.closed and int(slot.array[0]) == 7
    reader.close()
    prefetch.ahead("9", 0, tmp_path).join()
    held = _pending(path).mm
    prefetch.release()
    assert held.closed and not prefetch._pending


def test_nothing_is_mapped_for_a_fresh_run_or_a_read_only_store(tmp_path: Path) -> None:
    assert prefetch.ahead("9", 0, tmp_path) is None  # no store at all
    writer = RankStore("9", 0, root=tmp_path)
    k = _commit(writer, 1)
    writer.close()
    prefetch.ahead("9", 0, tmp_path).join()
    agent = RankStore("9", 0, root=tmp_path, readonly=True)  # a node agent maps read-only, never ahead
    assert agent.slot(k, create=False)._mm is not _pending(writer.dir / f"slot-{k}.data").mm
    agent.close()


def test_init_maps_a_relaunched_ranks_snapshot_while_the_ranks_meet(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HPCFT_STORE_ROOT", str(tmp_path))
    writer = RankStore("78", 0)
    k = _commit(writer, 3)
    writer.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = init(environ={"HPCFT_RANK": "0", "HPCFT_WORLD_SIZE": "1", "HPCFT_LOCAL_RANK": "0", "HPCFT_JOB_ID": "78",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        entry = _pending(writer.dir / f"slot-{k}.data")
        entry.done.wait(10)
        assert entry.mm is not None
        assert np.frombuffer(entry.mm, dtype=np.uint8)[0] == 3
    finally:
        ctx.close()


def _present(address: int, size: int) -> int:
    """Pages of [address, address + size) in this process's page table (/proc/self/pagemap bit 63: present)."""
    page = mmap.PAGESIZE
    first, last = address // page, (address + size - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    return int(((np.frombuffer(raw, dtype=np.uint64) >> np.uint64(63)) & np.uint64(1)).sum())


def _fresh_mapping(tmp_path: Path, nbytes: int) -> tuple[mmap.mmap, int]:
    path = tmp_path / "data"
    with open(path, "wb") as f:
        f.truncate(nbytes)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
    view = np.frombuffer(mm, dtype=np.uint8)
    view[::mmap.PAGESIZE] = 1  # every page in the page cache, then a mapping that has none of them in its table
    del view
    mm.close()
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
    return mm, ntcopy.address(np.frombuffer(mm, dtype=np.uint8))


@pytest.mark.parametrize("in_c", [True, False])
def test_pieces_taken_by_several_threads_populate_every_page_once(tmp_path: Path, monkeypatch, in_c: bool) -> None:
    """In the C loop (no GIL between pieces) and from Python alike: three threads share the pieces, every page of the
    range ends up in the page table, and each piece is counted once."""
    if in_c and ntcopy.populate_loop() is None:
        pytest.skip(f"no kernel library here: {ntcopy.reason}")
    if not in_c:
        monkeypatch.setattr(ntcopy, "populate_loop", lambda: None)
    monkeypatch.setattr(prefetch, "PIECE", 256 << 10)
    nbytes = (5 << 20) + 3 * mmap.PAGESIZE  # a last piece shorter than the others
    mm, address = _fresh_mapping(tmp_path, nbytes)
    pages = nbytes // mmap.PAGESIZE
    assert _present(address, nbytes) < pages
    pieces = prefetch.Pieces(address, nbytes)
    workers = [threading.Thread(target=pieces.work) for _ in range(2)]
    for t in workers:
        t.start()
    pieces.work()
    for t in workers:
        t.join()
    assert pieces.populated.is_set() and not pieces.failed and pieces.count == 21
    assert int(pieces._state[1]) == pieces.count  # every piece done once, none twice
    assert _present(address, nbytes) == pages
    mm.close()


def test_a_restore_that_adopts_a_slot_still_being_populated_takes_pieces_beside_the_prefetch(
        tmp_path: Path, monkeypatch) -> None:
    """The Slot that adopts the mapping does not wait idle for the prefetch thread: it populates what is left."""
    writer = RankStore("9", 0, root=tmp_path)
    k = _commit(writer, 4, nbytes=8 << 20)
    writer.close()
    monkeypatch.setattr(ntcopy, "populate_loop", lambda: None)  # the Python loop, whose pieces can be slowed
    monkeypatch.setattr(prefetch, "PIECE", 1 << 20)
    by: list[str] = []
    real = prefetch._madvise

    def slow(address: int, size: int) -> bool:
        by.append(threading.current_thread().name)
        time.sleep(0.05)
        return real(address, size)

    monkeypatch.setattr(prefetch, "_madvise", slow)
    prefetch.ahead("9", 0, tmp_path)
    while len(by) < 2:  # the first piece under way (and the kernel probe before it)
        time.sleep(0.005)
    reader = RankStore("9", 0, root=tmp_path)
    slot = reader.slot(k, create=False)
    assert slot.populated and threading.current_thread().name in by
    assert _present(ntcopy.address(slot.array), slot.size) == slot.size // mmap.PAGESIZE
    assert int(slot.array[0]) == 4
    reader.close()


def test_a_checkpointer_maps_its_newest_snapshot_ahead_and_a_restore_populates_what_was_not(shm_root: Path) -> None:
    """Made over a stored snapshot, a Checkpointer starts mapping it ahead, and its restore adopts it; a slot mapped
    by the restore itself (here: the prefetch dropped first) is populated in bulk before the copy."""
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="p", auto=False)) as ckpt:
        model(torch.ones(1, 256)).sum().backward()
        opt.step()
        ckpt.step(0)
        ckpt.wait()
    for drop in (False, True):
        again = Checkpointer(model, opt, Options(root=shm_root, job_id="p", auto=False))
        try:
            [path] = [p for p in prefetch._pending if "/rank-00000/" in p]
            if drop:
                prefetch.release()
            assert again.restore() == 1
            assert not prefetch._pending
            [slot] = again.store._slots.values()
            assert slot.populated
            assert _present(ntcopy.address(slot.array), slot.size) == slot.size // mmap.PAGESIZE
            assert str(slot.path) == path
        finally:
            again.close()


@pytest.mark.parametrize("cores,busy,want", [(7, 0, 4), (7, 1, 4), (2, 0, 2), (2, 1, 1), (1, 1, 1)])
def test_the_populating_threads_follow_the_cores_the_task_may_run_on(monkeypatch, cores: int, busy: int,
                                                                     want: int) -> None:
    """A Frontier rank (7 cores of its own) populates with 4 threads; the 2-core sandbox's Checkpointer, whose own
    thread is busy with the restore's set-up, with 1 beside it."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert prefetch.threads(busy) == want
