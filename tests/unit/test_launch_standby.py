"""The warm standby, run for real without Slurm: a standby process (hpcft/launch/node/standby.py), the task wrapper
(hpcft/launch/node/task.py → warm.py) in front of it, real fds, signals and exits; plus the pure parts (zygote.py)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from hpcft import events
from hpcft.launch.node import standby
from hpcft.launch.node import zygote
from hpcft.launch.policy.layout import Layout
from hpcft.launch.node.srun import step_env

JOB = "4242"
PROBE = """import json, os, signal, sys
import __main__
print(json.dumps({"spec": __spec__ and (__spec__.name, __spec__.origin), "pkg": __package__, "loader": type(__loader__).__name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__, "cwd": os.getcwd(),
                  "rank": os.environ.get("RANK"), "extra": os.environ.get("PROBE_EXTRA"), "main": sys.modules["__main__"].__file__,
                  "affinity": sorted(os.sched_getaffinity(0)), "umask": os.umask(0o022), "stdin": sys.stdin.read(),
                  "buffering": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stderr.line_buffering],
                  "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                  "ignored": sorted(s for s in signal.valid_signals() if signal.getsignal(s) is signal.SIG_IGN)}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


def _wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def node(tmp_path):
    """A running standby (preloading only `json`: the protocol is the test, not torch) in a store root of its own;
    yields the wrapper's environment for rank 3 of a 2-node, 2-task layout, whose node n2 the standby serves."""
    root, job_dir = Path(tempfile.mkdtemp(prefix="hpcft-standby-test-")), tmp_path / "job"
    root.chmod(0o755)  # as /dev/shm is: the standby's own directory is what keeps other users out
    lay = Layout.plan(["n1", "n2"], tasks_per_node=2)
    env = {**os.environ, **step_env(lay, job_id=JOB, restart_count=0, job_dir=str(job_dir)), "SLURMD_NODENAME": "n2",
           "SLURM_LOCALID": "1", "HPCFT_STORE_ROOT": str(root), zygote.ENV_STANDBY: "1"}
    del env["HPCFT_JOB_DIR"]  # no progress watcher: its fork would be one more child to account for
    proc = subprocess.Popen([sys.executable, "-m", "hpcft.launch.node.standby", "--job-dir", str(job_dir), "--job", JOB,
                             "--preload", "json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: standby.status_path(job_dir, "n2").exists() or proc.poll() is not None, "the standby")
    assert json.loads(standby.status_path(job_dir, "n2").read_text())["phase"] == "ready", proc.stdout.read()
    yield env
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not zygote.socket_dir(JOB, root).exists(), "a stopped standby removes its socket"
    assert json.loads(standby.status_path(job_dir, "n2").read_text())["phase"] == "stopped"
    shutil.rmtree(root)


def _wrapped(env, *command, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpcft.launch.node.task", "--", *command], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _starts(env) -> list[dict]:
    return [e for e in events.read(env["HPCFT_EVENT_DIR"]) if e["event"] == "trainer_start"]


def _finish(wrapper: subprocess.Popen, env, timeout: float = 60) -> tuple[str, str]:
    """communicate(), or a failure saying what the wrapper and its warm rank were doing (state, signal masks)."""
    try:
        return wrapper.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        seen = {}
        for pid in [wrapper.pid, *(e["pid"] for e in _starts(env))]:
            try:
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
                seen[pid] = [ln for ln in lines if ln.startswith(("State", "Sig", "ShdPnd"))]
                seen[pid].append("wchan: " + Path(f"/proc/{pid}/wchan").read_text())
            except OSError as exc:
                seen[pid] = str(exc)
        wrapper.kill()
        pytest.fail(f"the wrapper did not end within {timeout:g} s: {seen}; "
                    f"events: {events.read(env['HPCFT_EVENT_DIR'])}")


def _nohup_and_masked() -> None:
    """As `nohup` leaves a process (SIGHUP ignored), with SIGUSR2 blocked: what exec keeps, a warm rank must too."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})


def test_a_warm_rank_sees_what_a_cold_python_script_sees(node, tmp_path):
    """argv, sys.path[0], __file__, __main__, cwd, the environment, affinity, umask, signal mask and ignored signals,
    stdio (its buffering too) and the exit code are those of `python SCRIPT`, through the wrapper's own fds."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "probe.py").write_text(PROBE)
    (tmp_path / "link.py").symlink_to(scripts / "probe.py")  # sys.path[0] is the real script's directory
    work = tmp_path / "work"
    work.mkdir()
    env = {**node, "PROBE_EXTRA": "x y", "PROBE_EXIT": "3"}
    for script in ("../link.py", str(scripts / "probe.py")):
        warm = _wrapped(env, sys.executable, script, "a", "--b", cwd=work, preexec_fn=_nohup_and_masked)
        w_out, w_err = warm.communicate("stdin text", timeout=60)
        cold = subprocess.run([sys.executable, script, "a", "--b"], env={**env, "RANK": "3"}, cwd=work,
                              input="stdin text", capture_output=True, text=True, timeout=60,
                              preexec_fn=_nohup_and_masked)
        assert warm.returncode == cold.returncode == 3, w_err
        assert json.loads(w_out) == json.loads(cold.stdout)
        assert w_err.endswith("to stderr\n") and cold.stderr == "to stderr\n"
    assert [(e["how"], e["rank"]) for e in _starts(node)] == [("warm", "3"), ("warm", "3")]
    assert len({e["pid"] for e in _starts(node)}) == 2, "a fresh child for every launch"


def test_a_module_runs_as_python_m_would(node, tmp_path):
    (tmp_path / "probemod.py").write_text(PROBE)
    warm = _wrapped(node, sys.executable, "-u", "-m", "probemod", "z", cwd=tmp_path)
    w_out, w_err = warm.communicate("", timeout=60)
    cold = subprocess.run([sys.executable, "-u", "-m", "probemod", "z"], env={**node, "RANK": "3"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert warm.returncode == cold.returncode == 0, w_err
    assert json.loads(w_out) == json.loads(cold.stdout)
    assert _starts(node)[0]["how"] == "warm"


def test_an_uncaught_exception_is_reported_as_a_cold_interpreter_would(node, tmp_path):
    (tmp_path / "boom.py").write_text("def f():\n    raise ValueError('boom')\nf()\n")
    warm = _wrapped(node, sys.executable, str(tmp_path / "boom.py"))
    _, w_err = warm.communicate(timeout=60)
    cold = subprocess.run([sys.executable, str(tmp_path / "boom.py")], capture_output=True, text=True, timeout=60)
    assert warm.returncode == cold.returncode == 1
    assert w_err.splitlines()[-len(cold.stderr.splitlines()):] == cold.stderr.splitlines(), w_err
    missing = _wrapped(node, sys.executable, str(tmp_path / "missing.py"))
    _, m_err = missing.communicate(timeout=60)
    assert missing.returncode == 2 and "can't open file" in m_err and "no script" in m_err  # cold, and said


def test_signal_deaths_propagate_and_signals_are_forwarded(node, tmp_path):
    (tmp_path / "die.py").write_text("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    died = _wrapped(node, sys.executable, str(tmp_path / "die.py"))
    died.communicate(timeout=60)
    assert died.returncode == -signal.SIGSEGV
    (tmp_path / "term.py").write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('got', signal.SIGTERM.value, flush=True), sys.exit(7)))\n"
        "print('ready', flush=True)\ntime.sleep(60)\n")
    term = _wrapped(node, sys.executable, str(tmp_path / "term.py"))
    assert term.stdout.readline() == "ready\n"
    term.send_signal(signal.SIGTERM)
    out, _ = _finish(term, node)
    assert (term.returncode, out) == (7, "got 15\n")


LATE_SIGNAL = """import json, signal, socket, sys, threading, time
from pathlib import Path
from hpcft.launch.node import warm, zygote
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
main = Path(f"/proc/self/task/{threading.get_native_id()}/stat")

def standby():
    while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or main.read_text().rsplit(")", 1)[1].split()[0] != "S":
        time.sleep(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # its C handler runs here: the main thread sleeps on
    theirs.settimeout(5)
    try:
        got = zygote.receive(theirs)[0]
    except TimeoutError:
        got = None
    zygote.send(theirs, {"exit": 0})
    print(json.dumps(got), flush=True)

thread = threading.Thread(target=standby)
thread.start()
code = warm._wait(ours, set())
thread.join()
sys.exit(code)
"""


def test_a_signal_the_interpreter_takes_just_before_the_wrapper_blocks_is_still_forwarded():
    # Python runs a signal's handler between bytecodes: one whose C handler ran just before the wrapper's blocking
    # wait (here: on another thread, so the wait is not interrupted either) must still wake it and be forwarded
    got = subprocess.run([sys.executable, "-c", LATE_SIGNAL], capture_output=True, text=True, timeout=60)
    assert (got.returncode, got.stdout) == (0, json.dumps({"signal": signal.SIGTERM.value}) + "\n"), got.stderr


def test_a_sigkilled_wrapper_takes_its_rank_and_the_ranks_children_along(node, tmp_path):
    (tmp_path / "sleep.py").write_text(
        "import os, subprocess, sys, time\n"
        "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(os.getpid(), kid.pid, flush=True)\ntime.sleep(120)\n")
    wrapper = _wrapped(node, sys.executable, str(tmp_path / "sleep.py"))
    pids = [int(p) for p in wrapper.stdout.readline().split()]
    wrapper.kill()
    wrapper.wait(timeout=30)
    for pid in pids:
        _wait_for(lambda: not _alive(pid), f"pid {pid} to end with its wrapper", timeout=30)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_what_a_standby_cannot_run_runs_cold_and_says_why(node, tmp_path):
    (tmp_path / "ok.py").write_text("import os; print(os.environ['RANK'])")
    cases = [((sys.executable, "-c", "import os; print(os.environ['RANK'])"), {}, "interpreter option '-c'"),
             (("sh", "-c", "echo $RANK"), {}, "is not the interpreter"),
             ((sys.executable, str(tmp_path / "ok.py")), {"PYTHONPATH": str(tmp_path)}, "PYTHONPATH differs"),
             ((sys.executable, str(tmp_path / "ok.py")), {"HPCFT_JOB_ID": "other"}, "no standby answered")]
    for command, extra, why in cases:
        proc = _wrapped({**node, **extra}, *command)
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out) == (0, "3\n"), err
        assert why in err, err  # a warning line on the task's stderr, never silent
    colds = [e for e in _starts(node) if e["how"] == "cold"]
    assert len(colds) == 4 and all(e["level"] == "WARNING" for e in colds)
    off = _wrapped({**node, zygote.ENV_STANDBY: "0"}, sys.executable, str(tmp_path / "ok.py"))
    assert off.communicate(timeout=60) == ("3\n", "") and off.returncode == 0  # standby off: cold, nothing said


def test_another_user_cannot_reach_the_standby(node):
    path = zygote.socket_path(JOB, node["HPCFT_STORE_ROOT"])
    assert (path.parent.stat().st_mode & 0o777, path.stat().st_mode & 0o777) == (0o700, 0o600)
    if os.getuid() != 0:
        pytest.skip("needs root to become another user")
    code = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
            "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(13)\n")
    assert subprocess.run([sys.executable, "-c", code, str(path)], timeout=60).returncode == 13
    os.chmod(path.parent, 0o755)  # past the directory, the standby itself checks the peer's uid
    os.chmod(path, 0o666)
    code += "print(s.recv(10))\n"
    got = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert got.stdout == "b''\n", got.stderr
    assert [e["uid"] for e in events.read(node["HPCFT_EVENT_DIR"]) if e["event"] == "standby_refused"] == [65534]


def test_fork_safety_refuses_threads_and_counts_native_ones():
    # a fresh interpreter, as a standby is: this test process may hold other tests' threads
    fresh = subprocess.run([sys.executable, "-c", "from hpcft.launch.node import standby; "
                            "print(standby.fork_unsafe(standby.native_threads()))"],
                           capture_output=True, text=True, timeout=120)
    assert fresh.stdout.strip() == "None", fresh.stderr
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="busy")
    thread.start()
    try:
        assert "busy" in standby.fork_unsafe(standby.native_threads())
    finally:
        stop.set()
        thread.join()
    assert "threads running" in standby.fork_unsafe(0)
    with open(os.devnull) as held:  # a driver file held open, as cuInit (/dev/nvidiactl) or hsa_init (/dev/kfd) do
        assert standby.gpu_driver_open(prefixes=(os.devnull,)) == os.devnull
    assert held.closed


def test_which_commands_a_standby_can_run():
    py = sys.executable
    assert zygote.target_of([py, "train.py", "--x"], py, None) == (zygote.Target("script", "train.py", ("--x",)), "")
    assert zygote.target_of([py, "-u", "-m", "pkg.mod", "a"], py, None)[0] == \
        zygote.Target("module", "pkg.mod", ("a",), unbuffered=True)
    bin_dir = os.path.dirname(py)
    assert zygote.target_of([os.path.basename(py), "t.py"], py, bin_dir)[0] is not None  # found on PATH
    for command, why in [([py], "no script"), ([py, "-m"], "-m without"), ([py, "-O", "t.py"], "'-O'"),
                         (["/usr/bin/env", "python", "t.py"], "not the interpreter")]:
        target, reason = zygote.target_of(command, py, None)
        assert target is None and why in reason, (command, reason)
    assert zygote.env_mismatch({"OMP_NUM_THREADS": "7", "X": "1"}, {"OMP_NUM_THREADS": "7"}) is None
    assert zygote.env_mismatch({"OMP_NUM_THREADS": "7"}, {}) == "OMP_NUM_THREADS"
    assert zygote.env_mismatch({"LD_PRELOAD": "a.so"}, {"LD_PRELOAD": "b.so"}) == "LD_PRELOAD"


def test_a_spare_standby_imports_behind_the_others_until_they_are_ready_then_gives_its_priority_back():
    """The real /proc/self/autogroup, in a session of its own (a standby's, as srun starts it), also unprivileged:
    a spare's preload runs at nice 19 until the supervisor's marker of the active standbys' readiness is newer than
    the step's start (an older one is an earlier step's), then at its old nice, and its watcher thread is gone."""
    top = Path(tempfile.mkdtemp(prefix="hpcft-autogroup-"))  # not under pytest's 0700 tmp: user nobody runs here
    job = top / "job"
    job.mkdir()
    (top / "slow_import.py").write_text("import time\ntime.sleep(2)\n")  # a preload of 2 s
    os.chmod(top, 0o755)
    os.chmod(job, 0o777)
    try:
        _behind_in_a_session(top, job)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _behind_in_a_session(top: Path, job: Path) -> None:
    script = f"""
import os, threading, time
os.setsid()
from hpcft.agent.transport import autogroup
from hpcft.launch.node import standby
marker = standby.active_ready_path({str(job)!r})
marker.parent.mkdir(exist_ok=True)
marker.touch()
os.utime(marker, (time.time() - 60, time.time() - 60))  # an earlier step's
since = time.time()
seen = []
def supervisor():  # its wait for the active nodes' standbys ends 1 s after the step started
    time.sleep(0.5)
    seen.append(autogroup.current())
    time.sleep(0.5)
    marker.touch()
threading.Thread(target=supervisor).start()
before = autogroup.current()
_, behind = standby._preload_behind(["slow_import"], {str(job)!r}, "n3", ["n3"], since, timeout=30)
if behind is None:
    print("none", before)
else:
    print(before, seen[0], autogroup.current(), round(behind.held_s, 1), threading.active_count())
"""
    env = {**os.environ, "PYTHONPATH": f"{Path(__file__).resolve().parents[2]}:{top}"}
    cmds = [[sys.executable, "-c", script]]
    if os.geteuid() == 0 and os.path.exists("/usr/bin/setpriv"):  # a user's job: no privilege to lower a nice
        cmds.append(["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmds[0]])
    for cmd in cmds:
        for p in job.iterdir():
            p.unlink() if p.is_file() else shutil.rmtree(p)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        out = done.stdout.split()
        if out[0] == "none":
            pytest.skip("no /proc/self/autogroup: a kernel without CONFIG_SCHED_AUTOGROUP")
        before, during, after, held, threads = out
        assert (during, after) == ("19", before), (cmd[0], done.stdout)
        assert 0.8 <= float(held) <= 1.8, done.stdout  # until the others were ready (1 s), not the import (2 s)
        assert threads == "1", "the watcher thread outlived the preload"


def test_what_a_rank_leaves_in_its_group_ends_with_it(node, tmp_path):
    """As a step's end kills every process of the step, a warm rank's end kills what it left behind."""
    (tmp_path / "leave.py").write_text(
        "import subprocess, sys\n"
        "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']).pid, flush=True)\n")
    proc = _wrapped(node, sys.executable, str(tmp_path / "leave.py"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    _wait_for(lambda: not _alive(int(out)), "the rank's leftover to end", timeout=30)


PRELOADED_RESTORE = """import importlib, sys
import torch
from hpcft.launch.config.sections import DEFAULT_PRELOAD
for name in DEFAULT_PRELOAD.split(","):
    importlib.import_module(name)
import hpcft
root = sys.argv[1]
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(2, 4)).sum().backward()
opt.step()
options = hpcft.Options(root=root, job_id="preload", auto=False)
with hpcft.Checkpointer(model, opt, options) as ckpt:
    ckpt.step(0)
    ckpt.wait()
before = set(sys.modules)
fresh = torch.nn.Linear(4, 4)
with hpcft.Checkpointer(fresh, torch.optim.AdamW(fresh.parameters()), options) as ckpt:
    assert ckpt.restore() == 1
print("\\n".join(sorted(set(sys.modules) - before)))
"""


def test_a_warm_ranks_first_restore_imports_nothing_the_preload_left_out(tmp_path):
    # a relaunched rank's restore made the optimizer's state with torch.distributed.checkpoint's helper, whose first
    # import cost 47-110 ms of every warm relaunch (4 ranks on 2 cores) until the preload carried it
    got = subprocess.run([sys.executable, "-c", PRELOADED_RESTORE, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr
    late = [m for m in got.stdout.split() if m.startswith(("torch.distributed", "torch.optim", "hpcft"))
            and m != "hpcft.snapshot.calibration.measure"]  # a host's first calibration (then cached)
    assert late == []
