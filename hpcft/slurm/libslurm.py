"""The one call hpcft makes into libslurm rather than a command: ending a batch job whose batch script is gone (its
node was lost) with the status `hpcft run` ended with, as the script's exit would have (slurm_complete_job, the RPC
salloc sends; slurmctld allows it to the job's owner). No command does it: scancel says CANCELLED. The call runs in
a child process: libslurm exits the process on a fatal error, and its plugins need its symbols global."""
from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

# Debian's slurm-client links its commands against a private libslurmfull; libslurm38 installs the public library
_FALLBACKS = ("/usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so", "/usr/lib64/slurm/libslurmfull.so",
              "/usr/lib/slurm/libslurmfull.so")
NO_LIBRARY = 3  # the child's exit status when no libslurm loads


def _library() -> ctypes.CDLL | None:
    for name in (ctypes.util.find_library("slurm"), "libslurm.so", *_FALLBACKS):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            lib.slurm_complete_job.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
            lib.slurm_complete_job.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def complete_job(job_id: str, exit_code: int, timeout: float = 30.0) -> str | None:
    """End job `job_id` as its batch script ending with `exit_code` would (COMPLETED for 0, FAILED otherwise); None
    when done, else why not (no libslurm here, slurmctld's refusal, a timeout)."""
    try:
        done = subprocess.run([sys.executable, "-m", __name__, str(job_id), str(exit_code)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"slurm_complete_job did not return within {timeout:g} s"
    if done.returncode == 0:
        return None
    if done.returncode == NO_LIBRARY:
        return "no libslurm on this node (Debian: apt install libslurm38)"
    return f"slurm_complete_job: {(done.stderr.strip() or f'exit status {done.returncode}')[-300:]}"


def main(argv: list[str]) -> int:
    job_id, exit_code = int(argv[0]), int(argv[1])
    lib = _library()
    if lib is None:
        return NO_LIBRARY
    if hasattr(lib, "slurm_init"):
        lib.slurm_init.argtypes = [ctypes.c_char_p]
        lib.slurm_init(None)  # reads slurm.conf as the commands do ($SLURM_CONF)
    # a wait status, as slurmd reports a script's: the exit code in the high byte
    if lib.slurm_complete_job(job_id, (exit_code & 0xFF) << 8) == 0:
        return 0
    lib.slurm_get_errno.restype = ctypes.c_int
    lib.slurm_strerror.restype = ctypes.c_char_p
    print(lib.slurm_strerror(lib.slurm_get_errno()).decode(errors="replace"), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
