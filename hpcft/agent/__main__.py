"""`python -m hpcft.agent`: run one node's agent (one srun task per node, or a local process).

The launch's settings come as one JSON object (--settings); under srun the job id, the slot (this node's place in
the settings' layout) and the address the other agents reach it at come from the node; locally pass them."""
import argparse
import logging
import os
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

from hpcft.agent.transport import iface, secret as job_secret
from hpcft.agent.agent import Stopped, run
from hpcft.agent.settings import AgentConfig
from hpcft.errors import ConfigError, HpcftError, NoCheckpointError
from hpcft.store import job_dir, resolve_root, secure_dir

EXIT_NO_CHECKPOINT = 3


def _on_sigterm(_signum, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop is enough: let the cleanup finish
    raise Stopped


def _slot(args: argparse.Namespace, layout: tuple[str, ...]) -> tuple[int, int]:
    """(slot, slots) from --slot/--slots, else from the settings' layout and this node's name."""
    if args.slot is not None and args.slots is not None:
        return args.slot, args.slots
    if not layout:
        raise ConfigError("pass --slot and --slots, or settings with a layout (the active nodes in slot order)")
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if node not in layout:
        raise ConfigError(f"node {node} has no slot in the layout {','.join(layout)}; launch agents on the active "
                          "nodes only")
    return layout.index(node), len(layout)


def _settings(given: str) -> AgentConfig:
    """--settings: the JSON itself, or the file holding it (the supervisor's, on the shared file system)."""
    try:
        return AgentConfig.from_json(given if given.lstrip().startswith("{") else Path(given).read_text("utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the agent settings {given}: {exc.strerror}") from None


def hosted_root(job_id: str, slot: int) -> str:
    """The store root of an agent standing in for lost `slot` on this node: inside this node's job store (removed with
    it), apart from the node's own ranks."""
    path = secure_dir(job_dir(resolve_root(), job_id)) / f"hosted-{slot}"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, join the mesh, rebuild if asked, run protection rounds."""
    ap = argparse.ArgumentParser(prog="python -m hpcft.agent", description=__doc__)
    ap.add_argument("--settings", required=True, help="the launch's agent settings: a JSON object "
                    "(hpcft.agent.settings.AgentConfig.to_json), or the file holding it")
    ap.add_argument("--job-id", default=os.environ.get("HPCFT_JOB_ID") or os.environ.get("SLURM_JOB_ID"))
    ap.add_argument("--slot", type=int, default=None, help="this node's slot position (default: from the layout)")
    ap.add_argument("--slots", type=int, default=None, help="number of active slots")
    ap.add_argument("--tag", default=os.environ.get("HPCFT_RESTART_COUNT", "0"),
                    help="launch tag (restart count) keeping relaunches apart")
    ap.add_argument("--rebuild", action="store_true", help="first rebuild what replaced nodes lost (after a relaunch)")
    ap.add_argument("--hosted", action="store_true", help="stand in for --slot, whose node is lost, on another slot's "
                    "node (an elastic shrink): a store of its own inside that node's, rebuilt from parity")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if not args.job_id:
            raise ConfigError("no job id: pass --job-id or run under Slurm")
        cfg = _settings(args.settings)
        slot, slots = _slot(args, cfg.layout)
        host, bind = iface.choose(cfg.iface, cfg.host, slot=slot)
        cfg = replace(cfg, job_id=args.job_id, slot=slot, slots=slots, secret=job_secret.load(cfg.secret_file),
                      host=host, bind=bind, tag=args.tag, rebuild=args.rebuild,
                      root=hosted_root(args.job_id, slot) if args.hosted else None)
        return run(cfg)
    except Stopped:
        print("hpcft agent: stopped (SIGTERM)", file=sys.stderr)
        return 0
    except NoCheckpointError as exc:
        print(f"hpcft agent: {exc}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
    except HpcftError as exc:
        print(f"hpcft agent: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
