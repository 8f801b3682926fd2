"""The store against careless and hostile input, on real files: symlinks, FIFOs, directories and other users' files
where a slot's files go; a store that runs out of space and gets it back; a relaunch with a smaller `keep`; two
writers of one rank store; a run with the default job id refusing state another process wrote."""
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from hpcft import events
from hpcft.checkpointer import Checkpointer
from hpcft.errors import StoreError
from hpcft.options import Options
from hpcft.store import writer

from live_state import same, state_of  # tests/unit is on sys.path (pytest's rootdir insertion)


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, it: int) -> None:
    model(torch.randn(2, 8, generator=torch.Generator().manual_seed(it))).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _kinds(tmp: Path) -> list[str]:
    return [e["event"] for e in events.read(tmp / "events")]


def _train(root: Path, steps: int, keep: int = 2) -> dict[int, dict]:
    """Train `steps` steps with a snapshot each; the state after each step."""
    model, opt = _model()
    refs = {}
    with Checkpointer(model, opt, Options(root=root, job_id="j", keep=keep)) as ckpt:
        for it in range(steps):
            _step(model, opt, it)
            refs[it + 1] = state_of(model, opt)
        ckpt.wait()
    return refs


def _plant(path: Path, kind: str, elsewhere: Path) -> None:
    """Put a `kind` of irregular file at `path` in place of whatever is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if kind == "symlink":
        elsewhere.write_bytes(b"\0" * 4096)
        path.symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        path.mkdir(mode=0o700)
    elif kind == "foreign":
        path.write_bytes(b"\0" * 4096)
        path.chmod(0o600)
        os.chown(path, 65534, 65534)


KINDS = ["symlink", "fifo", "directory", "foreign"]


@pytest.fixture
def root(shm_root: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    return shm_root


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["slot-2.data", "slot-2.json", "slot-2.json.dirty"])
@pytest.mark.parametrize("kind", KINDS)
def test_irregular_file_at_snapshot_time_skips_the_slot_with_an_event(root: Path, tmp_path: Path, kind: str,
                                                                      target: str) -> None:
    refs = _train(root, 2)  # slots 0 and 1 hold steps 1 and 2; slot 2 is the next one written
    rdir = next(root.glob("hpcft-*-j")) / "rank-00000"
    _plant(rdir / target, kind, tmp_path / "elsewhere")
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=root, job_id="j")) as ckpt:  # never an OSError out of the constructor
        assert ckpt.restore() == 2 and same(state_of(model, opt), refs[2])
        for it in range(2, 6):
            _step(model, opt, it)  # never an OSError out of optimizer.step()
        ckpt.wait()
        assert ckpt.store.versions()[-1].step == 6  # snapshots go on in the other slots
    assert "store_full" not in _kinds(tmp_path)  # space is not the problem
    # a file that can be removed where a manifest goes is reported when read (manifest_bad) and then replaced; one that
    # cannot (a directory), and any data file, is reported when the slot is skipped (store_file_refused)
    said = [e for e in events.read(tmp_path / "events") if e["event"] in ("store_file_refused", "manifest_bad")
            and str(rdir) in e.get("path", "") + e["error"]]
    if target != "slot-2.json.dirty" or kind == "directory":  # a stale .dirty file of another kind is just removed
        assert said
    if target == "slot-2.data" or kind == "directory":
        assert "store_file_refused" in {e["event"] for e in said}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["slot-1.data", "slot-1.json"])
@pytest.mark.parametrize("kind", KINDS)
def test_irregular_file_at_restore_time_loses_that_version_only(root: Path, tmp_path: Path, kind: str,
                                                                target: str) -> None:
    refs = _train(root, 2)  # step 2 is in slot 1
    rdir = next(root.glob("hpcft-*-j")) / "rank-00000"
    _plant(rdir / target, kind, tmp_path / "elsewhere")
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=root, job_id="j")) as ckpt:
        assert ckpt.restore() == 1
        assert same(state_of(model, opt), refs[1])


@pytest.fixture
def tiny_tmpfs(mount_tmpfs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 2600 KiB tmpfs: room for two 1 MiB slots and their manifests, not for three."""
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    return mount_tmpfs("2600k")


def _fill(path: Path) -> None:
    """Write zeros into `path` until the file system is full."""
    with open(path, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass


def test_snapshots_resume_when_space_comes_back(tiny_tmpfs: Path, tmp_path: Path) -> None:
    filler = tiny_tmpfs / "filler"
    filler.write_bytes(b"\0" * (1 << 20))  # leaves room for one slot only
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=tiny_tmpfs, job_id="j")) as ckpt:
        _step(model, opt, 0)
        ckpt.wait()
        _step(model, opt, 1)  # no second slot fits: skipped
        ckpt.wait()
        assert [v.step for v in ckpt.store.versions()] == [1] and "snapshot_skipped" in _kinds(tmp_path)
        filler.unlink()
        _step(model, opt, 2)
        ckpt.wait()
        assert [v.step for v in ckpt.store.versions()] == [1, 3]
    assert "store_resumed" in _kinds(tmp_path)


