"""`hpcft run --broadcast-env`'s pure parts and its node-side mechanics on real files: what is packed and where it goes,
the content key and the archive cache (never a stale or partial archive), the interpreter chooser run by a real
shell, the trainers' command, the unpack's checks, a broadcast base interpreter's links, and the settings' layering."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcft.errors import ConfigError
from hpcft.launch.config import model as config
from hpcft.launch.config import profiles
from hpcft.launch.node import broadcast as broadcast_node
from hpcft.launch.steps import broadcast_pack
from hpcft.launch.node import broadcast_paths as paths
from hpcft.launch.steps.broadcast import sbcast_argv, broadcast_argv, wanted

MOUNTS = """\
22 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:50 / /lustre/orion rw shared:9 - lustre 10.1.1.1@o2ib:/orion rw
41 22 0:51 / /sw/frontier rw shared:10 - nfs4 nfs.olcf:/sw rw
42 22 0:52 / /mnt/bb/alice rw shared:11 - xfs /dev/md0 rw
"""


def _venv(root: Path, home: Path) -> Path:
    """A venv-shaped tree: pyvenv.cfg naming `home`, bin/python linking into it, a site-packages with a module."""
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text(f"home = {home}/bin\nversion = 3.11.7\nexecutable = {home}/bin/python3.11\n")
    (root / "bin" / "python").symlink_to(f"{home}/bin/python3.11")
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (site / "mod.py").write_text("x = 1\n")
    return root


def test_fs_type_is_the_longest_mount_holding_the_path():
    assert broadcast_pack.fs_type("/lustre/orion/proj/env/bin/python", MOUNTS) == "lustre"
    assert broadcast_pack.fs_type("/sw/frontier/python/3.11", MOUNTS) == "nfs4"
    assert broadcast_pack.fs_type("/usr/bin/python3", MOUNTS) == "ext4"
    assert broadcast_pack.fs_type("/lustre/orionx", MOUNTS) == "ext4", "a prefix of a name is not a mount point above"


def test_a_venvs_base_is_broadcast_only_from_a_network_file_system(tmp_path):
    env = _venv(tmp_path / "lustre" / "orion" / "env", Path("/sw/frontier/python/3.11"))
    shifted = MOUNTS.replace("/lustre/orion", str(tmp_path / "lustre" / "orion"))
    spec = broadcast_pack.describe(str(env / "bin" / "python"), str(env), "/sw/frontier/python/3.11", shifted)
    assert (spec.prefix, spec.python, spec.base) == (env, "bin/python", Path("/sw/frontier/python/3.11"))
    spec = broadcast_pack.describe(str(env / "bin" / "python"), str(env), "/usr", shifted)
    assert spec.base is None, "a base on the node's own image stays where it is"


def test_a_system_interpreter_or_one_outside_its_env_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="neither.*run hpcft from a venv"):
        broadcast_pack.describe("/usr/bin/python3", str(tmp_path), "/usr", MOUNTS)
    env = _venv(tmp_path / "env", Path("/usr"))
    with pytest.raises(ConfigError, match="not inside its environment"):
        broadcast_pack.describe("/opt/python", str(env), "/usr", MOUNTS)


def test_editable_installs_are_found_in_pth_files_and_setuptools_finders(tmp_path):
    site, src = tmp_path / "site", tmp_path / "src"
    site.mkdir()
    (src / "pkg").mkdir(parents=True)
    (site / "a.pth").write_text(f"# comment\n{src}\nimport something\n/does/not/exist\n")
    (site / "__editable___pkg_0_1_finder.py").write_text(f"import sys\nMAPPING: dict[str, str] = {{'pkg': "
                                                         f"'{src / 'pkg'}'}}\n")
    assert broadcast_pack.editable_roots(site) == (str(src), str(src / "pkg"))


def test_the_key_follows_content_and_ignores_bytecode(tmp_path):
    env = _venv(tmp_path / "env", Path("/usr"))
    spec = broadcast_pack.EnvSpec(env, "bin/python")
    key = broadcast_pack.content_key(spec)
    cache = env / "lib" / "python3.11" / "site-packages" / "__pycache__"
    cache.mkdir()
    (cache / "mod.cpython-311.pyc").write_bytes(b"written by an import")
    assert broadcast_pack.content_key(spec) == key
    mod = env / "lib" / "python3.11" / "site-packages" / "mod.py"
    mod.write_text("x = 22\n")
    assert broadcast_pack.content_key(spec) != key
    assert broadcast_pack.content_key(broadcast_pack.EnvSpec(env, "bin/python", base=tmp_path)) != \
        broadcast_pack.content_key(spec), "what is packed is part of the key"


def test_an_archive_is_packed_once_per_key_and_never_reused_when_incomplete(tmp_path):
    env = _venv(tmp_path / "env", Path("/usr"))
    spec, cache = broadcast_pack.EnvSpec(env, "bin/python"), tmp_path / "cache"
    first = broadcast_pack.pack(spec, cache)
    assert not first.reused and first.path.stat().st_size == first.bytes
    again = broadcast_pack.pack(spec, cache)
    assert again.reused and (again.key, again.crc) == (first.key, first.crc)
    with open(first.path, "r+b") as f:  # cut short, as a pack killed mid-way by a rename it never made would be
        f.truncate(first.bytes // 2)
    assert not broadcast_pack.pack(spec, cache).reused
    assert not list(cache.glob(".*")), "no temporary file left"


def test_unpack_checks_size_and_crc_and_relinks_a_broadcast_base(tmp_path):
    base_from = Path("/sw/frontier/python/3.11")
    env = _venv(tmp_path / "env", base_from)
    base = tmp_path / "base"
    (base / "bin").mkdir(parents=True)
    archive = broadcast_pack.pack(broadcast_pack.EnvSpec(env, "bin/python", base=base), tmp_path / "cache")
    node = tmp_path / "node"
    with pytest.raises(OSError, match="did not arrive whole"):
        broadcast_node.unpack(archive.path, node, archive.bytes + 1, archive.crc)
    with pytest.raises(OSError, match="damaged"):
        broadcast_node.unpack(archive.path, node, archive.bytes, archive.crc ^ 1)
    broadcast_node.unpack(archive.path, node, archive.bytes, archive.crc)
    broadcast_node.relink_base(node, str(base_from))
    assert os.readlink(node / "env" / "bin" / "python") == f"{node}/base/bin/python3.11"
    cfg = (node / "env" / "pyvenv.cfg").read_text()
    assert f"home = {node}/base/bin\n" in cfg and "version = 3.11.7" in cfg


def test_what_stays_outside_is_said_by_its_top_directories():
    assert broadcast_node.collapse(["/a/lib/x", "/a/lib", "/b", "/a/libz", "/b/c/d"]) == ["/a/lib", "/a/libz", "/b"]


def test_the_chooser_runs_the_nodes_verified_copy_else_the_shared_interpreter(tmp_path):
    node, shared = tmp_path / "node", tmp_path / "shared-python"
    for exe, said in ((shared, "shared"), (node / "env" / "bin" / "python", "broadcast")):
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text(f"#!/bin/sh\necho {said} \"$@\"\n")
        exe.chmod(0o755)
    chooser = tmp_path / "python-k1"
    chooser.write_text(paths.chooser(node, "k1", "bin/python", str(shared)))
    chooser.chmod(0o755)
    run = lambda: subprocess.run([str(chooser), "-m", "x y"], capture_output=True, text=True).stdout  # noqa: E731
    assert run() == "shared -m x y\n"
    paths.ok_marker(node, "k0").touch()
    assert run() == "shared -m x y\n", "a copy verified for another key is not used"
    paths.ok_marker(node, "k1").touch()
    assert run() == "broadcast -m x y\n"


def test_the_trainers_command_names_the_broadcast_interpreter_when_it_named_the_shared_one(tmp_path):
    shared = tmp_path / "venv" / "bin" / "python"
    shared.parent.mkdir(parents=True)
    shared.symlink_to(sys.executable)
    broadcast = "/mnt/bb/alice/hpcft-env-alice-1/env/bin/python"
    env = {paths.ENV_SHARED: str(shared), "PATH": str(shared.parent)}
    assert paths.localized([str(shared), "train.py", "-x"], env, broadcast) == [broadcast, "train.py", "-x"]
    assert paths.localized(["python", "-m", "m"], env, broadcast) == [broadcast, "-m", "m"], "found on PATH"
    assert paths.localized(["/usr/bin/env", "python"], env, broadcast) == ["/usr/bin/env", "python"]
    assert paths.localized([str(shared), "t.py"], {}, broadcast) == [str(shared), "t.py"], "not broadcast: unchanged"
    assert paths.localized([str(shared), "t.py"], env, str(shared)) == [str(shared), "t.py"], "a fallback node"


def test_the_node_local_root_and_the_names_under_it():
    env = {"HPCFT_NVME": "/mnt/bb/$USER", "USER": "alice"}
    assert paths.broadcast_root(None, env) == Path("/mnt/bb/alice")
    assert paths.broadcast_root("/local/$USER", env) == Path("/local/alice")
    assert paths.broadcast_root(None, {}) == Path("/tmp")
    root = Path("/mnt/bb/alice")
    assert paths.node_dir(root, "alice", "42") == root / "hpcft-env-alice-42"
    assert paths.archive_dest(root, "alice", "42") == root / "hpcft-env-alice-42.tar"
    assert paths.broadcast_python(root / "n", "bin/python") == root / "n" / "env" / "bin" / "python"


def test_the_broadcasting_step_and_the_broadcast_argv():
    archive = broadcast_pack.Archive(Path("/lustre/job/broadcast/env-k.tar"), "k", 1000, 7, False)
    spec = broadcast_pack.EnvSpec(Path("/lustre/env"), "bin/python", base=Path("/sw/python"))
    argv = broadcast_argv(["frontier00001", "frontier00002", "frontier00007"], python="/lustre/env/bin/python",
                      root=Path("/mnt/bb/alice"), job="42", archive=archive, spec=spec)
    assert argv[:10] == ["srun", "--job-name=hpcft-broadcast", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
                         "--nodelist=frontier[00001-00002,00007]", "--overlap", "--kill-on-bad-exit=0", "--no-kill",
                         "--export=ALL"]
    assert argv[10:] == ["/lustre/env/bin/python", "-m", "hpcft.launch.node.broadcast", "--root", "/mnt/bb/alice",
                         "--job", "42", "--key", "k", "--bytes", "1000", "--crc", "7", "--python", "bin/python",
                         "--base-from", "/sw/python"]
    assert sbcast_argv("42", "3", archive.path, Path("/mnt/bb/alice/x.tar")) == \
        ["sbcast", "-C", "-f", "--jobid=42.3", "/lustre/job/broadcast/env-k.tar", "/mnt/bb/alice/x.tar"]


def test_the_users_setting_wins_over_the_frontier_profiles_default_which_needs_nvme():
    frontier, cpu = profiles.get("frontier"), profiles.get("cpu")
    nvme = {"HPCFT_NVME": "/mnt/bb/alice"}
    assert wanted(config.load({}, {}), frontier, nvme)[0] is True
    assert wanted(config.load({}, {}), frontier, {})[0] is False, "no NVMe: /tmp would take node memory"
    assert wanted(config.load({}, {}), cpu, nvme)[0] is False
    assert wanted(config.load({"broadcast_env": False}, {}), frontier, nvme) == (False, "--no-broadcast-env")
    assert wanted(config.load({}, {"HPCFT_BROADCAST_ENV": "1"}), cpu, {})[0] is True
    assert config.load({}, {"HPCFT_BROADCAST_ENV": "no"}).broadcast.broadcast_env is False
    with pytest.raises(ConfigError, match="HPCFT_BROADCAST_ENV"):
        config.load({}, {"HPCFT_BROADCAST_ENV": "maybe"})


def test_the_janitors_now_step_removes_the_nodes_copy_and_a_half_removed_one_but_only_when_asked(tmp_path):
    copy = tmp_path / "bb" / "hpcft-env-alice-42"
    (copy / "env" / "bin").mkdir(parents=True)
    left = tmp_path / "bb" / "hpcft-env-alice-42.removed-123"  # a janitor killed while it removed the copy
    left.mkdir()
    env = {**os.environ, "HPCFT_STORE_ROOT": str(tmp_path / "shm"), paths.ENV_NODE_DIR: str(copy)}
    (tmp_path / "shm").mkdir()
    janitor = [sys.executable, "-m", "hpcft.launch.node.janitor", "--job", "42", "--job-dir", str(tmp_path), "--now"]
    subprocess.run(janitor, env=env, check=True)  # an elastic shrink's wipe: the nodes' copies stay in use
    assert copy.is_dir() and left.is_dir()
    paths.probe_name(tmp_path / "bb", "alice", "42", "n1").touch()
    subprocess.run([*janitor, "--env-copy"], env=env, check=True)
    assert not list((tmp_path / "bb").iterdir())


def _node_task(root: Path, archive: broadcast_pack.Archive, node: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "hpcft.launch.node.broadcast", "--root", str(root), "--job", "7",
            "--key", archive.key,
            "--bytes", str(archive.bytes), "--crc", str(archive.crc), "--python", "bin/python", "--wait", "60"]
    env = {**os.environ, "SLURMD_NODENAME": node, "HPCFT_BROADCAST_VERIFY": ""}  # a bare venv: no torch to import
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)


def _said(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


def test_a_node_task_unpacks_what_arrived_verifies_the_copys_interpreter_and_keeps_a_verified_copy(tmp_path):
    import getpass
    import venv

    venv.create(tmp_path / "env", with_pip=False, symlinks=True)
    spec = broadcast_pack.describe(str(tmp_path / "env" / "bin" / "python"), str(tmp_path / "env"), sys.base_prefix, "")
    archive = broadcast_pack.pack(spec, tmp_path / "cache")
    root = tmp_path / "disk"
    root.mkdir()
    copy = paths.node_dir(root, getpass.getuser(), "7")
    for present in (False, True):
        if not present:
            (root / paths.archive_dest(root, getpass.getuser(), "7").name).write_bytes(archive.path.read_bytes())
        task = _node_task(root, archive, "frontier00042")
        assert _said(task) == {"node": "frontier00042", "phase": "ready", "shared_with": [], "present": present}
        task.send_signal(signal.SIGUSR1)  # what hpcft run sends once sbcast is over
        done = _said(task)
        assert task.wait(60) == 0 and done["phase"] == "done" and done.get("present", False) is present, done
        assert done["python"] == str(copy / "env" / "bin" / "python")
        assert paths.ok_marker(copy, archive.key).exists() and not list(root.glob("*.tar"))


def test_node_tasks_that_see_each_others_probe_say_their_root_is_shared(tmp_path):
    archive = broadcast_pack.Archive(tmp_path / "none.tar", "k", 1, 0, False)
    first = _node_task(tmp_path, archive, "n1")
    assert _said(first)["shared_with"] == []
    second = _node_task(tmp_path, archive, "n2")
    assert _said(second)["shared_with"] == ["n1"]
    for task, other in ((first, "n2"), (second, "n1")):  # at the go, each sees the other: neither unpacks there
        task.send_signal(signal.SIGUSR1)
        failed = _said(task)
        assert failed["phase"] == "failed" and f"is shared with {other}: not node-local" in failed["error"]
        assert task.wait(60) == 0
