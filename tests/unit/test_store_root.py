"""The store root (the parent of every job's store directory): one that any user may write to without the sticky bit
lets another user delete or rename a job's store (the job would restart from step 0), so it is warned about, once
per process, naming the path and the fix."""
from pathlib import Path

import pytest

from hpcft import events
from hpcft.store import RankStore


def _warnings(tmp: Path) -> list[dict]:
    return [e for e in events.read(tmp / "events") if e["event"] == "store_root_unsafe"]


def test_a_world_writable_root_without_the_sticky_bit_is_warned_about_once(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    root = tmp_path / "open"
    root.mkdir()
    root.chmod(0o777)
    for rank in (0, 1):
        RankStore("j", rank, root=root).close()
    RankStore("k", 0, root=root).close()
    (warned,) = _warnings(tmp_path)
    assert warned["level"] == "WARNING" and warned["path"] == str(root) and warned["mode"] == "0777"
    assert f"chmod +t {root}" in warned["fix"] and "step 0" in warned["reason"]


@pytest.mark.parametrize("mode", [0o1777, 0o700, 0o755])
def test_a_sticky_or_private_root_is_not_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      mode: int) -> None:
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    root = tmp_path / f"root-{mode:o}"
    root.mkdir()
    root.chmod(mode)
    RankStore("j", 0, root=root).close()
    assert not _warnings(tmp_path)
