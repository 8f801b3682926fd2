"""Memory planning: (keep + 1) snapshot slots, the agents' pinned slot and parity/partner records against a node's
memory, before the first launch (a given state size) and once the first snapshot exists (its real size)."""
import logging

import pytest

from hpcft.errors import ConfigError
from hpcft import nodemem
from hpcft.launch.config import model as config
from hpcft.launch.config import memplan
from hpcft.launch.steps import preflight
from hpcft.launch.config import profiles
from hpcft.launch.config.model import RunConfig, make
from hpcft.launch.steps.preflight import Preflight

G = 2**30


def test_sizes_are_read_with_units():
    assert memplan.parse_bytes("4096") == 4096
    assert memplan.parse_bytes("64G") == 64 * G and memplan.parse_bytes("1.5TiB") == int(1.5 * 2**40)
    assert memplan.parse_bytes("512 MB") == 512 * 2**20
    assert config.load({"state_bytes": "120G", "node_memory": "512G"}, environ={}).memory.state_bytes == 120 * G
    with pytest.raises(ConfigError, match="state_bytes='lots' is not a valid"):
        config.load({"state_bytes": "lots"}, environ={})
    with pytest.raises(ConfigError, match="memory_headroom must be a fraction"):
        config.load({"memory_headroom": 1.5}, environ={})


def test_plan_counts_slots_and_protection_records():
    p = memplan.plan(10 * G, keep=2, scheme="xor", ratio=1 / 3)
    assert p.slots == 4  # keep + 1 + the agents' pinned slot
    assert p.needed == 40 * G + int(3 * (1 / 3) * 10 * G)
    assert memplan.plan(10 * G, keep=2).needed == 30 * G  # no agents: keep + 1 slots, no records
    assert memplan.verdict(p, 100 * G, 0.2, "node") is None


def test_what_does_not_fit_is_said_with_what_to_change():
    p = memplan.plan(100 * G, keep=3, scheme="partner", ratio=1.0)  # 5 slots + 3 partner records = 800 GiB
    why = memplan.verdict(p, 512 * G, 0.2, "--node-memory")
    assert "800.0 GiB per node = 5 snapshot slots (keep 3 + 1 + 1 pinned by the agent) × 100.0 GiB" in why
    assert "+ 3 partner records × 1.00 × 100.0 GiB" in why
    assert "--node-memory offers 512.0 GiB, 409.6 GiB after the 20% headroom" in why
    assert "at most 51.2 GiB per snapshot fits" in why and "--memory-headroom (now 0.2)" in why
    assert "keep=" not in why and "--protect xor" not in why  # neither would fit
    p = memplan.plan(50 * G, keep=3, scheme="partner", ratio=1.0)  # 250 + 150 = 400 GiB > 320 usable
    why = memplan.verdict(p, 400 * G, 0.2, "this node")
    assert "keep=1 in the Checkpointer (and --keep 1)" in why  # 3 slots + 150 = 300 GiB
    assert "--protect xor --group 4 (300.0 GiB" in why  # 5 slots + 3 × 1/3 × 50 = 300 GiB


def _events():
    got = []
    return got, lambda kind, **fields: got.append((kind, fields))


def test_a_given_state_that_cannot_fit_stops_the_run_before_launch(tmp_path):
    got, emit = _events()
    cfg = make(protect="xor", group=4, state_bytes=64 * G, node_memory=128 * G)
    with pytest.raises(ConfigError, match=r"snapshots need 320.0 GiB per node .* --node-memory offers 128.0 GiB"):
        Preflight(cfg, profiles.CPU, {"USER": "u", "HPCFT_STORE_ROOT": str(tmp_path)}, emit, "9").start(4)
    ok = make(protect="xor", group=4, state_bytes=16 * G, node_memory=512 * G)
    Preflight(ok, profiles.CPU, {"USER": "u", "HPCFT_STORE_ROOT": str(tmp_path)}, emit, "9").start(4)
    assert got[-1][0] == "memory_plan" and got[-1][1]["checked"] is True and got[-1][1]["needed"] == 80 * G


def test_the_real_tmpfs_is_the_limit(mount_tmpfs):
    """The store root's free space (a real 1600 KiB tmpfs) bounds the plan when no --node-memory is given."""
    root = mount_tmpfs("1600k")
    got, emit = _events()
    cfg = make(protect="none", state_bytes=1 << 20, memory_headroom=0.0)
    with pytest.raises(ConfigError, match=r"3.0 MiB per node = 3 snapshot slots .* this node \(1.\d MiB free"):
        Preflight(cfg, profiles.CPU, {"USER": "u", "HPCFT_STORE_ROOT": str(root)}, emit, "9").start(1)


