"""`hpcft export`: click only (parse, call, print); the work is hpcft.durable.export's."""
from __future__ import annotations

import json
from pathlib import Path

import click

from hpcft.durable import catalog
from hpcft.errors import ConfigError


@click.command("export")
@click.option("--to", "dest", required=True, type=click.Path(path_type=Path),
              help="A new (or empty) directory for --format dcp; a new file for --format torch.")
@click.option("--format", "fmt", type=click.Choice(list(catalog.EXPORT_FORMATS)), default="dcp", show_default=True,
              help="dcp: a torch.distributed.checkpoint tree (hard links where possible); torch: one torch.save file "
                   "of the full state dict {'model', 'optim'}.")
@click.option("--from", "source", type=click.Path(path_type=Path), default=None,
              help=f"The persist directory (default: ${catalog.ENV_PERSIST}).")
@click.option("--step", type=int, default=None, help="The step to export (default: the newest complete one).")
@click.option("--no-verify", is_flag=True,
              help="dcp: skip reading every chunk to check its crc32c first (the sidecars' seal is still checked).")
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
def export(dest: Path, fmt: str, source: Path | None, step: int | None, no_verify: bool, as_json: bool) -> None:
    """Copy a complete durable checkpoint out of a persist directory (an ended job's, or any)."""
    root = catalog.persist_root(source)
    if root is None:
        raise ConfigError(f"no persist directory: pass --from DIR or set {catalog.ENV_PERSIST}")
    from hpcft.durable import export as exporting  # imports torch: only when exporting, not for every CLI command

    done = exporting.export(root, dest, fmt, step, check=not no_verify)
    if as_json:
        click.echo(json.dumps(done))
        return
    if done.get("unsealed"):
        click.echo(f"warning: {done['unsealed']} sidecar(s) were written by an hpcft older than the seal: their "
                   "metadata is checked by nothing but its own checksum", err=True)
    how = "" if fmt == "torch" else " (hard links)" if done.get("linked") else " (copies)"
    click.echo(f"exported step {done['step']} from {done['from']} to {done['to']} as {fmt}{how}")
