"""`python -m hpcft.launch.node.handoff -- CMD …`: a node agent's task hands CMD to this node's warm standby, which
forks it with numpy and the rest already imported (a relaunch's agents start in milliseconds), or execs CMD where none
can run it (node/warm.py)."""
import os
import sys

from hpcft.launch.node import warm
from hpcft.launch.node.broadcast_paths import localized


def main(argv: list[str]) -> int:
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print("usage: python -m hpcft.launch.node.handoff -- CMD [ARGS...]", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    command = localized(command, os.environ, sys.executable)  # --broadcast-env: `python` is this node's copy
    return warm.run_or_exec(command, os.environ, role="agent")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
