"""`python -m hpcft.launch.node.handoff -- CMD …`: the node agents' task (hpcft/launch/steps/agents.py) hands CMD to this
node's warm standby, which forks it with numpy and the rest already imported (a relaunch's agents start in
milliseconds instead of an interpreter's import), or, where none can run it, execs CMD: hpcft/launch/node/warm.py."""
import os
import sys

from hpcft.launch.node import warm
from hpcft.launch.node.stage_paths import localized


def main(argv: list[str]) -> int:
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print("usage: python -m hpcft.launch.node.handoff -- CMD [ARGS...]", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    command = localized(command, os.environ, sys.executable)  # --stage-env: `python` is this node's copy
    return warm.run_or_exec(command, os.environ, role="agent")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
