"""Inside an allocation: hpcft's node probe (hpcft/launch/node/nodecheck.py) of every node named on the command line,
once per line the test writes into the file $PROBE_GO (a line each time it has set up the next fault), each
probe's {bad: {node: why}, seconds} appended as a JSON line to $PROBE_OUT."""
import json
import os
import sys
import time
from pathlib import Path

from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.slurm.runner import Runner


def main() -> None:
    nodes, go, out = sys.argv[1:], Path(os.environ["PROBE_GO"]), Path(os.environ["PROBE_OUT"])
    check = NodeCheck(Runner(), os.environ["SLURM_JOB_ID"], os.environ, float(os.environ["PROBE_TIMEOUT"]),
                      emit=lambda *a, **k: None)
    for rounds in range(1, int(os.environ["PROBE_ROUNDS"]) + 1):
        while not go.exists() or len(go.read_text().splitlines()) < rounds:
            time.sleep(0.05)
        started = time.monotonic()
        bad = check.probe(nodes)
        with out.open("a") as fh:
            fh.write(json.dumps({"bad": bad, "seconds": time.monotonic() - started}) + "\n")


if __name__ == "__main__":
    main()
