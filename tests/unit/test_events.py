"""The event record never kills what writes it: a full disk (/dev/full: every write ENOSPC), a directory in the place
of events.jsonl, a file in the place of the event directory. The events are kept in memory (bounded), said once,
and written once the record can be; a training process outside `hpcft run` trains on. A reader never trips on a line
still being written."""
import logging

import torch

from hpcft import events
from hpcft.checkpointer import Checkpointer
from hpcft.options import Options


def test_a_full_disk_keeps_the_events_in_memory_says_so_once_and_writes_them_when_it_can(tmp_path, caplog):
    record = tmp_path / "events.jsonl"
    record.symlink_to("/dev/full")
    with caplog.at_level(logging.WARNING, logger="hpcft.events"):
        for i in range(3):
            events.emit("tick", log_dir=tmp_path, i=i)
    (kept,) = events.unwritten()
    assert kept.path == record and len(kept.lines) == 3 and "No space left" in kept.error
    assert sum("cannot write the event record" in r.getMessage() for r in caplog.records) == 1
    record.unlink()  # space again
    events.emit("tock", log_dir=tmp_path)
    assert [e.get("i") for e in events.read(tmp_path)] == [0, 1, 2, None] and events.unwritten() == []


def test_the_kept_events_are_bounded_and_the_dropped_ones_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(events, "KEPT", 2)
    (tmp_path / "events.jsonl").symlink_to("/dev/full")
    for i in range(5):
        assert not events.append(tmp_path, {"i": i})
    (kept,) = events.unwritten()
    assert [int(line[6]) for line in kept.lines] == [3, 4] and kept.dropped == 3
    (tmp_path / "events.jsonl").unlink()
    assert events.append(tmp_path, {"i": 5}) and [e["i"] for e in events.read(tmp_path)] == [3, 4, 5]


def test_a_record_read_while_a_line_is_being_written_holds_the_whole_lines_only(tmp_path):
    events.append(tmp_path, {"event": "one"})
    with open(tmp_path / "events.jsonl", "a") as f:  # what a reader sees of a write that crosses a page boundary
        f.write('{"event": "two", "ra')
    assert [e["event"] for e in events.read(tmp_path)] == ["one"]


def test_a_trainer_whose_event_directory_is_a_file_or_whose_record_is_a_directory_trains_on(tmp_path, monkeypatch,
                                                                                            shm_root):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for where in ("a-file", "a-dir"):
        bad = tmp_path / where
        if where == "a-file":
            bad.write_text("not a directory")
        else:
            (bad / "events.jsonl").mkdir(parents=True)
        monkeypatch.setenv("HPCFT_EVENT_DIR", str(bad))
        ckpt = Checkpointer(model, opt, Options(root=str(shm_root), job_id=f"events-{where}"))
        try:
            assert ckpt.restore() == 0  # `restore_none` is an event
            for _ in range(3):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()  # the optimizer's hooks take the snapshot
            ckpt.wait()
            assert ckpt.completed == 3
        finally:
            ckpt.close()
    assert {u.path.parent.name for u in events.unwritten()} == {"a-file", "a-dir"}


def teardown_function() -> None:
    events._unwritten.clear()  # noqa: SLF001 - one test's unwritable records are not the next one's
