"""Manifests: the JSON description of one snapshot (never pickle), self-checksummed, committed by rename."""
import json
from pathlib import Path
from typing import Any

from hpcft.errors import StoreError
from hpcft.store.checksum import crc32c
from hpcft.store.paths import replace_file

FORMAT = "hpcft-snapshot/1"


def _body(manifest: dict[str, Any]) -> bytes:
    fields = {k: v for k, v in manifest.items() if k != "checksum"}
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def encode(manifest: dict[str, Any]) -> bytes:
    """The committed bytes: the manifest plus `format` and a crc32c of its canonical JSON."""
    manifest = {**manifest, "format": FORMAT}
    return json.dumps({**manifest, "checksum": crc32c(_body(manifest))}, sort_keys=True).encode()


def decode(data: bytes, path: Path | str = "<manifest>") -> dict[str, Any]:
    """Parse and verify a manifest; StoreError if it is torn, foreign or corrupt."""
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise StoreError(f"manifest {path} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"manifest {path} is not an {FORMAT} manifest")
    if manifest.get("checksum") != crc32c(_body(manifest)):
        raise StoreError(f"manifest {path} fails its checksum")
    return manifest


def write_atomic(path: Path, manifest: dict[str, Any]) -> None:
    """Write `<path>.dirty` (exclusive, 0600), then rename it to `path`: readers see all or nothing."""
    try:
        replace_file(path, encode(manifest), path.with_name(path.name + ".dirty"))
    except OSError as exc:
        raise StoreError(f"cannot commit manifest {path}: {exc.strerror or exc}") from exc


def read(path: Path) -> dict[str, Any]:
    """Read and verify one committed manifest."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise StoreError(f"cannot read manifest {path}: {exc.strerror}") from exc
    return decode(data, path)
