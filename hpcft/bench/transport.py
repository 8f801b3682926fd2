"""`hpcft bench transport`: the agents' two transports side by side on this machine. Four "nodes" (store roots, two
ranks each, `state_bytes` per node) and four real agents, uncapped (cpu_share 0, nice 0): TCP as four processes,
MPI as the four ranks of one mpirun (Open MPI over TCP: loopback here). Per scheme and transport, the median over
`repeats` launches of the slowest agent's protect pass and of the rebuild of one lost node onto an empty spare."""
from __future__ import annotations

import os
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcft import events
from hpcft.agent.transport import secret as job_secret
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.settings import AgentConfig
from hpcft.bench.harness import Report, scratch
from hpcft.bench.protect import JOB, NODES, SCHEMES, _commit
from hpcft.errors import ConfigError, HpcftError
from hpcft.sandbox.config import OPEN_MPI_TCP_ENV


@dataclass(frozen=True)
class TransportOptions:
    state_bytes: int
    repeats: int = 3
    schemes: tuple[str, ...] = ()
    transports: tuple[str, ...] = ("tcp", "mpi")
    root: str | None = None


def mpirun_argv(tasks: Sequence[tuple[Sequence[str], Mapping[str, str]]], logs: Path) -> list[str]:
    """One mpirun of `tasks` (argv, extra environment), rank i the i-th; task i's output and exit status go to
    `logs`/i.out, i.err, i.rc (mpirun's own exit says little: it kills the rest when one exits without MPI_Finalize)."""
    if shutil.which("mpirun") is None:
        raise ConfigError("no mpirun on this machine: install an MPI (e.g. Debian's openmpi-bin) for the MPI transport")
    argv = ["mpirun", "-q", "--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    for i, (task, env) in enumerate(tasks):
        argv += [":"] * (i > 0) + ["-n", "1"] + [a for k, v in env.items() for a in ("-x", f"{k}={v}")] + [
            "sh", "-c", f"{shlex.join(task)} >{logs}/{i}.out 2>{logs}/{i}.err; echo $? >{logs}/{i}.rc"]
    return argv


def _agents(roots: list[Path], shared: Path, scheme: Scheme, tag: str, transport: str, *extra: str) -> None:
    """Run the agents of `roots` once (one protect round, or a rebuild); HpcftError naming the failures."""
    settings = AgentConfig(str(shared), secret_file=str(shared / "secret"), scheme=scheme, cpu_share=0, nice=0,
                           transport=transport).to_json()
    tasks = [([sys.executable, "-m", "hpcft.agent", "--settings", settings, "--job-id", JOB, "--slot", str(i),
               "--slots", str(NODES), "--tag", tag, *extra],
              {"HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(shared / "events")})
             for i, root in enumerate(roots)]
    logs = shared / f"logs-{tag}"
    logs.mkdir()
    if transport == "mpi":
        tasks = tasks[::-1]  # the slots against the ranks' order, as srun may give them
        subprocess.run(mpirun_argv(tasks, logs), env={**os.environ, **OPEN_MPI_TCP_ENV}, capture_output=True,
                       timeout=900)
    else:
        procs = [subprocess.Popen(t, env={**os.environ, **e}, stdout=open(logs / f"{i}.out", "w"),
                                  stderr=open(logs / f"{i}.err", "w")) for i, (t, e) in enumerate(tasks)]
        for i, p in enumerate(procs):
            (logs / f"{i}.rc").write_text(str(p.wait(timeout=900)))
    bad = [(logs / f"{i}.err").read_text()[-1500:] for i in range(NODES)
           if not (logs / f"{i}.rc").exists() or (logs / f"{i}.rc").read_text().strip() != "0"]
    if bad:
        raise HpcftError(f"{transport} agents ({tag}) failed:\n" + "\n".join(bad))


def _once(opts: TransportOptions, scheme: Scheme, transport: str, base: Path) -> tuple[float, float]:
    """(slowest agent's protect pass, the lost node's rebuild) in seconds, from the agents' events."""
    roots = [base / f"node{i}" for i in range(NODES)]
    shared = base / "shared"
    rng = np.random.default_rng(0)
    for i, root in enumerate(roots):
        root.mkdir()
        for r in range(2):
            _commit(root, 2 * i + r, 1, rng.integers(0, 256, opts.state_bytes // 2, dtype=np.uint8))
    shared.mkdir(mode=0o700)
    job_secret.create(shared)
    _agents(roots, shared, scheme, "p", transport)
    spare = base / "spare1"
    spare.mkdir()
    _agents([roots[0], spare, *roots[2:]], shared, scheme, "r", transport, "--rebuild")
    seen = events.read(shared / "events")
    passes = [e["seconds"] for e in seen if e["event"] == "snapshot_protected"]
    rebuilt = [e["seconds"] for e in seen if e["event"] == "rebuild_done" and e.get("here")]
    return max(passes), rebuilt[0]


def run(opts: TransportOptions) -> Report:
    """Every scheme over every transport; medians of `repeats` launches."""
    report = Report("transport")
    out = []
    for scheme in [x for x in SCHEMES if not opts.schemes or x.name in opts.schemes]:
        for transport in opts.transports:
            got = []
            for _ in range(opts.repeats):
                with scratch(opts.root) as where:
                    got.append(_once(opts, scheme, transport, where.shm))
            protect_s, rebuild_s = (statistics.median(g[k] for g in got) for k in (0, 1))
            s, what = f"{scheme.name}_{transport}", f"{scheme.name} over {transport}"
            report.add(f"{s}_protect_s", protect_s, "s", f"{what}: protect pass (slowest agent)")
            report.add(f"{s}_protect_gbps", opts.state_bytes / 1e9 / protect_s, "GB/s",
                       f"{what}: state per node over that pass")
            report.add(f"{s}_rebuild_s", rebuild_s, "s", f"{what}: rebuild of one node")
            out.append({"scheme": scheme.name, "transport": transport, "protect_s": protect_s, "rebuild_s": rebuild_s,
                        "runs": [list(g) for g in got]})
    report.note("runs", out)
    report.note("config", {"nodes": NODES, "ranks_per_node": 2, "state_bytes_per_node": opts.state_bytes,
                           "repeats": opts.repeats, "agents_capped": False, "mpi_env": OPEN_MPI_TCP_ENV})
    return report