def _write_snapshot(job, ranks, nbytes):
    for rank in range(ranks):
        d = job / f"rank-{rank:05d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "slot-0.data").write_bytes(b"\0" * nbytes)


def test_after_the_first_snapshot_its_real_size_is_checked_once(tmp_path, monkeypatch):
    """Without agents: this node's own store (a real directory tree), when the batch host trains."""
    monkeypatch.setattr(preflight, "PLAN_EVERY_S", 0.0)
    got, emit = _events()
    cfg = make(protect="none", keep=2, node_memory=1 << 20, memory_headroom=0.0)
    pre = Preflight(cfg, profiles.CPU, {"USER": "u", "HPCFT_STORE_ROOT": str(tmp_path)}, emit, "9")
    pre.start(1)
    assert got[-1] == ("memory_plan", {"checked": False,
                                       "reason": "no --state-bytes: checked once the first snapshot exists"})
    pre.poll()
    assert len(got) == 1  # no snapshot yet: nothing to say
    _write_snapshot(tmp_path / "hpcft-u-9", 2, 200 * 1024)  # 2 ranks: 400 KiB per node × 3 slots > 1 MiB
    pre.poll()
    pre.poll()
    assert len(got) == 2
    kind, fields = got[-1]
    assert kind == "memory_plan" and fields["level"] == logging.WARNING and fields["state_bytes"] == 400 * 1024
    assert "1.2 MiB per node = 3 snapshot slots (keep 2 + 1) × 400.0 KiB" in fields["reason"]


def test_the_agents_reports_name_the_tightest_node(tmp_path, monkeypatch):
    """With agents: each node's own figures (its status report, written with hpcft.nodemem.figures)."""
    monkeypatch.setattr(preflight, "PLAN_EVERY_S", 0.0)
    _write_snapshot(tmp_path / "job", 1, 64 * 1024)
    real = {**nodemem.figures(tmp_path / "job"), "node": "n1"}
    assert real["snapshot_bytes"] == 64 * 1024 and real["store_bytes"] >= 64 * 1024
    tight = {"node": "n2", "snapshot_bytes": 64 * G, "store_bytes": 64 * G, "shm_free": 100 * G,
             "mem_available": 90 * G}
    got, emit = _events()
    cfg = make(protect="xor", group=4, memory_headroom=0.1)
    pre = Preflight(cfg, profiles.CPU, {"USER": "u", "HPCFT_STORE_ROOT": str(tmp_path)}, emit, "9")
    pre.poll(lambda: [real, tight])
    kind, fields = got[-1]
    assert kind == "memory_plan" and fields["level"] == logging.WARNING and fields["nodes"] == 2
    # 4 slots × 64 GiB + 3 × 1/3 × 64 GiB = 320 GiB; n2 offers 64 + min(100, 90) = 154 GiB
    assert "320.0 GiB per node" in fields["reason"] and "n2 (100.0 GiB free" in fields["reason"]
    assert "154.0 GiB, 138.6 GiB after the 10% headroom" in fields["reason"]


def test_the_plan_waits_for_every_agents_report_until_the_launch_is_over(tmp_path, monkeypatch):
    """A loaded node's agent may report its first snapshot rounds after the others: the plan waits for all of them
    (the tightest node may be the late one); once the launch is over it checks what came, and says so."""
    monkeypatch.setattr(preflight, "PLAN_EVERY_S", 0.0)
    early = {"node": "n1", "snapshot_bytes": 1024, "store_bytes": 1024, "shm_free": G, "mem_available": G}
    got, emit = _events()
    pre = Preflight(make(protect="xor", group=4), profiles.CPU, {"USER": "u", "HPCFT_STORE_ROOT": str(tmp_path)},
                    emit, "9")
    pre.poll(lambda: [early, {"node": "n2"}], expected=4)
    assert got == []  # one of four has a snapshot
    pre.poll(lambda: [early], now=True, expected=4)
    kind, fields = got[-1]
    assert kind == "memory_plan" and fields["nodes"] == 1 and fields["expected"] == 4 and fields["checked"] is True
    pre.poll(lambda: [early] * 4, expected=4)
    assert len(got) == 1  # once per run
    every = Preflight(make(protect="xor", group=4), profiles.CPU,
                      {"USER": "u", "HPCFT_STORE_ROOT": str(tmp_path)}, emit, "9")
    every.poll(lambda: [{**early, "node": f"n{i}"} for i in range(1, 5)], expected=4)
    assert got[-1][1]["nodes"] == 4 and "expected" not in got[-1][1]
