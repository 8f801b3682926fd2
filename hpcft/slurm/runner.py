"""The one seam through which every Slurm command (srun, sbatch, scontrol, squeue, scancel, sinfo) runs."""
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from hpcft.errors import SlurmError

_log = logging.getLogger(__name__)
_PACKAGES = {**dict.fromkeys(("srun", "sbatch", "scontrol", "squeue", "scancel", "sinfo"), "slurm-client"),
             "slurmd": "slurmd", "slurmctld": "slurmctld"}


class Runner:
    """Runs Slurm commands with an optional prefix (e.g. nsenter into a sandbox) and extra environment."""

    def __init__(self, prefix: Sequence[str] = (), env: Mapping[str, str] | None = None, timeout: float | None = 60.0):
        self.prefix = list(prefix)
        self.env = dict(env or {})
        self.timeout = timeout

    def argv(self, argv: Sequence[str]) -> list[str]:
        """The full command line: prefix + argv."""
        return self.prefix + [str(a) for a in argv]

    def environ(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The process environment for a command: ours, then the runner's, then the call's."""
        return {**os.environ, **self.env, **(env or {})}

    def _check_binary(self, argv: Sequence[str]) -> None:
        name = str(argv[0])
        if os.sep not in name and shutil.which(name, path=self.environ().get("PATH")) is None:
            package = _PACKAGES.get(name, "slurm-wlm")
            raise SlurmError(f"'{name}' not found on PATH; install Debian's {package} or `module load slurm`")

    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float | None = None, input: str | None = None,
            env: Mapping[str, str] | None = None) -> "subprocess.CompletedProcess[str]":
        """Run to completion and capture output; with check, a non-zero exit raises SlurmError with stderr."""
        self._check_binary(argv)
        full = self.argv(argv)
        limit = self.timeout if timeout is None else timeout
        _log.debug("run %s", full)
        try:
            proc = subprocess.run(full, input=input, capture_output=True, text=True, timeout=limit,
                                  env=self.environ(env))
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"'{' '.join(map(str, argv))}' did not finish within {limit:g} s") from exc
        if check and proc.returncode != 0:
            raise SlurmError(f"'{' '.join(map(str, argv))}' failed with exit status {proc.returncode}: "
                             f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        return proc

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start a long-running command (an srun step) and return at once."""
        self._check_binary(argv)
        full = self.argv(argv)
        _log.debug("popen %s", full)
        return subprocess.Popen(full, env=self.environ(env), **kwargs)


def default_runner() -> Runner:
    """A runner for the current environment (SLURM_CONF and PATH as inherited)."""
    return Runner()
