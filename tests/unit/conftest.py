"""Fixtures shared by the unit tests."""
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def shm_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A store root on the real /dev/shm (events under tmp_path/events), removed afterwards."""
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    path = Path(tempfile.mkdtemp(prefix="hpcft-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
