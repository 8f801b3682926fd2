"""The event record: every decision hpcft takes is one greppable `key=value` line and one JSON record."""
import json
import logging
import os
import threading
import time
from pathlib import Path
from collections.abc import Callable
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


def append(log_dir: str | os.PathLike, record: dict) -> None:
    """Append one JSON record to `log_dir`/events.jsonl."""
    path = Path(log_dir) / "events.jsonl"
    line = json.dumps(record, default=str, sort_keys=False) + "\n"
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line)


def forward(sink: Callable[[dict], bool] | None) -> None:
    """Hand this process's events to `sink` (True: taken) instead of the events file; None: the file again."""
    global _forward
    _forward = sink


def read(log_dir: str | os.PathLike) -> list[dict]:
    """All events recorded in `log_dir`, oldest first (for status views and tests)."""
    path = Path(log_dir) / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
