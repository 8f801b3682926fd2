"""The sandbox's own munged: its own key, socket, pid and log, so it never touches a system munged."""
import os
import pwd
from pathlib import Path

from hpcft.errors import SandboxError

USER = "munge"


def prepare(munge_dir: Path) -> None:
    """A fresh key (0600) in a directory munged accepts: owned by the munge user, traversable by all."""
    try:
        user = pwd.getpwnam(USER)
    except KeyError as exc:
        raise SandboxError("user 'munge' does not exist: install Debian's munge package (apt-get install munge)") \
            from exc
    munge_dir.mkdir(parents=True, exist_ok=True)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    for path in (munge_dir, *munge_dir.iterdir()):
        os.chown(path, user.pw_uid, user.pw_gid)
    key.chmod(0o600)
    munge_dir.chmod(0o755)


def argv(munge_dir: Path) -> list[str]:
    """munged in the foreground as the munge user (munged refuses root); setpriv keeps the pid."""
    return ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--init-groups", "/usr/sbin/munged", "--foreground",
            f"--socket={munge_dir / 'munge.socket'}", f"--key-file={munge_dir / 'munge.key'}",
            f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
            f"--seed-file={munge_dir / 'munged.seed'}"]
