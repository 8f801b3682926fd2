"""Each rank's progress as its node's store says it (the newest committed step and its `ready_s`, or the rank's
progress file): read on the node and sent over the network, never written to the shared file system."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from hpcft.store import paths

Progress = tuple[int, "float | None"]  # (step, ready_s or None)
_SEEN: dict[Path, tuple[tuple[int, int, int], Progress]] = {}  # manifest path -> (its stat key, what it said)


def newest(directory: Path) -> Progress | None:
    """(step, ready_s or None) of the highest step among the committed manifests in a rank's directory, if any."""
    best = None
    for path in paths.slot_files(directory).values():
        try:
            st = path.stat()
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            seen = _SEEN.get(path)
            if seen is not None and seen[0] == key:
                found = seen[1]  # a large model's manifest is parsed once per commit, not once per look
            else:
                manifest = json.loads(path.read_text(encoding="utf-8"))
                ready = (manifest.get("timing") or {}).get("ready_s")
                found = (int(manifest["step"]), None if ready is None else float(ready))
                _SEEN[path] = (key, found)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # being replaced right now, or not a manifest: the next poll sees the new one
        best = found if best is None or found[0] > best[0] else best
    return best


def parse(text: str) -> Progress:
    """`<step>` or `<step> <ready_s>`."""
    words = text.split()
    return int(words[0]), float(words[1]) if len(words) > 1 else None


def _written(path: Path) -> Progress | None:
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, IndexError):
        return None


def node(job: Path, ranks: Iterable[int] | None = None) -> dict[int, Progress]:
    """{rank: (step, ready_s)} of `ranks` (default: every one with a store directory or a progress file under `job`),
    the higher of what its manifests and its progress file say."""
    if ranks is None:
        ranks = sorted({*paths.ranks(job), *paths.ranks(job / paths.PROGRESS)})
    out: dict[int, Progress] = {}
    for r in ranks:
        got = [g for g in (newest(paths.rank_dir(job, r)), _written(paths.progress_file(job, r))) if g is not None]
        if got:
            out[r] = max(got, key=lambda g: g[0])
    return out


def write(path: Path, step: int, ready_s: float | None = None) -> None:
    """Publish `step` (and `ready_s`) atomically (write, then rename): what a job's own progress report looks like."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = str(step) if ready_s is None else f"{step} {ready_s:.6f}"
    paths.replace_file(path, text.encode())
