"""The sandbox's layout and the Slurm files rendered from it (golden text), without starting anything."""
import subprocess
from pathlib import Path

import pytest

from hpcft.errors import ConfigError
from hpcft.sandbox.config import (SandboxConfig, plan, render_hosts, render_mpi_conf, render_slurm_conf,
                                  render_slurmdbd_conf)
from hpcft.sandbox.procs import namespaced

# When a change to the rendering is intended, print render_slurm_conf(plan(SandboxConfig(dir="/tmp/sb",
# nodes=2, prolog=None, epilog=None))) and paste it here.
GOLDEN_NETNS = """\
# Written by `hpcft sandbox up`; rewritten on every start.
ClusterName=hpcft-sandbox
SlurmctldHost=ctl(10.77.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=/tmp/sb/munge/munge.socket,cred_expire=10
StateSaveLocation=/tmp/sb/state
SlurmdSpoolDir=/tmp/sb/spool/%n
SlurmctldPidFile=/tmp/sb/run/slurmctld.pid
SlurmdPidFile=/tmp/sb/run/slurmd-%n.pid
SlurmctldLogFile=/tmp/sb/log/slurmctld.log
SlurmdLogFile=/tmp/sb/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=10.77.0.1
AccountingStoragePort=6819
AccountingStoragePass=/tmp/sb/munge/munge.socket
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
KillWait=3
ReturnToService=1
JobRequeue=1
SchedulerParameters=sched_interval=2,bf_interval=1
NodeName=n1 NodeHostname=n1 NodeAddr=10.77.0.11 Port=6818 CPUs=4 RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=10.77.0.12 Port=6818 CPUs=4 RealMemory=1000 State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def test_netns_slurm_conf_matches_golden_text():
    assert render_slurm_conf(plan(SandboxConfig(dir="/tmp/sb", nodes=2, prolog=None, epilog=None))) == GOLDEN_NETNS


def test_the_sandbox_keeps_accounts_through_its_own_slurmdbd_as_a_real_cluster_or_none_when_asked():
    """slurmdbd beside slurmctld (its namespace's address; local: ports past the nodes'), storing into MariaDB on
    127.0.0.1 there; without accounting slurm.conf names accounting_storage/none and nothing else changes."""
    netns = plan(SandboxConfig(dir="/tmp/sb", nodes=2))
    assert render_slurmdbd_conf(netns).splitlines()[1:] == [
        "DbdHost=ctl", "DbdAddr=10.77.0.1", "DbdPort=6819", "SlurmUser=root", "AuthType=auth/munge",
        "AuthInfo=socket=/tmp/sb/munge/munge.socket", "LogFile=/tmp/sb/log/slurmdbd.log",
        "PidFile=/tmp/sb/run/slurmdbd.pid", "DebugLevel=info", "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1", "StoragePort=3306", "StorageUser=root", "StorageLoc=slurm_acct_db"]
    local = plan(SandboxConfig(dir="/tmp/sb", nodes=64, mode="local", ctld_port=20000), hostname="h")
    assert (local.dbd_port, local.db_port) == (20065, 20066)
    assert max(n.port for n in local.nodes) < local.dbd_port
    with_it, without = (render_slurm_conf(plan(SandboxConfig(dir="/tmp/sb", nodes=2, prolog=None, epilog=None,
                                                             accounting=a))).split("\n") for a in (True, False))
    assert [x for x in without if x not in with_it] == ["AccountingStorageType=accounting_storage/none"]
    assert [x for x in with_it if x not in without] == [
        "AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=10.77.0.1",
        "AccountingStoragePort=6819", "AccountingStoragePass=/tmp/sb/munge/munge.socket"]


def test_the_sandbox_runs_hpcfts_own_prolog_and_epilog_as_a_cluster_with_hpcft_would():
    slurm = Path(__file__).resolve().parents[2] / "slurm"
    cfg = SandboxConfig(dir="/tmp/sb", nodes=1)
    assert (cfg.prolog, cfg.epilog) == (str(slurm / "prolog.sh"), str(slurm / "epilog.sh"))
    assert f"\nProlog={cfg.prolog}\nEpilog={cfg.epilog}\nNodeName=n1 " in render_slurm_conf(plan(cfg))


def test_local_mode_shares_localhost_with_one_port_per_node():
    layout = plan(SandboxConfig(dir="/tmp/sb", nodes=3, mode="local", ctld_port=20000), hostname="host.example")
    text = render_slurm_conf(layout)
    assert "SlurmctldHost=host(127.0.0.1)\nSlurmctldPort=20000\n" in text
    assert "NodeName=n3 NodeHostname=localhost NodeAddr=127.0.0.1 Port=20003 CPUs=4" in text
    assert render_hosts(layout) == "127.0.0.1 localhost\n"
    assert layout.ctld_netns is None and all(n.netns is None for n in layout.nodes)


def test_netns_layout_gives_each_node_its_own_namespace_address_and_hosts_entry():
    layout = plan(SandboxConfig(dir="/tmp/sb", nodes=6, subnet="10.9.8"))
    assert [n.addr for n in layout.nodes] == [f"10.9.8.{i}" for i in range(11, 17)]
    assert len({n.netns for n in layout.nodes} | {layout.ctld_netns}) == 7
    assert "10.9.8.1 ctl\n" in render_hosts(layout) and "10.9.8.16 n6\n" in render_hosts(layout)
    assert render_mpi_conf(layout) == "PMIxCliTmpDirBase=/tmp/sb/pmix\n"


def test_two_directories_never_share_namespace_names():
    a, b = plan(SandboxConfig(dir="/tmp/a")), plan(SandboxConfig(dir="/tmp/b"))
    assert a.ctld_netns != b.ctld_netns


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"mode": "vm"}, "mode 'vm'"),
        ({"nodes": 0}, "between 1 and"),
        ({"subnet": "10.0.0.0/24"}, "subnet"),
        ({"ctld_port": 70000}, "ctld_port 70000"),
    ],
)
def test_bad_config_is_named(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        SandboxConfig(dir="/tmp/sb", **kwargs)


def test_unknown_node_names_the_nodes_there_are():
    with pytest.raises(ConfigError, match="nodes are n1, n2"):
        plan(SandboxConfig(dir="/tmp/sb", nodes=2)).node("n9")


def test_namespaced_command_is_valid_shell_and_keeps_arguments_intact():
    argv = namespaced(["echo", "a b", "$HOME"], marker="m-1", marker_dir=Path("/run/x"), netns="ns-1",
                      hostname="n1", binds=[(Path("/tmp/h o"), "/etc/hosts")], tmpfs=[("shm-1", "size=1g", "/dev/shm")])
    assert argv[:2] == ["nsenter", "--net=/run/netns/ns-1"]
    script = argv[-1]
    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0
    assert "exec echo 'a b' '$HOME'" in script and "mount --bind '/tmp/h o' /etc/hosts" in script


def test_a_confined_sandbox_confines_steps_as_a_real_node_and_gives_each_node_8_gpus():
    """--confine changes the plugins and the node lines only: task/cgroup + task/affinity, proctrack/cgroup, GPUs as
    GRES, and the machine's real CPUs (a cpuset holds only CPUs that exist); its cgroup.conf and gres.conf."""
    import os

    from hpcft.sandbox.confine import render_cgroup_conf, render_gres_conf

    def lines(**kw) -> list[str]:
        config = SandboxConfig(dir="/tmp/sb", nodes=2, prolog=None, epilog=None, **kw)
        return render_slurm_conf(plan(config)).split("\n")

    plain, confined = lines(), lines(confine=True)
    cpus = os.cpu_count()
    assert [x for x in plain if x not in confined] == [
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        *(x for x in plain if x.startswith("NodeName="))]
    assert [x for x in confined if x not in plain] == [
        "ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup,task/affinity", "GresTypes=gpu",
        f"NodeName=n1 NodeHostname=n1 NodeAddr=10.77.0.11 Port=6818 CPUs={cpus} RealMemory=1000 Gres=gpu:8 "
        "State=UNKNOWN",
        f"NodeName=n2 NodeHostname=n2 NodeAddr=10.77.0.12 Port=6818 CPUs={cpus} RealMemory=1000 Gres=gpu:8 "
        "State=UNKNOWN"]
    assert render_cgroup_conf().splitlines()[1:] == ["CgroupPlugin=cgroup/v1", "ConstrainCores=yes",
                                                     "ConstrainRAMSpace=yes", "ConstrainDevices=yes"]
    assert render_gres_conf(Path("/tmp/sb/dev")).splitlines()[1:] == ["Name=gpu File=/tmp/sb/dev/gpu[0-7]"]


