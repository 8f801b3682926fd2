"""The event record: every decision hpcft takes is one greppable `key=value` line and one JSON record."""
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_log = logging.getLogger("hpcft.events")
_lock = threading.Lock()
_forward: Callable[[dict], bool] | None = None  # an agent's uplink to the supervisor (agent/uplink.py), when set


def _fmt(value: Any) -> str:
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text)
    return text


def format_line(kind: str, fields: dict[str, Any]) -> str:
    """`event=kind k=v ...` with values quoted only when they need it."""
    return " ".join([f"event={_fmt(kind)}"] + [f"{k}={_fmt(v)}" for k, v in fields.items()])


def emit(kind: str, *, level: int = logging.INFO, log_dir: str | os.PathLike | None = None, **fields: Any) -> dict:
    """Record one event: a log line always, and a JSON line in `log_dir`/events.jsonl (or $HPCFT_EVENT_DIR)."""
    record = {"event": kind, "time": time.time(), "level": logging.getLevelName(level), **fields}
    forwarded = log_dir is None and _forward is not None and _forward(record)
    if not forwarded or level >= logging.WARNING:  # a forwarded INFO event is in the supervisor's events file only
        _log.log(level, format_line(kind, fields))
    if forwarded:
        return record  # the supervisor appends it: no write to the shared file system from this node
    write(record, log_dir)
    return record


def write(record: dict, log_dir: str | os.PathLike | None = None) -> None:
    """Append `record` to `log_dir` (default $HPCFT_EVENT_DIR)/events.jsonl, if there is one."""
    target = log_dir or os.environ.get("HPCFT_EVENT_DIR")
    if target:
        append(target, record)


KEPT = 10_000  # events kept in memory per event record that cannot be written


@dataclass
class Unwritten:
    """Events that could not be appended to `path`: the newest KEPT lines, how many older ones were dropped, why."""
    path: Path
    error: str
    lines: deque = field(default_factory=lambda: deque(maxlen=KEPT))
    dropped: int = 0

    def keep(self, line: str) -> None:
        self.dropped += len(self.lines) == KEPT
        self.lines.append(line)


_unwritten: dict[Path, Unwritten] = {}


def append(log_dir: str | os.PathLike, record: dict) -> bool:
    """Append one JSON record to `log_dir`/events.jsonl, after those kept while it could not be; False when it cannot
    be (full disk, quota, ...): kept in memory, bounded, said once. Nothing that decides or trains dies of its log."""
    path = Path(log_dir) / "events.jsonl"
    line = json.dumps(record, default=str, sort_keys=False) + "\n"
    with _lock:
        kept = _unwritten.get(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _append_whole(path, ("".join(kept.lines) + line if kept else line).encode())
        except OSError as exc:
            if kept is None:
                kept = _unwritten[path] = Unwritten(path, str(exc))
                _log.error("cannot write the event record %s (%s): its events are kept in memory (the newest %d) "
                           "and written once it can be; each is also a line of this log", path, exc, KEPT)
            kept.keep(line)
            return False
        if kept is not None:
            del _unwritten[path]
            _log.warning("the event record %s is written again: %d event(s) kept meanwhile written, %d lost",
                         path, len(kept.lines), kept.dropped)
    return True


def _append_whole(path: Path, data: bytes) -> None:
    """Append `data` or nothing: a write cut short (ENOSPC) is cut back, so that no torn line is left."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            with suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def unwritten() -> list[Unwritten]:
    """The event records that cannot be written now (for a run's summary)."""
    with _lock:
        return list(_unwritten.values())


def forward(sink: Callable[[dict], bool] | None) -> None:
    """Hand this process's events to `sink` (True: taken) instead of the events file; None: the file again."""
    global _forward
    _forward = sink


def read(log_dir: str | os.PathLike) -> list[dict]:
    """All events recorded in `log_dir`, oldest first (for status views and tests). A line not yet ended is one still
    being written (a reader sees a write that crosses a page boundary in part): it is left for the next read."""
    path = Path(log_dir) / "events.jsonl"
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # none, or not a record (`append` says so)
        return []
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


class Tail:
    """A JSON-lines file as it grows (the events, a bench job's timeline): `new()` parses only the whole lines written
    since the last call, from byte `start` on at first; a line still being written waits for the next call. A line
    that is not JSON raises ValueError, or is skipped when `lenient` (a record torn on a full disk)."""

    def __init__(self, path: str | os.PathLike, *, start: int = 0, lenient: bool = False):
        self.path, self.offset, self.lenient = Path(path), start, lenient

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        records = []
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                if not self.lenient:
                    raise
        return records
