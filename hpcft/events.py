"""The event record: every decision hpcft takes is one greppable `key=value` line and one JSON record."""
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

_log = logging.getLogger("hpcft.events")
_lock = threading.Lock()


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
    _log.log(level, format_line(kind, fields))
    target = log_dir or os.environ.get("HPCFT_EVENT_DIR")
    if target:
        path = Path(target) / "events.jsonl"
        line = json.dumps(record, default=str, sort_keys=False) + "\n"
        with _lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(line)
    return record


def read(log_dir: str | os.PathLike) -> list[dict]:
    """All events recorded in `log_dir`, oldest first (for status views and tests)."""
    path = Path(log_dir) / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
