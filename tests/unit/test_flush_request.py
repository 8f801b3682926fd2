"""`hpcft flush JOB_DIR`: the request the agents of the newest launch read, and how their reports answer it."""
import json

from click.testing import CliRunner

from hpcft.agent import persist
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
