"""`hpcft doctor`: what this node offers hpcft, and whether it is usable. Read-only."""
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import click

from hpcft import deps
from hpcft.env import NVME_ENV, in_allocation, job_env, nvme_dir
from hpcft.errors import MissingDependencyError

if TYPE_CHECKING:
    from hpcft.launch.config.detect import Devices


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
        return [Check("torch", False, f"cannot import torch ({exc}): {deps.hint('torch')}", True)]
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
        checks.append(Check("crc32c", False, f"not installed (chunk checksums): {deps.hint('crc32c')}", True))
    try:
        import zfec

        checks.append(Check("zfec", True, zfec.__version__, True))
    except ImportError:
        checks.append(Check("zfec", False, f"not installed (Reed-Solomon protection): {deps.hint('zfec')}", True))
    checks += [_guarded("copy kernel", _copy_kernel), _guarded("copy method", _copy_method),
               _guarded("snapshot checksums", _checksums)]
    try:
        from hip import hip  # noqa: F401
        import hip as hip_pkg

        checks.append(Check("hip-python", True, getattr(hip_pkg, "__version__", "installed")))
    except ImportError:
        checks.append(Check("hip-python", True, "not installed: the torch-stream copier is used; for "
                            f"hipMemcpyAsync, {deps.hint('hip')}"))
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        vendor = MPI.Get_library_version().splitlines()[0].split(",")[0]
        checks.append(Check("mpi4py", True, f"{mpi4py.__version__}, {vendor}"))
    except ImportError:
        checks.append(Check("mpi4py", True, f"not installed: agents use TCP; for MPI, {deps.hint('mpi4py')}"))
    except Exception as exc:
        checks.append(Check("mpi4py", False, f"installed but unusable: {exc}"))
    return checks


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    """`check()`, or a warning naming the module it lacks: a missing dependency is a finding, never a traceback."""
    try:
        return check()
    except (ImportError, MissingDependencyError) as exc:
        return Check(name, False, f"unavailable: {exc}")


def _copy_kernel() -> Check:
    from hpcft.store import ntcopy

    built, detail = ntcopy.probe()
    return Check("copy kernel", built, detail if built else f"not built: {detail}")


def _checksums() -> Check:
    """Where a GPU snapshot's chunk checksums are computed: by the device before the copy (hpcft.snapshot.devcrc,
    where Triton imports) or by host threads as chunks land (several times slower than an H200's copy)."""
    import torch

    from hpcft.snapshot import devcrc

    if not torch.cuda.is_available():
        return Check("snapshot checksums", True, "on the host, in each chunk's copy (no GPU visible)")
    ok, why = devcrc.available(torch.device("cuda"))
    if ok:
        import triton

        return Check("snapshot checksums", True, f"on the GPU, before each copy (Triton {triton.__version__})")
    return Check("snapshot checksums", True, f"on the host as each chunk lands ({why}): slower than the device's copy")


def _copy_method() -> Check:
    """The CPU snapshot/restore copy method and where it comes from (HPCFT_COPY, this host's cached calibration, or
    not calibrated yet: doctor never measures, `hpcft calibrate` does)."""
    from hpcft.errors import ConfigError
    from hpcft.snapshot import calibration, copiers

    try:
        got = calibration.resolve(copiers.default_threads("cpu"), measure_now=False)
    except ConfigError as exc:
        return Check("copy method", False, str(exc), True)
    return Check("copy method", True, got.summary())


def _storage() -> list[Check]:
    from hpcft.store import hugepages

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
        checks.append(Check("store pages", *hugepages.describe(root)))
    job_nvme = nvme_dir()
    nvme = [p for p in (f"/mnt/bb/{os.environ.get('USER', '')}", "/local/scratch") if os.path.isdir(p)]
    checks.append(Check("nvme", True, f"{job_nvme} (${NVME_ENV})" if job_nvme else nvme[0] + f" (not exported: no ${NVME_ENV})"
                        if nvme else "no node-local NVMe found (Frontier: `hpcft submit --nvme` asks for /mnt/bb/$USER)"))
    return checks


