"""The local Slurm sandbox: a real slurmctld and N real slurmd on this machine, started, inspected, crashed.
Everything lives under one directory; its state.json records what was started, so any process can
`Sandbox.load(dir)` it and run Slurm clients inside it."""
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from pathlib import Path

from hpcft.errors import SandboxError, SlurmError
from hpcft.sandbox import accounting, confine, mounts, munge, netns, procs
from hpcft.sandbox.machine import check_machine, port_free
from hpcft.sandbox.config import (Layout, SandboxConfig, plan, render_hosts, render_mpi_conf, render_slurm_conf,
                                  render_slurmdbd_conf)
from hpcft.slurm.runner import Runner

_log = logging.getLogger(__name__)

STATE_FILE = "state.json"
# Every daemon's namespace mounts its marker tmpfs here: a fixed directory that is never removed (removing
# a mount point, even one mounted only in another namespace, detaches the mount and would hide the marker).
MARKER_DIR = Path("/run/hpcft-sandbox-mark")
_READY = {"idle", "mixed", "allocated", "completing"}  # responding (no '*'), not down, drained or failing


class Sandbox:
    """One sandbox directory: its layout, and the daemons (groups) started for it."""

    def __init__(self, layout: Layout, groups: Mapping[str, dict] | None = None, created_netns: Iterable[str] = (),
                 created_cgroups: Iterable[str] = ()):
        self.layout = layout
        self.groups: dict[str, procs.Group | None] = {k: procs.Group.from_json(v) if v else None
                                                      for k, v in (groups or {}).items()}
        self.created_netns: list[str] = list(created_netns)
        self.created_cgroups: list[str] = list(created_cgroups)  # confined: every node's cgroup, all controllers

    # -- construction and the state file ------------------------------------------------------
    @classmethod
    def load(cls, directory: Path | str) -> "Sandbox":
        """The sandbox recorded in `directory` (started by `hpcft sandbox up` or a test fixture)."""
        path = Path(directory).absolute() / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise SandboxError(f"no sandbox in {path.parent}: start one with `hpcft sandbox up --dir {path.parent}`") \
                from exc
        except (OSError, ValueError) as exc:
            raise SandboxError(f"cannot read sandbox state {path}: {exc}; remove it and run `hpcft sandbox up`") \
                from exc
        config = SandboxConfig(**{**data["config"], "dir": Path(data["config"]["dir"])})
        layout = plan(config, hostname=data["ctld_host"])
        return cls(layout, data.get("groups"), data.get("netns", []), data.get("cgroups", []))

    @property
    def dir(self) -> Path:
        return self.layout.dir

    @property
    def config(self) -> SandboxConfig:
        return self.layout.config

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.layout.nodes]

    def _save(self) -> None:
        lay = self.layout
        data = {"mode": self.config.mode, "config": {**asdict(self.config), "dir": str(self.config.dir)},
                "ctld_host": lay.ctld_host, "controller": {"host": lay.ctld_host, "addr": lay.ctld_addr,
                                                           "port": lay.ctld_port},
                "nodes": [asdict(n) for n in lay.nodes], "client_prefix": self.client_prefix(),
                "slurm_conf": str(lay.slurm_conf), "netns": self.created_netns, "cgroups": self.created_cgroups,
                "groups": {k: g.to_json() if g else None for k, g in self.groups.items()}}
        tmp = self.dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.dir / STATE_FILE)

    # -- clients -----------------------------------------------------------------------------
    def client_prefix(self) -> list[str]:
        """What goes before srun/sbatch/scontrol so they reach the sandbox (enter its network namespace)."""
        ctl = self.layout.ctld_netns
        return ["nsenter", f"--net=/run/netns/{ctl}"] if ctl else []

    def client_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment (`base`, default ours) whose Slurm clients talk to this sandbox."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.layout.slurm_conf)
        return env

    def runner(self, timeout: float | None = 60.0) -> Runner:
        """The Runner every Slurm command for this sandbox goes through."""
        return Runner(prefix=self.client_prefix(), env={"SLURM_CONF": str(self.layout.slurm_conf)}, timeout=timeout)

    # -- inspection ----------------------------------------------------------------------------
    def is_up(self) -> bool:
        """True if the controller we started is still running."""
        ctl = self.groups.get("slurmctld")
        return (self.dir / STATE_FILE).exists() and ctl is not None and procs.alive(ctl.pid, ctl.start_time)

    def node_states(self) -> dict[str, str]:
        """Slurm's view of every node, e.g. {'n1': 'idle', 'n2': 'down*'} ('*': not responding)."""
        out = self.runner(timeout=15).run(["sinfo", "--noheader", "--Node", "--format=%N %T"]).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    def _group(self, name: str) -> procs.Group | None:
        self.layout.node(name)  # an error naming the nodes there are, for a name that is none
        return self.groups.get(name)

    def node_pids(self, name: str) -> list[int]:
        """Live processes of node `name`: its slurmd, slurmstepds and their tasks."""
        return procs.members(group) if (group := self._group(name)) else []

    def log_files(self) -> list[Path]:
        """Every log the sandbox writes (daemon output, Slurm logs, munged)."""
        return sorted(p for p in [*self.layout.log_dir.glob("*"), self.dir / "munge" / "munged.log"] if p.is_file())

    # -- start -----------------------------------------------------------------------------------
    def up(self, timeout: float = 30.0) -> bool:
        """Start the sandbox and wait until every node is idle; False if it was already up. On any failure what was
        started is stopped again and the error names the cause."""
        if self.is_up():
            return False
        if (self.dir / STATE_FILE).exists():
            raise SandboxError(f"a stopped sandbox is recorded in {self.dir}: run `hpcft sandbox down --dir "
                               f"{self.dir}` first")
        self.preflight()
        try:
            self._prepare_files()
            self._save()
            self._start_munge()
            if self.config.mode == "netns":
                self._create_namespaces()
            if self.config.accounting:
                self._start_accounting()
            self._start_controller()
            for node in self.node_names:
                self._start_node(node)
            self.wait_ready(timeout=timeout)
        except BaseException:
            _log.info("sandbox start failed; stopping what was started")
            self.down()
            raise
        return True

    def preflight(self) -> None:
        """Fail early, naming the missing privilege, binary or busy port, before anything starts."""
        check_machine(self.config.mode, self.config.accounting)
        if self.config.confine and (why := confine.unavailable_reason()):
            raise SandboxError(f"no confined sandbox on this machine: {why}; start one without --confine")
        if self.config.mode == "local":
            lay = self.layout
            ports = [("slurmctld", lay.ctld_port)] + [(f"slurmd {n.name}", n.port) for n in lay.nodes]
            ports += [("slurmdbd", lay.dbd_port), ("mariadbd", lay.db_port)] if self.config.accounting else []
            for who, port in ports:
                if not port_free(port):
                    raise SandboxError(f"port {port} ({who}) is in use on this machine: choose free ports with "
                                       "--ctld-port/--slurmd-port or use --mode netns")

    def _prepare_files(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "pmix", "run"):
            shutil.rmtree(d / sub, ignore_errors=True)
        for sub in ("etc", "log", "state", "pmix", "run", *(f"spool/{n}" for n in self.node_names)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        MARKER_DIR.mkdir(mode=0o755, exist_ok=True)
        d.chmod(0o755)
        for path in self.layout.log_dir.glob("*"):
            path.unlink()
        self.layout.slurm_conf.write_text(render_slurm_conf(self.layout))
        self.layout.mpi_conf.write_text(render_mpi_conf(self.layout))
        self.layout.hosts_file.write_text(render_hosts(self.layout))
        lay = self.layout
        confine.write_files(lay.cgroup_conf, lay.gres_conf, lay.gpu_dir, self.config.confine)
        munge.prepare(d / "munge")
        if self.config.accounting:
            lay.slurmdbd_conf.write_text(render_slurmdbd_conf(lay))
            lay.slurmdbd_conf.chmod(0o600)  # slurmdbd refuses a readable one: it may hold the database's password
            accounting.prepare(lay.db_dir)

    def _marker(self, name: str) -> str:
        return f"hpcft-{self.config.tag}-{name}"

    def _spawn(self, key: str, argv: list[str], **ns) -> None:
        self.groups[key] = procs.spawn(procs.namespaced(argv, marker=self._marker(key), marker_dir=MARKER_DIR, **ns),
                                       self.layout.log_dir / f"{key}.out", self._marker(key))
        self._save()

    def _start_munge(self) -> None:
        self._spawn("munged", munge.argv(self.dir / "munge"))
        self._await(self.layout.munge_socket.exists, "munged", self.dir / "munge" / "munged.log", 5)

    def _add_netns(self, name: str) -> None:
        netns.add(name)
        self.created_netns.append(name)  # recorded only once it is ours, so rollback never deletes another's
        self._save()

    def _create_namespaces(self) -> None:
        ctl = self.layout.ctld_netns
        self._add_netns(ctl)
        netns.setup_controller(ctl, self.layout.ctld_addr)
        for node in self.layout.nodes:
            self._add_netns(node.netns)
            netns.setup_node(node.netns, ctl, node.name, node.addr)

    def _netns_options(self, netns_name: str | None, hostname: str) -> dict:
        if netns_name is None:
            return {}
        return {"netns": netns_name, "hostname": hostname, "binds": [(self.layout.hosts_file, "/etc/hosts")]}

    def _start_accounting(self) -> None:
        """MariaDB, then slurmdbd, in the controller's namespace; ready once sacctmgr gets an answer through them."""
        lay, ns = self.layout, self._netns_options(self.layout.ctld_netns, self.layout.ctld_host)
        self._spawn("mariadbd", accounting.mariadbd_argv(lay.db_dir, lay.db_port), **ns)
        self._await(lambda: accounting.socket(lay.db_dir).exists(), "mariadbd", lay.db_dir / "mariadbd.log", 30)
        self._spawn("slurmdbd", accounting.slurmdbd_argv(lay.slurm_conf), **ns)
        ask = ["sacctmgr", "--noheader", "--parsable2", "show", "cluster", "format=cluster"]

        def answers() -> bool:  # a sacctmgr that hangs (10 s) is asked again, until the deadline names slurmdbd's log
            try:
                return self.runner(timeout=10).run(ask, check=False).returncode == 0
            except SlurmError:
                return False

        self._await(answers, "slurmdbd", lay.log_dir / "slurmdbd.log", 60)

    def _await(self, ready: Callable[[], bool], key: str, log: Path, timeout: float) -> None:
        """Poll `ready` until it holds; an error with `log`'s tail if daemon `key` exits or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while not ready():
            group = self.groups[key]
            if not procs.alive(group.pid, group.start_time) or time.monotonic() > deadline:
                raise SandboxError(f"{key} of the sandbox did not start within {timeout:g} s; its log {log}:\n"
                                   f"{procs.tail(log)}\n{procs.tail(self.layout.log_dir / f'{key}.out', 5)}")
            time.sleep(0.1)

    def _start_controller(self) -> None:
        argv = ["slurmctld", "-D", "-i", "-f", str(self.layout.slurm_conf)]
        self._spawn("slurmctld", argv, **self._netns_options(self.layout.ctld_netns, self.layout.ctld_host))

    def _start_node(self, name: str) -> None:
        node = self.layout.node(name)
        argv = ["slurmd", "-D", "-N", name, "-f", str(self.layout.slurm_conf)]
        own = mounts.node_mounts(self.layout, name, self._marker(name))
        ns = self._netns_options(node.netns, node.hostname)
        ns["binds"] = [*ns.get("binds", ()), *own.binds]
        if self.config.confine:
            directories, options = confine.prepare_node(self.config.tag, name)
            self.created_cgroups += [str(d) for d in directories if str(d) not in self.created_cgroups]
            ns.update(options)
        self._spawn(name, argv, tmpfs=own.tmpfs, **ns)

    # -- readiness -------------------------------------------------------------------------------
    def wait_for(self, nodes: Iterable[str], predicate: Callable[[str], bool], what: str,
                 timeout: float) -> dict[str, str]:
        """Poll Slurm until predicate(state) holds for every node in `nodes`; the error shows the log tails."""
        nodes = list(nodes)
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            self._check_daemons()
            try:
                states = self.node_states()
            except SlurmError as exc:
                states = {"(sinfo)": str(exc)}
            if all(predicate(states.get(n, "")) for n in nodes):
                return states
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p}:\n{procs.tail(p, 8)}" for p in [self.layout.log_dir / "slurmctld.out",
                                  *(self.layout.log_dir / f"{n}.out" for n in nodes)])
                raise SandboxError(f"sandbox nodes {','.join(nodes)} not {what} within {timeout:g} s; Slurm says "
                                   f"{states}\n{logs}")
            time.sleep(0.1)

    def wait_ready(self, nodes: Iterable[str] | None = None, timeout: float = 30.0) -> dict[str, str]:
        """Wait until the nodes (default all) are up and usable in Slurm."""
        return self.wait_for(self.node_names if nodes is None else nodes, _READY.__contains__, "ready", timeout)

    def _check_daemons(self) -> None:
        for key in ("munged", "slurmctld", *(("mariadbd", "slurmdbd") if self.config.accounting else ())):
            group = self.groups.get(key)
            if group is None or not procs.alive(group.pid, group.start_time):
                log = self.layout.log_dir / f"{key}.out"
                raise SandboxError(f"{key} of the sandbox is not running; its log {log}:\n{procs.tail(log)}")

    # -- faults ----------------------------------------------------------------------------------
    def crash_node(self, name: str) -> list[int]:
        """A hard node crash: SIGKILL its slurmd, slurmstepds and tasks at once; its /dev/shm is lost."""
        group = self._group(name)
        pids = procs.members(group) if group else []
        if group:
            procs.kill(group, signal.SIGKILL)
        _log.info("crashed sandbox node %s (killed pids %s)", name, pids)
        return pids

    def freeze_node(self, name: str) -> list[int]:
        """A node that stops answering without closing anything (a hung kernel; a partition, as its peers see it):
        SIGSTOP its slurmd, slurmstepds and tasks. Their sockets stay open. `thaw_node` or `crash_node` ends it."""
        pids = procs.signal_members(group, signal.SIGSTOP) if (group := self._group(name)) else []
        _log.info("froze sandbox node %s (stopped pids %s)", name, pids)
        return pids

    def thaw_node(self, name: str) -> list[int]:
        """Let a frozen node's processes run again (SIGCONT)."""
        return procs.signal_members(group, signal.SIGCONT) if (group := self._group(name)) else []

    def restart_node(self, name: str, timeout: float = 30.0, *, wait: bool = True) -> None:
        """Power a node back on (crashing what is left of it first) and, with `wait`, wait until Slurm uses it again
        (without: a drained node stays drained, and is not waited for)."""
        self.crash_node(name)
        self._start_node(name)
        if wait:
            self.wait_ready([name], timeout=timeout)

    def heal(self, timeout: float = 120.0) -> None:
        """Back to a clean cluster for the next test: no jobs, every node running and idle. Asked again every 2 s until
        then: jobs are cancelled, nodes without a live (or with a frozen) slurmd restarted, nodes Slurm holds down or
        drained resumed (a node drains late, e.g. when a killed job's processes outlive UnkillableStepTimeout), and a
        node still not idle after 30 s restarted and set DOWN, which ends a job Slurm still sees completing on it
        (a crashed node's slurmd, restarted before slurmctld marked it, knows nothing of that job). What it saw is
        logged."""
        runner = self.runner(timeout=15)
        started, forced, seen = time.monotonic(), set(), None
        while time.monotonic() < started + timeout:
            jobs = runner.run(["squeue", "--noheader", "--format=%i"], check=False).stdout.split()
            if jobs:
                runner.run(["scancel", *jobs], check=False)
            for name in self.node_names:
                group = self.groups.get(name)
                if group is None or not procs.alive(group.pid, group.start_time) or procs.stopped(group.pid):
                    self.restart_node(name, timeout=timeout, wait=False)  # a frozen node too (freeze_node)
            try:
                states = self.node_states()
            except SlurmError:
                states = {}
            if (states, jobs) != seen:
                seen = (states, jobs)
                _log.info("heal at +%.1f s: jobs %s, nodes %s", time.monotonic() - started, jobs, states)
            if states and all(states.get(n) == "idle" for n in self.node_names):
                return
            held = [n for n, s in states.items() if s.rstrip("*~#").startswith(("down", "drain", "fail"))]
            if held:
                runner.run(["scontrol", "update", f"NodeName={','.join(held)}", "State=RESUME"], check=False)
            stuck = [n for n in self.node_names if states.get(n) != "idle" and n not in forced]
            if stuck and time.monotonic() > started + 30:
                forced.update(stuck)
                _log.warning("heal: nodes %s not idle after 30 s (%s): restarted and set DOWN", stuck, states)
                for name in stuck:
                    self.restart_node(name, timeout=timeout, wait=False)
                runner.run(["scontrol", "update", f"NodeName={','.join(stuck)}", "State=DOWN",
                            "Reason=sandbox heal"], check=False)
            time.sleep(2)
        self.wait_for(self.node_names, lambda s: s == "idle", "idle", 0)  # the error, with Slurm's view and the logs

    # -- stop --------------------------------------------------------------------------------------
    def down(self) -> None:
        """Stop only what this sandbox started (recorded groups, created namespaces); keep the logs. Every daemon is
        SIGKILLed: the next `up` starts from empty state."""
        errors = []
        for key in ["slurmctld", *self.node_names, "slurmdbd", "mariadbd", "munged"]:
            group = self.groups.get(key)
            if group is None:
                continue
            try:
                procs.kill(group, signal.SIGKILL)
                self.groups[key] = None
            except SandboxError as exc:
                errors.append(f"{key}: {exc}")
        try:
            netns.delete(self.created_netns)
            self.created_netns = []
        except SandboxError as exc:
            errors.append(str(exc))
        try:
            confine.remove([Path(d) for d in self.created_cgroups])
            self.created_cgroups = []
        except SandboxError as exc:
            errors.append(str(exc))
        if errors:
            self._save()
            raise SandboxError("sandbox stopped incompletely: " + "; ".join(errors))
        (self.dir / STATE_FILE).unlink(missing_ok=True)


def ensure_up(config: SandboxConfig, timeout: float = 30.0) -> tuple[Sandbox, bool]:
    """The sandbox in config.dir, started if it is not running; True in second place if we started it. One already
    running there is returned as it is (whatever `config` says); one recorded but dead is cleaned up first."""
    if (config.dir / STATE_FILE).exists():
        recorded = Sandbox.load(config.dir)
        if recorded.is_up():
            return recorded, False
        _log.info("sandbox in %s left from an earlier run; cleaning it up first", config.dir)
        recorded.down()
    sandbox = Sandbox(plan(config))
    sandbox.up(timeout=timeout)
    return sandbox, True
