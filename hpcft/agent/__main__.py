"""`python -m hpcft.agent`: run one node's agent (one srun task per node, or a local process).

Under srun the job id, the slot (this node's place in $HPCFT_LAYOUT or --layout) and the address the
other agents reach it at (its hostname's address) come from the environment; locally pass them."""
import argparse
import logging
import os
import signal
import socket
import sys

from hpcft.agent.transport import iface
from hpcft.agent.transport import secret as job_secret
from hpcft.agent.agent import AgentConfig, Stopped, run
from hpcft.agent.transport.heartbeat import LOSS_TIMEOUT_S
from hpcft.durable.settings import PersistConfig
from hpcft.agent.protection.pins import LEASE_S
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.transport.throttle import CPU_SHARE
from hpcft.errors import ConfigError, HpcftError, NoCheckpointError
from hpcft.store import job_dir, resolve_root, secure_dir

EXIT_NO_CHECKPOINT = 3


def _on_sigterm(_signum, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop is enough: let the cleanup finish
    raise Stopped


def _slot(args: argparse.Namespace) -> tuple[int, int]:
    """(slot, slots) from --slot/--slots, else from the layout and this node's name."""
    layout = args.layout or os.environ.get("HPCFT_LAYOUT")
    if args.slot is not None and args.slots is not None:
        return args.slot, args.slots
    if not layout:
        raise ConfigError("pass --slot and --slots, or --layout NODE,NODE,... (or export HPCFT_LAYOUT)")
    nodes = layout.split(",")
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if node not in nodes:
        raise ConfigError(f"node {node} has no slot in the layout {layout}; launch agents on the active nodes only")
    return nodes.index(node), len(nodes)


def hosted_root(job_id: str, slot: int) -> str:
    """The store root of an agent standing in for lost `slot` on this node: inside this node's job store, so that
    removing the job's store (the janitor) removes it too, and apart from the node's own ranks."""
    path = secure_dir(job_dir(resolve_root(), job_id)) / f"hosted-{slot}"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, join the mesh, rebuild if asked, run protection rounds."""
    ap = argparse.ArgumentParser(prog="python -m hpcft.agent", description=__doc__)
    ap.add_argument("--job-id", default=os.environ.get("HPCFT_JOB_ID") or os.environ.get("SLURM_JOB_ID"))
    ap.add_argument("--slot", type=int, default=None, help="this node's slot position")
    ap.add_argument("--slots", type=int, default=None, help="number of active slots")
    ap.add_argument("--layout", default=None, help="active nodes in slot order (default $HPCFT_LAYOUT)")
    ap.add_argument("--rendezvous", required=True, help="directory shared by the nodes for addresses and status")
    ap.add_argument("--secret", default=None, help="job secret file (default $HPCFT_SECRET_FILE)")
    ap.add_argument("--host", default="127.0.0.1", help="address the other agents reach this one at ('auto': "
                    "the address of this node's hostname)")
    ap.add_argument("--iface", default=None, help="network interface to bind to and be reached at (e.g. hsn0); "
                    "a node without it falls back to --host, with a warning event")
    ap.add_argument("--scheme", default="xor")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--losses", type=int, default=1)
    ap.add_argument("--distance", type=int, default=1)
    ap.add_argument("--rate", type=float, default=None, help="bytes/s cap on protection traffic (default: none)")
    ap.add_argument("--cpu-share", type=float, default=CPU_SHARE, help="cap on the agent's CPU time: this fraction "
                    "of the cores it may run on, on average (default %(default)s; 0: none)")
    ap.add_argument("--cpu-cores", type=float, default=None, help="cap on the agent's CPU time in cores, instead of "
                    "--cpu-share (for trainers computing on the CPU: see hpcft/launch/config/profiles.py)")
    ap.add_argument("--lag-bound", type=int, default=None, help="protection lag in steps to keep to: the CPU cap "
                    "rises above --cpu-share/--cpu-cores while the lag exceeds it (default: a fixed cap)")
    ap.add_argument("--lag-cores", type=float, default=1.0, help="the most cores --lag-bound may raise the cap to")
    ap.add_argument("--nice", type=int, default=10, help="CPU priority increment (os.nice), so the agent yields the "
                    "cores to the trainers (0: none)")
    ap.add_argument("--rounds", type=int, default=1, help="protection rounds before exiting (0: until stopped)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between protection rounds")
    ap.add_argument("--pin-lease", type=float, default=LEASE_S, help="seconds a pin on the step being protected "
                    "outlives the agent's last renewal (a dead or stopped agent's pin is broken after this)")
    ap.add_argument("--persist-dir", default=None, help="flush protected steps to this directory in "
                    "torch.distributed.checkpoint's layout (default: no flushing)")
    ap.add_argument("--persist-every", type=int, default=PersistConfig.every, help="flush once the newest protected "
                    "step is this many steps past the newest durable one (default %(default)s)")
    ap.add_argument("--persist-keep", type=int, default=PersistConfig.keep, help="complete durable checkpoints kept")
    ap.add_argument("--persist-rate", type=float, default=None, help="bytes/s cap on this node's flush writes")
    ap.add_argument("--persist-local", default=None, help="write flushes to this node-local directory first, then "
                    "drain them to --persist-dir (default $HPCFT_PERSIST_LOCAL, else $HPCFT_NVME/hpcft-persist "
                    "where that exists; none: off)")
    ap.add_argument("--transport", choices=("tcp", "mpi"), default="tcp", help="what carries the mesh's bulk data and "
                    "agreements: authenticated TCP, or MPI (start the agents with srun --mpi=…; the heartbeats stay "
                    "on TCP)")
    ap.add_argument("--rebuild", action="store_true", help="first rebuild what replaced nodes lost (after a relaunch)")
    ap.add_argument("--hosted", action="store_true", help="stand in for --slot, whose node is lost, on another slot's "
                    "node (an elastic shrink): a store of its own inside that node's, rebuilt from parity")
    ap.add_argument("--tag", default=os.environ.get("HPCFT_RESTART_COUNT", "0"),
                    help="launch tag (restart count) keeping relaunches apart")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the other agents")
    ap.add_argument("--loss-timeout", type=float, default=LOSS_TIMEOUT_S, help="seconds without a heartbeat after "
                    "which a peer agent is a suspect: this agent fails naming it (default %(default)s; 0: no "
                    "heartbeats, a peer is lost only when its connections close)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if not args.job_id:
            raise ConfigError("no job id: pass --job-id or run under Slurm")
        slot, slots = _slot(args)
        host, bind = iface.choose(args.iface, args.host, slot=slot)
        root = hosted_root(args.job_id, slot) if args.hosted else None
        cfg = AgentConfig(job_id=args.job_id, slot=slot, slots=slots, rendezvous=args.rendezvous,
                          secret=job_secret.load(args.secret), host=host, bind=bind,
                          scheme=Scheme(args.scheme, args.group, args.losses, args.distance), rate=args.rate,
                          rounds=args.rounds, interval=args.interval, nice=args.nice, pin_lease=args.pin_lease, cpu_share=args.cpu_share, cpu_cores=args.cpu_cores, rebuild=args.rebuild, tag=args.tag,
                          timeout=args.timeout, root=root, loss_timeout=args.loss_timeout,
                          lag_bound=args.lag_bound, lag_cores=args.lag_cores, transport=args.transport,
                          persist=PersistConfig(args.persist_dir, args.persist_every, args.persist_keep,
                                                args.persist_rate, local=args.persist_local))
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
