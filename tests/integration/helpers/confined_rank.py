"""A rank of a confined sandbox's job (`hpcft run -- python confined_rank.py`): writes $OUT/rank.$RANK.json with what
it is confined to (its cgroups, CPU affinity, how each fake GPU in $GPU_DIR opens) and the same for the process srun
placed in its step (the task wrapper, found in its freezer cgroup), then waits for $OUT/go if $WAIT_GO is set (so
that a test can crash a node under it) and exits."""
import errno
import json
import os
import sys
import time
from pathlib import Path


def opens(gpu_dir: Path) -> dict[str, str]:
    """{device: "ok" or the errno name of open()}: ENXIO (no driver) is a device the cgroup lets through."""
    found = {}
    for path in sorted(gpu_dir.glob("gpu*")):
        try:
            os.close(os.open(path, os.O_RDWR))
            found[path.name] = "ok"
        except OSError as exc:
            found[path.name] = errno.errorcode[exc.errno]
    return found


def confinement(pid: int | str) -> dict:
    return {"cgroup": Path(f"/proc/{pid}/cgroup").read_text(), "affinity": sorted(os.sched_getaffinity(
        0 if pid == "self" else int(pid)))}


def wrapper() -> dict | None:
    """The task wrapper srun started for this rank: the process of this rank's freezer (step) cgroup that runs
    hpcft.launch.node.task as this rank's task (SLURM_LOCALID); None if there is none (a rank exec'd in its place)."""
    freezer = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.split(":")[1] == "freezer")
    task = f"SLURM_LOCALID={os.environ['SLURM_LOCALID']}".encode()
    for pid in Path(f"/sys/fs/cgroup/freezer{freezer}/cgroup.procs").read_text().split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(pid) != os.getpid() and b"hpcft.launch.node.task" in cmdline and task in environ:
            return {"pid": int(pid), **confinement(pid)}
    return None


def main() -> None:
    out = Path(os.environ["OUT"])
    report = {"pid": os.getpid(), "node": os.environ.get("SLURMD_NODENAME"), **confinement("self"),
              "opens": opens(Path(os.environ["GPU_DIR"])), "wrapper": wrapper()}
    rank = os.environ["RANK"]
    tmp = out / f"rank.{rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.replace(out / f"rank.{rank}.json")  # whole, for the test polling for it
    while os.environ.get("WAIT_GO") and not (out / "go").exists():
        time.sleep(0.05)
    sys.exit(0)


if __name__ == "__main__":
    main()
