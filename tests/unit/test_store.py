"""The snapshot store on real files: permissions and ownership, slot rotation, atomic commit, ENOSPC."""
import os
from pathlib import Path

import numpy as np
import pytest

from hpcft.errors import StoreError
from hpcft.store import RankStore, crc32c, job_dir, manifest


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path


def _commit(store: RankStore, step: int, nbytes: int = 1000) -> int:
    slot = store.begin(nbytes)
    slot.array[:nbytes] = step % 251
    store.commit(slot, {"step": step})
    return slot.index


def test_layout_and_modes(root: Path) -> None:
    store = RankStore("42", 3, root=root, user="alice")
    _commit(store, 1)
    assert store.dir == root / "hpcft-alice-42" / "rank-00003"
    for path in (store.job, store.dir):
        assert (path.stat().st_mode & 0o777) == 0o700
    for f in store.dir.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o600, f


def test_refuses_symlink_root(root: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (root / "hpcft-alice-7").symlink_to(elsewhere)
    with pytest.raises(StoreError, match="symlink"):
        RankStore("7", 0, root=root, user="alice")


def test_refuses_open_permissions(root: Path) -> None:
    d = job_dir(root, "7", "alice")
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(StoreError, match="0755.*must be 0700"):
        RankStore("7", 0, root=root, user="alice")


def test_refuses_other_owner(root: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    d = job_dir(root, "7", "alice")
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(StoreError, match="owned by uid 65534"):
        RankStore("7", 0, root=root, user="alice")


def test_rotation_keeps_newest_and_keep_versions(root: Path) -> None:
    store = RankStore("j", 0, keep=2, root=root)
    slots = [_commit(store, s) for s in range(1, 8)]
    assert slots[:3] == [0, 1, 2] and len(set(slots)) == 3  # three slots, reused round-robin
    assert [v.step for v in store.versions()] == [5, 6, 7]
    # while a new version is being written, the newest two complete ones are untouched
    slot = store.begin(1000)
    assert [v.step for v in store.versions()] == [6, 7] and slot.index not in {v.slot for v in store.versions()}


def test_crash_before_commit_leaves_previous_loadable(root: Path) -> None:
    store = RankStore("j", 0, keep=1, root=root)
    _commit(store, 1)
    slot = store.begin(1000)
    slot.array[:1000] = 99  # then the process dies: no manifest, a stale .dirty maybe
    (store.dir / f"slot-{slot.index}.json.dirty").write_text("{torn")
    store.close()
    again = RankStore("j", 0, keep=1, root=root)
    assert [v.step for v in again.versions()] == [1]
    assert not list(again.dir.glob("*.dirty"))
    assert (again.slot(again.versions()[0].slot).array[:1000] == 1).all()


def test_corrupt_manifest_is_skipped_with_event(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcft import events

    monkeypatch.setenv("HPCFT_EVENT_DIR", str(root / "ev"))
    store = RankStore("j", 0, root=root)
    _commit(store, 1)
    k = _commit(store, 2)
    path = store.dir / f"slot-{k}.json"
    path.write_bytes(path.read_bytes().replace(b'"step":2}', b'"step":3}'))
    assert [v.step for v in store.versions()] == [1]
    assert [e["event"] for e in events.read(root / "ev")] == ["manifest_bad"]


def test_manifest_roundtrip_and_checksum() -> None:
    m = {"step": 5, "entries": [{"name": "w", "shape": [2, 3]}], "x": 0.1}
    data = manifest.encode(m)
    assert manifest.decode(data)["x"] == 0.1
    with pytest.raises(StoreError, match="checksum"):
        manifest.decode(data.replace(b"0.1", b"0.2"))


@pytest.fixture
def tiny_tmpfs(mount_tmpfs) -> Path:
    """A 1600 KiB tmpfs: room for one 1 MiB slot and its manifests, not for a second slot."""
    return mount_tmpfs("1600k")


def test_crc32c_continues_a_running_checksum() -> None:
    data = np.arange(10_000, dtype=np.uint32).view(np.uint8)
    whole = crc32c(data)
    assert crc32c(data[4321:], crc32c(data[:4321])) == whole
    assert crc32c(data[7:].tobytes(), crc32c(data[:7].tobytes())) == whole


def test_enospc_is_an_error_not_a_crash(tiny_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcft import events

    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tiny_tmpfs.parent / "ev"))
    store = RankStore("j", 0, root=tiny_tmpfs)
    _commit(store, 1)
    with pytest.raises(StoreError, match="No space left"):
        store.begin(1000)
    assert [v.step for v in store.versions()] == [1]
    assert (store.slot(0).array[:1000] == 1).all()
    assert "store_full" in [e["event"] for e in events.read(tiny_tmpfs.parent / "ev")]


def test_paced_growth_allocates_every_page_and_paces_each_piece(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent grows its record files under its CPU cap: `pace` before each piece, the whole file allocated."""
    from hpcft.store import slot as slot_mod

    monkeypatch.setattr(slot_mod, "GROW_PIECE", 1 << 20)
    s = slot_mod.Slot(0, root / "grown.data")
    paced = []
    s.ensure(5 << 20, pace=lambda: paced.append(1))
    assert len(paced) == 5 and s.size == 5 << 20
    assert os.stat(root / "grown.data").st_blocks * 512 >= 5 << 20  # allocated, not a sparse file
    s.array[:] = 7  # mapped writable over the whole length
    s.close()


def test_enospc_while_paced_growth_gives_back_what_it_took(tiny_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcft.store import slot as slot_mod

    monkeypatch.setattr(slot_mod, "GROW_PIECE", 256 << 10)
    s = slot_mod.Slot(0, tiny_tmpfs / "grown.data")
    with pytest.raises(StoreError, match="No space left"):
        s.ensure(4 << 20, pace=lambda: None)
    assert os.stat(tiny_tmpfs / "grown.data").st_size == 0
    s.close()


def test_readonly_reader_sees_versions_and_changes_nothing(root: Path) -> None:
    writer = RankStore("j", 0, root=root)
    _commit(writer, 1)
    (writer.dir / "slot-1.json.dirty").write_text("{in progress")
    reader = RankStore("j", 0, root=root, readonly=True)
    (v,) = reader.versions()
    assert v.step == 1 and (reader.slot(v.slot).array[:1000] == 1).all()
    assert (writer.dir / "slot-1.json.dirty").exists()  # a reader never cleans the writer's files
    with pytest.raises(ValueError):
        reader.slot(v.slot).array[0] = 5  # mapped read-only
    with pytest.raises(StoreError, match="does not exist"):
        RankStore("j", 9, root=root, readonly=True)


def test_a_manifest_is_checked_as_written_or_as_a_canonical_dump() -> None:
    """`encode` leads with the checksum of the canonical JSON after it, checked on the bytes as they are; a file laid
    out another way (an older writer's, or edited by hand with its checksum recomputed) is checked on a canonical
    dump of what it says; a duplicated `checksum` member cannot pass the fast check with another's value."""
    import json

    from hpcft.store.checksum import crc32c

    m = {"step": 5, "format": manifest.FORMAT, "x": [1, 2], "s": 'a "checksum": 1,'}
    data = manifest.encode(m)
    assert data.startswith(b'{"checksum":') and manifest.decode(data)["s"] == m["s"]
    other = json.dumps({**m, "checksum": crc32c(manifest._body(m))}, indent=2).encode()  # not encode's layout
    assert manifest.decode(other)["x"] == [1, 2]
    stated = data[:data.index(b",")]
    for bad in (data.replace(b'"step":5', b'"step":6'), stated + b',"checksum":1,' + data[len(stated) + 1:],
                data[:-2] + b"}", b'{"checksum":x,' + data[len(stated) + 1:]):
        with pytest.raises(StoreError):
            manifest.decode(bad)
