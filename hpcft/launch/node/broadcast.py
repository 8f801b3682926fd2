"""`python -m hpcft.launch.node.broadcast`, a task per node of the `--broadcast-env` step: says it is ready (or that
another node's probe shows: no node-local root), waits for SIGUSR1 (sbcast is over), unpacks checking size and
crc32c, relinks a broadcast base interpreter, checks the copy imports torch from itself, marks it ok; each outcome
is a JSON line."""
from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpcft.launch.node import broadcast_paths as paths
from hpcft.store.checksum import crc32c

VERIFY_TIMEOUT_S = 300.0  # the copy's first `import torch` (no .pyc written yet for some modules) under load
# The copy's interpreter reports what it runs from and which of its loaded files are outside the copy; the
# modules of $HPCFT_BROADCAST_VERIFY (torch) must be inside it
PROBE = r"""
import json, os, sys
mods = [m for m in os.environ.get("HPCFT_BROADCAST_VERIFY", "torch").split(",") if m]
for m in mods:
    __import__(m)
import hpcft.launch.node.task  # what every step starts with: it must import, from the copy or an editable source tree
root = sys.argv[1]
files = {getattr(m, "__file__", None) for m in list(sys.modules.values())}
with open("/proc/self/maps") as f:
    files |= {line.split()[-1] for line in f if "/" in line and ".so" in line}
out = sorted({os.path.dirname(p) for p in files if p and p.startswith("/") and not p.startswith(root + "/")})
print(json.dumps({"executable": sys.executable, "files": {m: getattr(sys.modules[m], "__file__", "") for m in mods},
                  "outside": out}))
"""


CHUNK = 1 << 20


def unpack(archive: Path, node: Path, size: int, crc: int) -> None:
    """Unpack `archive` into `node` (emptied first), checking that it is whole and unchanged (OSError if not). GNU
    tar writes the files (5x Python's tarfile on a venv of 25,000 files); the bytes pass through here for the crc."""
    got = archive.stat().st_size
    if got != size:
        raise OSError(f"the archive {archive} did not arrive whole ({got} of {size} bytes)")
    shutil.rmtree(node, ignore_errors=True)
    node.mkdir(mode=0o700, parents=True)
    seen = 0
    tar = subprocess.Popen(["tar", "--extract", "--file=-", f"--directory={node}"], stdin=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        with open(archive, "rb") as f:
            while chunk := f.read(CHUNK):
                seen = crc32c(chunk, seen)
                tar.stdin.write(chunk)
    except BrokenPipeError:
        pass
    finally:
        tar.stdin.close()
        error = tar.stderr.read().decode(errors="replace").strip()
        tar.wait()
    if tar.returncode != 0:
        raise OSError(f"tar could not unpack {archive} (exit {tar.returncode}): {error[-300:]}")
    if seen != crc:
        raise OSError(f"the archive {archive} is damaged (crc32c {seen:08x}, sent {crc:08x})")


def collapse(dirs: list[str]) -> list[str]:
    """`dirs` without those inside another one of them (pure)."""
    kept: list[str] = []
    for d in sorted(set(dirs)):
        if not any(d == k or d.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(d)
    return kept


def relink_base(node: Path, base_from: str) -> None:
    """A venv whose base interpreter was broadcast too (base/): its pyvenv.cfg and its bin/ links name the copy."""
    env, base = node / "env", node / "base"
    cfg = env / "pyvenv.cfg"
    old = base_from.rstrip("/")
    cfg.write_text("".join(line.replace(old, str(base)) if line.split("=")[0].strip() in ("home", "executable")
                           else line for line in cfg.read_text().splitlines(keepends=True)))
    for link in (env / "bin").iterdir():
        if link.is_symlink() and os.readlink(link).startswith(old + "/"):
            target = str(base) + os.readlink(link)[len(old):]
            link.unlink()
            link.symlink_to(target)


def verify(python: Path, node: Path, timeout: float = VERIFY_TIMEOUT_S) -> dict:
    """Run the probe in the copy's interpreter: its report, or RuntimeError saying what is not from the copy."""
    done = subprocess.run([str(python), "-c", PROBE, str(node)], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the copy's interpreter failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    foreign = [f for f in [report["executable"], *report["files"].values()] if not f.startswith(str(node) + "/")]
    if foreign:
        raise RuntimeError(f"the copy's interpreter runs {', '.join(foreign)} from outside {node}")
    return report


def _others(probe: Path) -> list[str]:
    """The nodes whose probe for this job is beside `probe` (none where the directory is node-local)."""
    mine = probe.name.rsplit(".node-", 1)[0] + ".node-"
    return sorted(p.name[len(mine):] for p in probe.parent.glob(mine + "*") if p != probe)


def _say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcft.launch.node.broadcast", description=__doc__)
    ap.add_argument("--root", required=True, help="the node-local directory (the same path on every node)")
    ap.add_argument("--job", required=True)
    ap.add_argument("--key", required=True, help="the archive's content key")
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--crc", type=int, required=True)
    ap.add_argument("--python", required=True, help="the interpreter's path under the environment's prefix")
    ap.add_argument("--base-from", default=None, help="the venv's base prefix, when base/ is broadcast too")
    ap.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the supervisor's go (SIGUSR1)")
    args = ap.parse_args(argv)
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    root, user = Path(args.root), getpass.getuser()
    node, archive = paths.node_dir(root, user, args.job), paths.archive_dest(root, user, args.job)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = paths.probe_name(root, user, args.job, name)
        probe.touch()  # kept (the janitors remove it): every node that shares the root sees it until the end
        others = _others(probe)
    except OSError as exc:
        _say(node=name, phase="failed", error=f"{root} is not usable: {exc}")
        return 0
    present = paths.ok_marker(node, args.key).exists()  # a node back in the run with its copy: never replaced
    _say(node=name, phase="ready", shared_with=others, present=present)
    if signal.sigtimedwait({signal.SIGUSR1}, args.wait) is None:
        _say(node=name, phase="failed", error=f"no go from hpcft run within {args.wait:g} s")
        return 0
    started = time.monotonic()
    others = _others(probe)  # every task said ready after its probe was made: now each sharing node sees all others
    if others:
        _say(node=name, phase="failed", error=f"{root} is shared with {', '.join(others)}: not node-local")
        return 0
    if present:
        archive.unlink(missing_ok=True)  # sent to the step's every node
        _say(node=name, phase="done", unpack_s=0.0, verify_s=0.0, present=True, outside=[],
             python=str(paths.broadcast_python(node, args.python)))
        return 0
    try:
        unpack(archive, node, args.bytes, args.crc)
        archive.unlink()
        if args.base_from and (node / "base").is_dir():
            relink_base(node, args.base_from)
        unpacked = time.monotonic() - started
        report = verify(paths.broadcast_python(node, args.python), node)
        paths.ok_marker(node, args.key).touch()
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(node, ignore_errors=True)
        archive.unlink(missing_ok=True)
        _say(node=name, phase="failed", error=f"{type(exc).__name__}: {exc}")
        return 0
    _say(node=name, phase="done", unpack_s=round(unpacked, 3), verify_s=round(time.monotonic() - started - unpacked, 3),
         python=report["executable"], outside=collapse(report["outside"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
