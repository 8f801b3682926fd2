"""The node probe's srun for narrow unit tests of hpcft/launch/node/nodecheck.py (the real srun runs in the integration
tests): a process per node that first says on stderr what `srun --verbose` says once it sends the node its task,
then prints the node's name; a frozen node never answers after that, and a node whose step the controller never
creates says nothing at all."""
import subprocess
import sys
from collections.abc import Collection, Sequence


def node_of(argv: Sequence[str]) -> str:
    """The one node a probe's srun line names."""
    return next(a.split("=", 1)[1] for a in argv if a.startswith("--nodelist="))


def probe(argv: Sequence[str], frozen: Collection[str] = (), unlaunched: Collection[str] = (),
          **kwargs) -> subprocess.Popen:
    node = node_of(argv)
    said = "" if node in unlaunched else \
        f"import sys; print('srun: launching StepId=7.1 on host {node}, 1 tasks: 0', file=sys.stderr, flush=True); "
    script = said + ("import time; time.sleep(600)" if node in frozen or node in unlaunched else f"print({node!r})")
    return subprocess.Popen([sys.executable, "-c", script], **kwargs)
