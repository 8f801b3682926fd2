"""What a requeue's persist says after a node loss (issue 34, item 8): the durable step that stays, or that none
exists yet (it said "the newest durable step stays" when there was none)."""
import subprocess
import sys

import pytest

from hpcft.agent import status as agent_status
from hpcft.launch.steps.agents import AgentSteps
from hpcft.launch.config.model import RunConfig, make


@pytest.mark.parametrize("persisted,says,never", [
    (None, "no step is durable", "the newest durable step stays"),  # nothing flushed yet: nothing stays
    (5, "durable step 5 stays", "no step is durable"),
])
def test_persist_after_a_lost_node_says_which_durable_step_stays_or_that_there_is_none(tmp_path, persisted, says,
                                                                                      never):
    emitted = []
    steps = AgentSteps(lambda: make(protect_timeout=5, poll_interval=0.05, kill_grace=0.2), None, tmp_path, "python",
                       emit=lambda kind, **f: emitted.append((kind, f)),
                       stop_steps=lambda procs, **kw: [p.kill() or p.wait() for p in procs.values()],
                       interrupted=lambda: False, check_nodes=lambda layout, probe: {})
    (tmp_path / "agents").mkdir()
    for slot in range(3):
        agent_status.write(tmp_path / "agents", "0", slot, node=f"n{slot + 1}", phase="protecting", protected=9,
                           persisted=persisted)
    steps.tag = "0"
    steps.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        steps.persist(("n2",))
    finally:
        steps.proc.kill()
        steps.proc.wait()
    said = [f for kind, f in emitted if kind == "persist"]
    assert len(said) == 1 and said[0]["durable"] == persisted, said
    assert says in said[0]["flush_reason"] and never not in said[0]["flush_reason"], said
