"""`python -m hpcft.agent`: run one node's agent (one srun task per node, or a local process)."""
import argparse
import logging
import sys
from pathlib import Path

from hpcft.agent import secret as job_secret
from hpcft.agent.agent import protect_newest
from hpcft.agent.mesh import Mesh
from hpcft.agent.placement import Scheme, plan
from hpcft.errors import HpcftError
from hpcft.store import job_dir, resolve_root, secure_dir


def main(argv: list[str] | None = None) -> int:
    """Parse the options, join the mesh, run protection rounds."""
    ap = argparse.ArgumentParser(prog="python -m hpcft.agent", description=__doc__)
    ap.add_argument("--job-id", required=True)
    ap.add_argument("--slot", type=int, required=True, help="this node's slot position")
    ap.add_argument("--slots", type=int, required=True, help="number of active slots")
    ap.add_argument("--rendezvous", required=True, help="directory shared by the nodes for agent addresses")
    ap.add_argument("--secret", default=None, help="job secret file (default $HPCFT_SECRET_FILE)")
    ap.add_argument("--host", default="127.0.0.1", help="address the other agents reach this one at")
    ap.add_argument("--scheme", default="xor")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--losses", type=int, default=1)
    ap.add_argument("--distance", type=int, default=1)
    ap.add_argument("--rate", type=float, default=None, help="bytes/s cap on protection traffic")
    ap.add_argument("--rounds", type=int, default=1, help="protection rounds before exiting")
    ap.add_argument("--tag", default="0", help="launch tag (restart count) keeping relaunches apart")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        placement = plan(args.slots, Scheme(args.scheme, args.group, args.losses, args.distance))
        job = secure_dir(job_dir(resolve_root(), args.job_id))
        mesh = Mesh(args.slot, args.slots, job_secret.load(args.secret), args.rendezvous, host=args.host,
                    rate=args.rate, tag=args.tag)
        try:
            for _ in range(args.rounds):
                rec = protect_newest(mesh, placement, Path(job))
                print(f"slot={args.slot} protected={rec.step if rec else None}", flush=True)
        finally:
            mesh.close()
    except HpcftError as exc:
        print(f"hpcft agent: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
