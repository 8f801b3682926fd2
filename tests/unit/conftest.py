"""Fixtures shared by the unit tests."""
import shutil
import tempfile
from pathlib import Path

import pytest

from hpcft.store import RankStore


@pytest.fixture
def shm_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A store root on the real /dev/shm (events under tmp_path/events), removed afterwards."""
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    path = Path(tempfile.mkdtemp(prefix="hpcft-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def slot():
    """A 1 MiB slot of a store on the real /dev/shm, for the copiers' tests."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        store = RankStore("s", 0, root=Path(d))
        yield store.begin(1 << 20)
        store.close()
