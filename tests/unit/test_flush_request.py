"""`hpcft flush JOB_DIR`: the request the agents of the newest launch read, and how their reports answer it."""
import json

from click.testing import CliRunner

from hpcft.agent.protection import flush as persist
from hpcft.agent import status as agent_status
from hpcft.cli import cli


def _report(where, tag, slot, **fields):
    agent_status.write(where, tag, slot, node=f"n{slot}", phase="protecting", **fields)


def test_flush_asks_the_newest_launch_and_reports_served_done_or_failed(tmp_path):
    rendezvous = tmp_path / "agents"  # `hpcft run`'s job dir holds the rendezvous as agents/
    rendezvous.mkdir()
    for slot in range(2):
        _report(rendezvous, "0", slot, persisted=None)
        _report(rendezvous, "1", slot, persisted=4)
    out = CliRunner().invoke(cli, ["flush", str(tmp_path)])
    assert out.exit_code == 0, out.output
    rid = json.loads(persist.request_path(rendezvous, "1").read_text())["id"]
    assert rid in out.output and "launch 1" in out.output
    reports = lambda: list(agent_status.read(rendezvous, "1").values())  # noqa: E731
    assert persist.outcome(reports(), rid, 2) == (False, 4, None)  # not served yet
    for slot in range(2):
        _report(rendezvous, "1", slot, persisted=9, flushed_request=rid, flushing=slot == 1)
    assert persist.outcome(reports(), rid, 2) == (False, 9, None)  # one still writing
    for slot in range(2):
        _report(rendezvous, "1", slot, persisted=9, flushed_request=rid, flushing=False)
    assert persist.outcome(reports(), rid, 2) == (True, 9, None)
    _report(rendezvous, "1", 0, persisted=9, flushed_request=rid, flushing=False, flush_error="disk full")
    assert persist.outcome(reports(), rid, 2) == (True, 9, "disk full")


def test_flush_without_agents_says_so(tmp_path):
    out = CliRunner().invoke(cli, ["flush", str(tmp_path)])
    assert out.exit_code != 0 and "no node agent reports" in out.output


def _steps(tmp_path, interrupted=False):
    """AgentSteps around a real process standing for the agents' step, their reports written by the test."""
    import subprocess
    import sys

    from hpcft.launch.steps.agents import AgentSteps
    from hpcft.launch.config.model import RunConfig, make

    emitted = []
    steps = AgentSteps(lambda: make(protect_timeout=30, poll_interval=0.05, kill_grace=0.2), None, tmp_path, "python",
                       emit=lambda kind, **f: emitted.append((kind, f)),
                       stop_steps=lambda procs, **kw: [p.kill() or p.wait() for p in procs.values()],
                       interrupted=lambda: interrupted, check_nodes=lambda layout, probe: {})
    steps.prepare()
    steps.tag = "0"
    steps.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return steps, emitted


def test_the_run_end_waits_for_a_flush_under_way_but_a_relaunch_and_sigterm_do_not(tmp_path):
    import threading
    import time

    (tmp_path / "agents").mkdir()
    for slot in range(2):
        _report(tmp_path / "agents", "0", slot, flushing=True, local=7)
    done = threading.Timer(0.5, lambda: _report(tmp_path / "agents", "0", 1, flushing=False, local=7))
    _report(tmp_path / "agents", "0", 0, flushing=False, local=7)
    steps, emitted = _steps(tmp_path)
    done.start()
    t0 = time.monotonic()
    steps.stop()
    assert time.monotonic() - t0 >= 0.4  # it waited for slot 1's drain
    assert [f for k, f in emitted if k == "flush_wait"][0]["done"] is True
    for interrupted, flush in ((False, False), (True, True)):  # a relaunch; SIGTERM
        _report(tmp_path / "agents", "0", 1, flushing=True, local=7)
        steps, emitted = _steps(tmp_path, interrupted)
        steps.stop(flush=flush)
        assert not [k for k, _ in emitted if k == "flush_wait"]
