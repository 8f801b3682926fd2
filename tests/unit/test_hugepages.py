"""The store's page size: which mount holds a path, a tmpfs's huge-page mode, and (as root) a real tmpfs mounted
huge=within_size whose slot files come in 2 MiB pages, so a fresh mapping of a snapshot costs no 4 KiB faults."""
import os
import subprocess
from pathlib import Path

import pytest

from hpcft.store import hugepages
from hpcft.store.slot import Slot

MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
24 22 0:21 / /dev rw,nosuid shared:2 - devtmpfs udev rw,size=1000k
25 24 0:23 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,size=24684084k
40 22 0:40 / /tmp/job\\040dir rw,relatime shared:9 - tmpfs tmpfs rw,size=2097152k,huge=within_size
41 25 0:41 / /dev/shm rw,relatime shared:10 - tmpfs tmpfs rw,size=1024k,huge=always
"""


def test_the_longest_and_last_mount_holding_the_path_counts() -> None:
    assert hugepages.mount_of("/dev/shm/hpcft-1-7/slot-0.data", MOUNTINFO)[:2] == ("/dev/shm", "tmpfs")
    assert "huge=always" in hugepages.mount_of("/dev/shm", MOUNTINFO)[2]  # stacked: the later mount is on top
    assert hugepages.mount_of("/dev/shmem", MOUNTINFO)[0] == "/dev"  # only starts like /dev/shm
    assert hugepages.mount_of("/tmp/job dir/x", MOUNTINFO)[0] == "/tmp/job dir"  # mountinfo escapes spaces


def test_a_tmpfs_mode_is_its_huge_option_unless_the_system_forces_one() -> None:
    assert hugepages.tmpfs_mode("rw,size=1k") == "never"
    assert hugepages.tmpfs_mode("rw,huge=within_size") == "within_size"
    assert hugepages.tmpfs_mode("rw,huge=never", "always within_size advise never deny [force]") == "force"
    assert hugepages.tmpfs_mode("rw,huge=always", "always within_size advise never [deny] force") == "deny"
    assert hugepages.tmpfs_mode("rw,huge=advise", "always within_size advise [never] deny force") == "advise"


def test_the_verdict_names_the_fix_where_pages_are_small(tmp_path: Path) -> None:
    huge, text = hugepages.describe(tmp_path)
    if hugepages.mode(tmp_path) not in hugepages.HUGE:
        assert not huge and "huge=within_size" in text and "HPCFT_STORE_ROOT" in text


def _shmem_huge_kib() -> int:
    line = next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("ShmemHugePages:"))
    return int(line.split()[1])


@pytest.fixture
def huge_tmpfs(tmp_path: Path):
    """A tmpfs mounted huge=within_size (needs root and a kernel with shmem huge pages)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "huge"
    where.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,huge=within_size", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a huge=within_size tmpfs here: {got.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_slot_on_a_huge_tmpfs_gets_huge_pages(huge_tmpfs: Path) -> None:
    assert hugepages.mode(huge_tmpfs) == "within_size" and hugepages.describe(huge_tmpfs)[0]
    before = _shmem_huge_kib()
    slot = Slot(0, huge_tmpfs / "slot-0.data")
    try:
        slot.ensure(32 << 20)  # allocated in full (fallocate), as every slot is
        assert _shmem_huge_kib() - before >= 30 << 10  # (other tmpfs users may free some meanwhile)
    finally:
        slot.close()


def test_the_prolog_remounts_the_store_root_huge_when_the_site_asks(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "shm"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    prolog = Path(__file__).resolve().parents[2] / "slurm" / "prolog.sh"
    try:
        assert hugepages.mode(where) == "never"
        env = {"PATH": os.environ["PATH"], "HPCFT_STORE_ROOT": str(where)}
        subprocess.run(["sh", str(prolog)], env=env, check=True)
        assert hugepages.mode(where) == "never"  # not asked: left as the site mounted it
        subprocess.run(["sh", str(prolog)], env={**env, "HPCFT_SHM_HUGE": "within_size"}, check=True)
        assert hugepages.mode(where) == "within_size"
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
