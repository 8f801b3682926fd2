"""Nodelist expansion and compression agree with Slurm's own `scontrol show hostnames|hostlist`."""
import shutil
import subprocess

import pytest

from hpcft.errors import ConfigError
from hpcft.slurm.nodelist import compress, expand

PATTERNS = [
    "n1",
    "n[1-4]",
    "n[1-3],m[7-8]",
    "gpu[001-016]",
    "gpu[001-003,10]",
    "x[9-11]",
    "x[09-11]",
    "n[1,3,5-6]",
    "a[1-2]b[3-4]",
    "a[1-2]-b[1-2]",
    "node-[1-2]",
    "rack[08-11]",
    "n[001-3]",
    "n[1-003]",
    "n1,n[2-3],n4",
    "frontier[00001-00004]",
    "login1,login2",
    "c[1-2]n[01-02]",
    "host",
    "n[10-12],n[1-2]",
    "cn-[0100-0103],gpu[7]",
    "r[1-2]s[1-2]n[1-2]",
    "n[1-2],n[1-2]",
    "a[1-2]b[1-2]c[1-2]d[1-2]",
]

COMPRESS = [
    "n1,n2,n3",
    "n3,n1,n2",
    "n1,n1,n2",
    "b1,a1,b2",
    "n01,n1,n2",
    "n9,n10,n11",
    "n09,n10",
    "host",
    "a1b1,a1b2",
    "n1,x,n2",
    "gpu001,gpu002,gpu004",
]


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    if not shutil.which("scontrol"):
        pytest.skip("scontrol not installed (Debian package slurm-client)")
    conf = tmp_path_factory.mktemp("slurmconf") / "slurm.conf"
    # Hostlist parsing is client-side; scontrol only needs some configuration to start.
    conf.write_text("ClusterName=nodelist\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")

    def run(*args: str) -> str:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}, check=True)
        return out.stdout

    return run


@pytest.mark.parametrize("pattern", PATTERNS)
def test_expand_agrees_with_scontrol(scontrol, pattern):
    assert expand(pattern) == scontrol("show", "hostnames", pattern).split()


@pytest.mark.parametrize("names", COMPRESS)
def test_compress_agrees_with_scontrol(scontrol, names):
    assert compress(names.split(",")) == scontrol("show", "hostlist", names).strip()


@pytest.mark.parametrize("pattern", PATTERNS)
def test_compress_inverts_expand(pattern):
    assert expand(compress(expand(pattern))) == expand(pattern)


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[3-1]", "n[a-b]", "n[1-3]x", "n[[1]]"])
def test_bad_hostlist_names_the_problem(bad):
    with pytest.raises(ConfigError, match="invalid hostlist"):
        expand(bad)


def test_empty():
    assert expand("") == []
    assert compress([]) == ""
