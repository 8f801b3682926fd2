"""Whether this machine can run a sandbox: root, the Slurm and munge binaries, namespaces, free ports."""
import os
import shutil
import socket
import subprocess

from hpcft.errors import SandboxError

_NEEDED = {
    "slurmctld": "slurmctld", "slurmd": "slurmd", "sinfo": "slurm-client", "srun": "slurm-client",
    "/usr/sbin/munged": "munge", "nsenter": "util-linux", "unshare": "util-linux", "setpriv": "util-linux",
}


_ACCOUNTING = {"slurmdbd": "slurmdbd", "sacctmgr": "slurm-client", "mariadbd": "mariadb-server",
               "mariadb-install-db": "mariadb-server"}


def unavailable_reason(mode: str = "netns") -> str | None:
    """Why this machine cannot run a sandbox in `mode` (not root, packages missing, no namespaces), or None."""
    try:
        check_machine(mode)
    except SandboxError as exc:
        return str(exc)
    return None


def check_machine(mode: str, accounting: bool = True) -> None:
    """Raise SandboxError naming the missing privilege or binary that `mode` (and `accounting`) needs."""
    if os.geteuid() != 0:
        raise SandboxError("the sandbox needs root (namespaces, mounts, munged as user munge): run it as root")
    needed = dict(_NEEDED, **({"ip": "iproute2"} if mode == "netns" else {}), **(_ACCOUNTING if accounting else {}))
    missing = [f"{b} ({pkg})" for b, pkg in needed.items() if shutil.which(b) is None]
    if missing:
        raise SandboxError(f"missing for the sandbox: {', '.join(missing)}; run `make debs` or apt-get install them")
    flags = ["--mount"] + (["--net", "--uts"] if mode == "netns" else [])
    probe = subprocess.run(["unshare", *flags, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        hint = "; try --mode local" if mode == "netns" else ""
        raise SandboxError(f"cannot create namespaces (`unshare {' '.join(flags)}`: {probe.stderr.strip()}){hint}")


def port_free(port: int) -> bool:
    """True if a TCP listener could bind `port` on all addresses (what slurmd and slurmctld do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
