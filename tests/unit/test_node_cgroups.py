"""hpcft/launch/node/cgroups.py: reading /proc/<pid>/cgroup and mountinfo (pure), and a process joining another's
cgroups for real (root and a cgroup v1 cpuset, else skipped)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcft.launch.node import cgroups

CGROUP = """9:name=systemd:/
4:memory:/slurm_n1/uid_0/job_2/step_3/task_1
3:cpuset:/slurm_n1/uid_0/job_2/step_3
1:cpu,cpuacct:/
0::/user.slice
"""
MOUNTINFO = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 /slurm_n1 /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
50 23 0:40 / /mnt/with\\040space rw - cgroup cgroup rw,freezer
"""


def test_membership_names_each_hierarchy_by_its_controllers_and_v2_by_nothing():
    got = cgroups.membership(CGROUP)
    assert got == {"name=systemd": "/", "memory": "/slurm_n1/uid_0/job_2/step_3/task_1",
                   "cpuset": "/slurm_n1/uid_0/job_2/step_3", "cpu,cpuacct": "/", "": "/user.slice"}


def test_a_cgroup_is_found_under_the_mount_whose_root_holds_it():
    d = cgroups.directory
    assert d("cpuset", "/slurm_n1/uid_0/job_2/step_3", MOUNTINFO) == Path("/sys/fs/cgroup/cpuset/slurm_n1/uid_0/"
                                                                          "job_2/step_3")
    # a mount of a sub-cgroup (a bind mount, or a cgroup namespace's view) reaches what is below its root only
    assert d("memory", "/slurm_n1/uid_0/job_2", MOUNTINFO) == Path("/sys/fs/cgroup/memory/uid_0/job_2")
    assert d("memory", "/slurm_n1", MOUNTINFO) == Path("/sys/fs/cgroup/memory")
    assert d("memory", "/slurm_n2/job_1", MOUNTINFO) is None
    assert d("cpu,cpuacct", "/a", MOUNTINFO) == Path("/sys/fs/cgroup/cpu,cpuacct/a")
    assert d("", "/user.slice", MOUNTINFO) == Path("/sys/fs/cgroup/unified/user.slice")
    assert d("freezer", "/x", MOUNTINFO) == Path("/mnt/with space/x")
    assert d("devices", "/", MOUNTINFO) is None  # not mounted here


def test_joining_a_cgroup_that_is_not_there_fails_naming_it():
    with pytest.raises(cgroups.CgroupError, match="cannot join .*cgroup.procs|is not mounted"):
        cgroups.join({**cgroups.own(), **{h: "/hpcft-no-such-cgroup" for h in cgroups.own() if h}})
    assert cgroups.join(cgroups.own()) == [], "already there: nothing to move"


def _cpuset_of_ours() -> Path | None:
    path = cgroups.own().get("cpuset")
    where = cgroups.directory("cpuset", path, Path("/proc/self/mountinfo").read_text()) if path else None
    return where if where and os.access(where, os.W_OK) else None


@pytest.mark.skipif(os.geteuid() != 0 or _cpuset_of_ours() is None, reason="needs root and a cgroup v1 cpuset")
def test_a_process_joins_another_processs_cpuset_and_takes_its_cpus():
    """What a warm child does (standby_child._setup): join its wrapper's cgroups; the cpuset bounds it from then on."""
    group = _cpuset_of_ours() / f"hpcft-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpuset.mems").write_text((group.parent / "cpuset.mems").read_text())
        (group / "cpuset.cpus").write_text("0")
        target = {**cgroups.own(), "cpuset": cgroups.own()["cpuset"].rstrip("/") + "/" + group.name}
        code = ("import json, os, sys; from hpcft.launch.node import cgroups; "
                "moved = cgroups.join(json.loads(sys.argv[1])); "
                "print(json.dumps([moved, cgroups.own()['cpuset'], sorted(os.sched_getaffinity(0))]))")
        out = subprocess.run([sys.executable, "-c", code, json.dumps(target)], capture_output=True, text=True,
                             check=True).stdout
        assert json.loads(out) == [["cpuset"], target["cpuset"], [0]]
    finally:
        group.rmdir()
