"""The sandbox's accounting, as a real cluster keeps it: its own MariaDB server and slurmdbd. Without one slurmctld
refuses every update of a job it has resized (its accounting record is never rewritten before the job ends)."""
import shutil
import subprocess
from pathlib import Path

from hpcft.errors import SandboxError

# A few MB of buffers and logs, not the server defaults' hundreds: the database holds a few hundred test jobs
_SMALL = ["--innodb-buffer-pool-size=32M", "--innodb-log-file-size=8M", "--skip-name-resolve"]


def prepare(db_dir: Path) -> None:
    """An empty MariaDB data directory in `db_dir` (wiped first: the sandbox starts from empty state)."""
    shutil.rmtree(db_dir, ignore_errors=True)
    db_dir.mkdir(parents=True)
    proc = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={db_dir / 'data'}", "--user=root",
                           "--skip-test-db", "--auth-root-authentication-method=normal", *_SMALL],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SandboxError(f"mariadb-install-db failed in {db_dir}: {(proc.stderr or proc.stdout).strip()[-2000:]}")


def mariadbd_argv(db_dir: Path, port: int) -> list[str]:
    """MariaDB in the foreground on 127.0.0.1:`port` (the controller's namespace), socket and logs in `db_dir`."""
    return ["mariadbd", "--no-defaults", f"--datadir={db_dir / 'data'}", "--user=root", f"--port={port}",
            "--bind-address=127.0.0.1", f"--socket={socket(db_dir)}", f"--pid-file={db_dir / 'mariadbd.pid'}",
            f"--log-error={db_dir / 'mariadbd.log'}", *_SMALL]


def socket(db_dir: Path) -> Path:
    """MariaDB's socket: it appears once the server takes connections."""
    return db_dir / "mariadbd.sock"


def slurmdbd_argv(slurm_conf: Path) -> list[str]:
    """slurmdbd in the foreground; it reads slurmdbd.conf from slurm.conf's directory (SLURM_CONF)."""
    return ["env", f"SLURM_CONF={slurm_conf}", "slurmdbd", "-D"]
