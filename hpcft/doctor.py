"""`hpcft doctor`: what this node offers hpcft, and whether it is usable. Read-only."""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

import click

from hpcft.env import in_allocation, job_env


@dataclass
class Check:
    """One finding: `ok` False on an essential check makes doctor exit non-zero."""

    name: str
    ok: bool
    detail: str
    essential: bool = False


def _slurm() -> list[Check]:
    srun = shutil.which("srun")
    if not srun:
        return [Check("slurm", False, "srun not on PATH: install slurm-client or `module load slurm`", True)]
    try:
        proc = subprocess.run(["srun", "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [Check("slurm", False, f"srun --version failed: {exc}", True)]
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
        return [Check("slurm", False, f"srun is installed but unusable ({last}); check the Slurm configuration ({conf})", True)]
    checks = [Check("slurm", True, proc.stdout.strip(), True)]
    if in_allocation():
        env = job_env()
        checks.append(Check("allocation", True, f"job {env.job_id}, nodes {_allocated_nodes(env.job_id)}, "
                                                f"this node {env.node_name}"))
    else:
        checks.append(Check("allocation", True, "none (not inside a Slurm job; `hpcft run` needs one)"))
    return checks


def _allocated_nodes(job_id: str) -> str:
    """The job's nodes as slurmctld sees them (inside a step, SLURM_JOB_NODELIST may name the step's only)."""
    from hpcft.errors import SlurmError
    from hpcft.slurm.state import job_info
    from hpcft.slurm.nodelist import compress
    from hpcft.slurm.runner import Runner

    try:
        nodes = job_info(Runner(timeout=10), job_id).nodes
    except SlurmError:
        nodes = []
    if not nodes:
        return os.environ.get("SLURM_JOB_NODELIST", "?") + " (from the environment)"
    return f"{compress(nodes)} ({len(nodes)})"


def _torch() -> list[Check]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return [Check("torch", False, f"cannot import torch ({exc}): pip install torch, or load your site's module", True)]
    checks = [Check("torch", True, f"{torch.__version__} at {os.path.dirname(torch.__file__)}", True)]
    hip, cuda = getattr(torch.version, "hip", None), torch.version.cuda
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if hip:
        checks.append(Check("device", gpus > 0, f"ROCm/HIP {hip}, {gpus} visible GPU(s)" + ("" if gpus else ": none visible, check --gpus / ROCR_VISIBLE_DEVICES")))
    elif cuda:
        checks.append(Check("device", gpus > 0, f"CUDA {cuda}, {gpus} visible GPU(s)" + ("" if gpus else ": none visible")))
    else:
        checks.append(Check("device", True, "CPU build of torch: gloo process groups, CPU snapshot copier"))
    nccl = dist.is_available() and dist.is_nccl_available()
    if nccl:
        try:
            ver = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # a build with NCCL but no driver: still worth reporting
            ver = f"version unknown ({exc})"
        checks.append(Check("rccl" if hip else "nccl", True, ver))
    else:
        checks.append(Check("nccl/rccl", True, "not built into this torch (gloo only)"))
    checks.append(Check("gloo", dist.is_available() and dist.is_gloo_available(), "torch.distributed gloo backend", True))
    return checks


def _optional() -> list[Check]:
    checks = []
    try:
        import crc32c

        hw = "hardware" if getattr(crc32c, "hardware_based", False) else "software"
        checks.append(Check("crc32c", True, f"{crc32c.__version__}, {hw}", True))
    except ImportError:
        checks.append(Check("crc32c", False, "pip install crc32c (chunk checksums)", True))
    from hpcft.snapshot import ntcopy

    built, detail = ntcopy.probe()
    checks.append(Check("copy kernel", built, detail if built else f"not built: {detail}"))
    try:
        from hip import hip  # noqa: F401
        import hip as hip_pkg

        checks.append(Check("hip-python", True, getattr(hip_pkg, "__version__", "installed")))
    except ImportError:
        checks.append(Check("hip-python", True, "not installed (torch-stream copier is used; `pip install hpcft[rocm]` for hipMemcpyAsync)"))
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        vendor = MPI.Get_library_version().splitlines()[0].split(",")[0]
        checks.append(Check("mpi4py", True, f"{mpi4py.__version__}, {vendor}"))
    except ImportError:
        checks.append(Check("mpi4py", True, "not installed (agents use TCP; `pip install hpcft[mpi]` for MPI)"))
    except Exception as exc:
        checks.append(Check("mpi4py", False, f"installed but unusable: {exc}"))
    return checks


def _storage() -> list[Check]:
    checks = []
    root = os.environ.get("HPCFT_STORE_ROOT", "/dev/shm")
    if not os.path.isdir(root):
        checks.append(Check("store", False, f"{root} does not exist: set HPCFT_STORE_ROOT to a node-local memory or NVMe path", True))
    else:
        st = os.statvfs(root)
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        writable = os.access(root, os.W_OK)
        detail = f"{root}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB" + ("" if writable else ", not writable")
        checks.append(Check("store", writable and free > 0, detail, True))
    nvme = [p for p in (os.environ.get("HPCFT_NVME"), f"/mnt/bb/{os.environ.get('USER', '')}", "/local/scratch") if p and os.path.isdir(p)]
    checks.append(Check("nvme", True, nvme[0] if nvme else "no node-local NVMe found (Frontier: sbatch -C nvme gives /mnt/bb/$USER)"))
    return checks


def run_checks() -> list[Check]:
    """Every check, in the order shown to people."""
    return _slurm() + _torch() + _optional() + _storage()


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def doctor(as_json: bool) -> None:
    """Report Slurm, torch device backend, RCCL/NCCL, the copy kernel, hip-python, mpi4py, /dev/shm and NVMe; exit 1 if an essential is missing."""
    checks = run_checks()
    failed = [c for c in checks if c.essential and not c.ok]
    if as_json:
        click.echo(json.dumps({"ok": not failed, "python": sys.version.split()[0], "checks": [asdict(c) for c in checks]}))
    else:
        for c in checks:
            mark = "ok" if c.ok else ("MISSING" if c.essential else "warn")
            click.echo(f"{mark:8} {c.name:12} {c.detail}")
        click.echo("hpcft doctor: " + ("all essentials present" if not failed else "missing: " + ", ".join(c.name for c in failed)))
    if failed:
        raise click.exceptions.Exit(1)