def test_a_full_store_still_restores(tiny_tmpfs: Path) -> None:
    refs = _train(tiny_tmpfs, 1)
    _fill(tiny_tmpfs / "filler")
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=tiny_tmpfs, job_id="j")) as ckpt:  # nothing to write before a restore
        assert ckpt.restore() == 1 and same(state_of(model, opt), refs[1])


def test_a_smaller_keep_still_sees_the_newest_version(root: Path) -> None:
    refs = _train(root, 4, keep=3)  # steps 1..4 in slots 0..3
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=root, job_id="j", keep=1)) as ckpt:
        assert ckpt.restore() == 4 and same(state_of(model, opt), refs[4])
        for it in range(4, 7):
            _step(model, opt, it)
        ckpt.wait()
        assert [v.step for v in ckpt.store.versions()] == [6, 7]
        assert sorted(p.name for p in ckpt.store.dir.glob("slot-*.data")) == ["slot-0.data", "slot-1.data"]


def _holder(root: Path) -> subprocess.Popen:
    """Another process writing rank 0's store of job "j" until its stdin closes."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from hpcft.store import RankStore
        store = RankStore("j", 0, root={str(root)!r})
        print("open", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "open"
    return holder


def test_a_second_writer_of_a_rank_store_is_refused(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "HANDOVER_S", 0.5)
    holder = _holder(root)
    try:
        with pytest.raises(StoreError, match=rf"already being written by .*:{holder.pid}:.*after 0.5 s.*own job id"):
            Checkpointer(*_model(), Options(root=root, job_id="j"))
    finally:
        holder.communicate("", timeout=60)
    Checkpointer(*_model(), Options(root=root, job_id="j")).close()  # the other writer is gone: free again


def test_a_relaunched_writer_waits_for_its_predecessor_to_exit(root: Path) -> None:
    """A relaunch does not wait for srun to say the old step ended (a lost node's srun says nothing for seconds):
    the new rank's store waits on its node for the killed writer's exit, then takes the store over."""
    holder = _holder(root)
    threading.Timer(1.0, holder.stdin.close).start()  # it exits a second from now
    started = time.monotonic()
    Checkpointer(*_model(), Options(root=root, job_id="j")).close()
    assert holder.wait(timeout=60) == 0 and 0.5 < time.monotonic() - started < writer.HANDOVER_S


def test_a_claim_waiting_for_another_process_holds_up_no_claim_of_another_directory(tmp_path: Path) -> None:
    """A store waiting for its killed predecessor's exit (up to HANDOVER_S) must not stall this process's claims of
    other stores: an agent's, or a bench's ranks in threads."""
    busy, free = tmp_path / "busy", tmp_path / "free"
    busy.mkdir()
    free.mkdir()
    lock = os.open(busy / writer.LOCK, os.O_CREAT | os.O_RDWR, 0o600)  # as a store makes it
    os.close(lock)
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, sys; f = open({str(busy / writer.LOCK)!r}, 'r+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    waiting = threading.Thread(target=lambda: writer.claim(busy)())
    waiting.start()
    time.sleep(0.2)  # its claim waits for the holder now
    started = time.monotonic()
    writer.claim(free)()
    assert time.monotonic() - started < 1.0 and waiting.is_alive()
    holder.communicate("", timeout=60)
    waiting.join(timeout=writer.HANDOVER_S)
    assert not waiting.is_alive()


def test_default_job_id_refuses_another_process_state_unless_adopted(shm_root: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HPCFT_JOB_ID", "HPCFT_RANK", "RANK", "SLURM_PROCID", "SLURM_JOB_ID", "HPCFT_ADOPT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HPCFT_STORE_ROOT", str(shm_root))
    other = textwrap.dedent("""
        import torch, hpcft
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with hpcft.Checkpointer(model, opt) as ckpt:
            model(torch.ones(2, 8)).sum().backward()
            opt.step()
    """)
    subprocess.run([sys.executable, "-c", other], check=True, env=dict(os.environ), timeout=120)
    with Checkpointer(*_model()) as ckpt:  # another run with the default job id: not this one's to resume
        assert ckpt.job_id == "local" and ckpt.restore() == 0
    (refused,) = [e for e in events.read(tmp_path / "events") if e["event"] == "restore_foreign"]
    assert refused["level"] == "ERROR" and "job_id=" in refused["advice"] and "adopt='local'" in refused["advice"]
    model, opt = _model()
    with Checkpointer(model, opt, Options(adopt="local")) as ckpt:  # told to: taken, and said
        assert ckpt.restore() == 1
        _step(model, opt, 1)
        ckpt.wait()
    assert _kinds(tmp_path).count("restore_adopted") == 1
    with Checkpointer(*_model()) as again:  # state this process wrote is its own; the other's step 1 refused again
        assert again.restore() == 2
    assert _kinds(tmp_path).count("restore_foreign") == 2 and _kinds(tmp_path).count("restore_adopted") == 1
