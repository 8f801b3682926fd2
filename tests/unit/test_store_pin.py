"""Pins on the real store: a pinned version is never chosen for writing, every reusable slot pinned skips the
snapshot with an event (the writer never waits), and a pin whose lease ran out or whose owner died is broken."""
import subprocess
import sys
from pathlib import Path

import pytest

from hpcft import events
from hpcft.errors import StoreError
from hpcft.store import RankStore
from hpcft.store import pin as pins


def _commit(store: RankStore, step: int, nbytes: int = 1000) -> int:
    slot = store.begin(nbytes)
    slot.array[:nbytes] = step % 251
    store.commit(slot, {"step": step})
    return slot.index


def _pin(store: RankStore, step: int, lease: float = 60.0, pin: pins.Pin | None = None) -> Path:
    k = next(v.slot for v in store.versions() if v.step == step)
    path = pins.path_of(store.dir / f"slot-{k}.json")
    pins.write(path, pin or pins.mine(step, lease, owner="test"))
    return path


@pytest.fixture
def evdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "events"
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(d))
    return d


def test_a_pinned_version_survives_any_number_of_snapshots(tmp_path: Path) -> None:
    store = RankStore("1", 0, root=tmp_path)
    for step in (1, 2):
        _commit(store, step)
    _pin(store, 1)
    for step in range(3, 12):
        _commit(store, step)
        held = [v.step for v in store.versions()]
        assert 1 in held and step in held, held
    k = next(v.slot for v in store.versions() if v.step == 1)
    assert (store.slot(k).array[:1000] == 1).all()  # its bytes were never touched


def test_unpinned_the_slot_is_reused_again(tmp_path: Path) -> None:
    store = RankStore("1", 0, root=tmp_path)
    for step in (1, 2):
        _commit(store, step)
    pins.remove(_pin(store, 1))
    for step in (3, 4):
        _commit(store, step)
    assert [v.step for v in store.versions()] == [2, 3, 4]  # keep=2: three slots, step 1's was the first reused


def test_every_reusable_slot_pinned_skips_the_snapshot_with_an_event(tmp_path: Path, evdir: Path) -> None:
    store = RankStore("1", 0, keep=1, root=tmp_path)  # two slots: the newest and one reusable
    for step in (1, 2):
        _commit(store, step)
    _pin(store, 1)
    with pytest.raises(StoreError, match="pinned"):
        store.begin(1000)
    assert [v.step for v in store.versions()] == [1, 2]  # nothing withdrawn
    (ev,) = [e for e in events.read(evdir) if e["event"] == "slots_pinned"]
    assert ev["rank"] == 0 and "step 1" in ev["pins"]


def test_an_expired_pin_is_broken_with_an_event(tmp_path: Path, evdir: Path) -> None:
    store = RankStore("1", 0, keep=1, root=tmp_path)
    for step in (1, 2):
        _commit(store, step)
    path = _pin(store, 1, lease=-1.0)
    _commit(store, 3)
    assert not path.exists()
    (ev,) = [e for e in events.read(evdir) if e["event"] == "pin_broken"]
    assert ev["step"] == 1 and "lease expired" in ev["reason"]


def test_a_pin_of_a_dead_owner_is_broken_before_its_lease_ends(tmp_path: Path, evdir: Path) -> None:
    store = RankStore("1", 0, keep=1, root=tmp_path)
    for step in (1, 2):
        _commit(store, step)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    start = pins.process_start(child.pid)
    child.communicate(b"")
    dead = pins.Pin(1, pins.mine(1, 0).host, child.pid, start, 1e12, "agent")
    _pin(store, 1, pin=dead)
    _commit(store, 3)
    (ev,) = [e for e in events.read(evdir) if e["event"] == "pin_broken"]
    assert ev["pid"] == child.pid and "gone" in ev["reason"]


def test_a_pin_of_another_step_binds_nothing(tmp_path: Path) -> None:
    store = RankStore("1", 0, keep=1, root=tmp_path)
    for step in (1, 2):
        _commit(store, step)
    path = _pin(store, 1, pin=pins.mine(7, 60.0))  # left by a reader of an older version of that slot
    _commit(store, 3)
    assert [v.step for v in store.versions()] == [2, 3]
    assert path.exists()  # not broken: its owner lives and may still release it


def test_a_pin_taken_after_the_check_puts_the_manifest_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RankStore("1", 0, keep=1, root=tmp_path)
    for step in (1, 2):
        _commit(store, step)
    real = store.withdraw

    def withdraw_then_reader_pins(k: int) -> None:  # the reader pins right between the writer's check and withdraw
        _pin(store, 1)
        real(k)

    monkeypatch.setattr(store, "withdraw", withdraw_then_reader_pins)
    before = (store.dir / "slot-0.json").read_bytes()
    with pytest.raises(StoreError, match="pinned"):
        store.begin(1000)
    assert (store.dir / "slot-0.json").read_bytes() == before  # byte-identical: a reader's check still passes
    assert [v.step for v in RankStore("1", 0, keep=1, root=tmp_path, readonly=True).versions()] == [1, 2]


def test_pin_files_are_private_and_renewals_replace_them(tmp_path: Path) -> None:
    path = tmp_path / "slot-0.pin"
    first = pins.mine(3, 10.0)
    pins.write(path, first)
    assert path.stat().st_mode & 0o777 == 0o600
    second = pins.mine(3, 20.0)
    pins.write(path, second)
    pins.remove(path, first)  # an owner's stale handle does not undo its renewal
    assert pins.read(path) == second
    path.write_text("{not json")
    assert pins.stale_reason(pins.read(path)) is not None


def test_training_goes_on_while_every_slot_is_pinned(tmp_path: Path, evdir: Path) -> None:
    import torch

    from hpcft.checkpointer import Checkpointer
    from hpcft.options import Options

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(model, opt, Options(keep=1, root=tmp_path, job_id="1"))
    try:
        def step() -> None:
            model(torch.ones(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.wait()

        step()
        step()
        path = _pin(ckpt.store, 1)
        for _ in range(3):
            step()  # steps 3-5: no reusable slot; each is skipped, never waited for
        assert ckpt.completed == 5
        assert sorted(v.step for v in ckpt.store.versions()) == [1, 2]
        assert [e["step"] for e in events.read(evdir) if e["event"] == "snapshot_skipped"] == [3, 4, 5]
        pins.remove(path)
        step()
        assert sorted(v.step for v in ckpt.store.versions()) == [2, 6]
    finally:
        ckpt.close()


def test_where_an_agent_announced_pins_the_store_keeps_a_spare_slot(tmp_path: Path) -> None:
    assert RankStore("1", 0, root=tmp_path).nslots == 3
    pins.announce(RankStore("1", 0, root=tmp_path).job)
    store = RankStore("1", 0, root=tmp_path)
    assert store.nslots == 4
    for step in (1, 2):
        _commit(store, step)
    _pin(store, 1)  # the newest protected step, kept
    _commit(store, 3)
    _pin(store, 3)  # a pass in flight on the then newest step
    for step in range(4, 10):  # the writer always finds a slot: the newest and one more besides the two pins
        _commit(store, step)
        assert {1, 3, step} <= {v.step for v in store.versions()}
