"""Shared fixtures: `sandbox` (a real 6-node Slurm cluster, one per session) and `healthy_sandbox`; their confined
twins `confined_sandbox` (4 nodes, task/cgroup and fake GPUs, started only for the tests that use it) and
`healthy_confined_sandbox`.

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
CONFINED_NODES = 4  # hpcft demo's allocation (3 train, 1 spare)
_PREFIX = "hpcft-pytest-sandbox-"
_log = logging.getLogger(__name__)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses the sandbox, so it can be selected or deselected as a group."""
    for item in items:
        if {"sandbox", "healthy_sandbox", "confined_sandbox", "healthy_confined_sandbox"} & \
                set(getattr(item, "fixturenames", ())):
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


def _session_sandbox(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, suffix: str = "",
                     **config):
    """Start a sandbox for the session (stopped, its logs kept if a test failed, at the end): the generator of the
    `sandbox` and `confined_sandbox` fixtures; **config: its SandboxConfig fields beyond the directory."""
    from hpcft.sandbox import Sandbox, SandboxConfig
    from hpcft.sandbox.config import plan

    root = Path(os.environ.get("TMPDIR", "/tmp"))
    _reap_orphans(root)
    directory = root / f"{_PREFIX}{os.getpid()}{suffix}"
    if (directory / "state.json").exists():  # left by an earlier session that had our pid
        Sandbox.load(directory).down()
    # No hpcft epilog or prolog (slurm/): Frontier users cannot install one, so hpcft must clean up by itself;
    # the tests of those scripts run them by hand.
    sb = Sandbox(plan(SandboxConfig(dir=directory, mode="netns", prolog=None, epilog=None, **config)))
    started = time.monotonic()
    sb.up(timeout=60)  # on failure it stops what it started and the error carries the log tails
    _log.info("sandbox up in %.2f s at %s", time.monotonic() - started, sb.dir)
    try:
        yield sb
    finally:
        if request.session.testsfailed:
            keep = Path(tmp_path_factory.getbasetemp()) / f"sandbox-logs{suffix}"
            keep.mkdir(parents=True, exist_ok=True)
            for log in sb.log_files():
                shutil.copy2(log, keep / log.name)
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            message = f"sandbox logs kept in {keep}"
            reporter.write_line(message) if reporter else print(message)
        sb.down()
        shutil.rmtree(sb.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def sandbox(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A running 6-node sandbox (hpcft.sandbox.Sandbox); skipped where this machine cannot run one."""
    from hpcft.sandbox.machine import unavailable_reason

    reason = unavailable_reason("netns")
    if reason:
        pytest.skip(f"no Slurm sandbox on this machine: {reason}")
    yield from _session_sandbox(request, tmp_path_factory, nodes=SANDBOX_NODES)


@pytest.fixture(scope="session")
def confined_sandbox(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A running confined sandbox (`hpcft sandbox up --confine`: task/cgroup, 8 fake GPUs per node) of 4 nodes, beside
    `sandbox`; skipped where this machine has no cgroup v1 controllers or cgroup namespaces."""
    from hpcft.sandbox import confine
    from hpcft.sandbox.machine import unavailable_reason

    reason = unavailable_reason("netns") or confine.unavailable_reason()
    if reason:
        pytest.skip(f"no confined Slurm sandbox on this machine: {reason}")
    yield from _session_sandbox(request, tmp_path_factory, "-confined", nodes=CONFINED_NODES, confine=True)


@pytest.fixture
def healthy_sandbox(sandbox):
    """The session sandbox, healed after the test: crashed nodes restarted, jobs cancelled, all idle."""
    yield from _healed(sandbox)


@pytest.fixture
def healthy_confined_sandbox(confined_sandbox):
    """The session's confined sandbox, healed after the test."""
    yield from _healed(confined_sandbox)


def _healed(sb):
    """`sb` healed after the test, and before it too when the last test's heal failed (that test errs, not the next)."""
    if getattr(sb, "unhealed", False):
        sb.heal()
    sb.unhealed = True
    yield sb
    sb.heal()
    sb.unhealed = False