def test_a_confined_node_joins_its_cgroups_then_sees_them_as_its_own_root():
    """Each slurmd joins its node's cgroup in every controller before a cgroup namespace is made there, and mounts
    each controller afresh inside (the host's mount of the same hierarchy is unmounted first: the kernel refuses
    the hierarchy on its own root)."""
    argv = namespaced(["slurmd", "-D"], marker="m-1", marker_dir=Path("/run/x"),
                      cgroups=[Path("/sys/fs/cgroup/cpuset/sb/n1"), Path("/sys/fs/cgroup/memory/p q/sb/n1")],
                      cgroup_mounts=[("cpuset", "/sys/fs/cgroup/cpuset")])
    assert argv[:2] == ["sh", "-c"]
    outer = argv[2]
    assert subprocess.run(["sh", "-n", "-c", outer]).returncode == 0
    joins, unshare = outer.split("exec ", 1)
    assert joins.splitlines()[1:] == ["echo $$ > /sys/fs/cgroup/cpuset/sb/n1/cgroup.procs",
                                      "echo $$ > '/sys/fs/cgroup/memory/p q/sb/n1/cgroup.procs'"]
    assert unshare.startswith("unshare -m --cgroup --propagation private sh -c")
    assert "umount /sys/fs/cgroup/cpuset\nmount -t cgroup -o cpuset cgroup /sys/fs/cgroup/cpuset\nexec slurmd -D" \
        in unshare.replace("'", "")
