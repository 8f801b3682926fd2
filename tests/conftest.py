"""Shared fixtures: `sandbox` (a real 6-node Slurm cluster, one per session) and `healthy_sandbox`.

`sandbox` starts once per pytest session (netns mode, nodes n1..n6: 4 active + 2 spares, no hpcft epilog or
prolog, as on a cluster whose users cannot install one) in its own directory, so it never touches a user's
`hpcft sandbox up`. It is stopped at the end; if any test
failed, its logs are first copied to a directory named in the output. Tests that crash nodes or
leave jobs behind use `healthy_sandbox`, which puts the cluster back (all nodes idle, no jobs) after
the test. Tests using either fixture are marked `sandbox` automatically (`-m "not sandbox"` skips them).
"""
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

# The suite pins hpcft's built-in copy method (as a site may, hpcft/snapshot/calibration): a calibration, a second of
# memory traffic on every core, in each test process whose store root has no cache yet would slow the suite and
# disturb its timing-sensitive tests. The calibration's own tests clear it; HPCFT_COPY=auto runs the suite calibrated.
os.environ.setdefault("HPCFT_COPY", "default")

SANDBOX_NODES = 6
_PREFIX = "hpcft-pytest-sandbox-"
_log = logging.getLogger(__name__)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses the sandbox, so it can be selected or deselected as a group."""
    for item in items:
        if {"sandbox", "healthy_sandbox"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.sandbox)


def _reap_orphans(root: Path) -> None:
    """Stop sandboxes left by pytest sessions that were killed (their pid, in the name, is gone)."""
    from hpcft.errors import SandboxError
    from hpcft.sandbox import Sandbox

    for path in root.glob(_PREFIX + "*"):
        pid = path.name.removeprefix(_PREFIX).split("-")[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        try:
            if (path / "state.json").exists():
                Sandbox.load(path).down()
        except SandboxError as exc:
            _log.warning("could not stop orphaned sandbox %s: %s", path, exc)
            continue
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def sandbox(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A running 6-node sandbox (hpcft.sandbox.Sandbox); skipped where this machine cannot run one."""
    from hpcft.sandbox import Sandbox, SandboxConfig
    from hpcft.sandbox.cluster import unavailable_reason
    from hpcft.sandbox.config import plan

    reason = unavailable_reason("netns")
    if reason:
        pytest.skip(f"no Slurm sandbox on this machine: {reason}")
    root = Path(os.environ.get("TMPDIR", "/tmp"))
    _reap_orphans(root)
    directory = root / f"{_PREFIX}{os.getpid()}"
    if (directory / "state.json").exists():  # left by an earlier session that had our pid
        Sandbox.load(directory).down()
    # No hpcft epilog or prolog (slurm/): Frontier users cannot install one, so hpcft must clean up by itself;
    # the tests of those scripts run them by hand.
    sb = Sandbox(plan(SandboxConfig(dir=directory, nodes=SANDBOX_NODES, mode="netns", prolog=None, epilog=None)))
    started = time.monotonic()
    sb.up(timeout=60)  # on failure it stops what it started and the error carries the log tails
    _log.info("sandbox up in %.2f s at %s", time.monotonic() - started, sb.dir)
    try:
        yield sb
    finally:
        if request.session.testsfailed:
            keep = Path(tmp_path_factory.getbasetemp()) / "sandbox-logs"
            keep.mkdir(parents=True, exist_ok=True)
            for log in sb.log_files():
                shutil.copy2(log, keep / log.name)
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            message = f"sandbox logs kept in {keep}"
            reporter.write_line(message) if reporter else print(message)
        sb.down()
        shutil.rmtree(sb.dir, ignore_errors=True)


@pytest.fixture
def healthy_sandbox(sandbox):
    """The session sandbox, healed after the test: crashed nodes restarted, jobs cancelled, all idle."""
    yield sandbox
    sandbox.heal()
