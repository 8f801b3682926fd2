"""A relaunched rank's newest slot mapped ahead (hpcft.store.prefetch) on real /dev/shm-style files: adopted by the
store's Slot only while it is the same file, dropped otherwise, and started by hpcft.init."""
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest

from hpcft.runtime import init
from hpcft.store import RankStore, prefetch


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