def _rocm_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(getattr(torch.version, "hip", None))


def network_checks(profile: str | None, environ: Mapping[str, str] | None = None) -> list[Check]:
    """RCCL's network plugin where the profile needs one (Frontier; any ROCm build of torch when no profile is
    named): its absence is essential, since RCCL then falls back to TCP sockets between nodes without a word.
    Also libfabric's memory-registration monitor (memhooks can deadlock with the plugin) and the agents' interface."""
    from hpcft.agent.transport.iface import iface_address
    from hpcft.launch.config import netplugin
    from hpcft.launch.config import profiles

    env = os.environ if environ is None else environ
    prof = profiles.get(profile) if profile else None
    if not (prof.net_plugin if prof else _rocm_torch()):
        return [Check("rccl plugin", True, f"not needed ({f'profile {profile}' if prof else 'no ROCm build of torch'}; "
                                           "--profile frontier checks it)")]
    name = prof.name if prof else "frontier"
    state = netplugin.resolve(env)
    fix = netplugin.plugin_env(state, env)
    if state.active:
        checks = [Check("rccl plugin", True, state.summary(), True)]
    elif fix:
        checks = [Check("rccl plugin", True, f"{state.summary()}: `hpcft run --profile {name}` sets "
                        f"NCCL_NET_PLUGIN={fix['NCCL_NET_PLUGIN']}; outside it, export that yourself", True)]
    elif state.disabled:
        checks = [Check("rccl plugin", False, state.summary())]
    else:
        checks = [Check("rccl plugin", False, f"{state.summary()}: RCCL WILL FALL BACK TO TCP SOCKETS between nodes, "
                        "silently. `module load rccl-net-plugin`, or set NCCL_NET_PLUGIN to the plugin's "
                        f"librccl-net.so, or list its directory in ${netplugin.DIRS_ENV}", True)]
    monitor = env.get("FI_MR_CACHE_MONITOR", "")
    if monitor == "memhooks":
        checks.append(Check("fi monitor", False, "FI_MR_CACHE_MONITOR=memhooks can deadlock with the RCCL plugin "
                            "(OLCF): unset it (Frontier's default is kdreg2) or use userfaultfd", True))
    iface = prof.agent_iface if prof else "hsn0"
    addr = iface_address(iface) if iface else None
    checks.append(Check("agent iface", True, f"{iface} {addr}" if addr else
                        f"no interface {iface} here: agents fall back to the hostname's address (--agent-iface)"))
    return checks


def profile_check(profile: str | None, environ: Mapping[str, str] | None = None,
                  found: "Devices | None" = None) -> Check:
    """The profile `hpcft run` would take here (the one given, else detected as `hpcft run` detects it) and whether
    it fits this node's GPUs; a misfit is a warning here (doctor may run on a login node), an error in `hpcft run`."""
    from hpcft.errors import ConfigError
    from hpcft.launch.config.detect import check_fits, detect, devices

    found = devices() if found is None else found
    name, why = (profile, "--profile") if profile else detect(os.environ if environ is None else environ, found)
    try:
        check_fits(name, found)
    except ConfigError as exc:
        return Check("profile", False, f"{name} ({why}): {exc}")
    return Check("profile", True, f"{name} ({why}); this node: {found.said()}")


def run_checks(profile: str | None = None) -> list[Check]:
    """Every check, in the order shown to people."""
    return [profile_check(profile)] + _slurm() + _torch() + network_checks(profile) + _optional() + _storage()


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--profile", type=click.Choice(["frontier", "cuda", "cpu"]), default=None, envvar="HPCFT_PROFILE",
              help="Check what this profile needs (frontier: RCCL's network plugin); default: the one `hpcft run` "
                   "detects (its RCCL check by the torch build).")
def doctor(as_json: bool, profile: str | None) -> None:
    """Report Slurm, torch device backend, RCCL/NCCL and its network plugin, the copy kernel, hip-python, mpi4py, /dev/shm and NVMe; exit 1 if an essential is missing."""
    checks = run_checks(profile)
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
