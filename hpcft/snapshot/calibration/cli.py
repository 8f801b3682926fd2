"""`hpcft calibrate`: measure the copy methods on this host now, cache the result, show what was chosen and why."""
import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object: the choice, its source and every measurement.")
@click.option("--cached", is_flag=True, help="Use this host's cached measurement where there is one (default: measure "
                                             "again and replace it).")
def calibrate(as_json: bool, cached: bool) -> None:
    """Measure the CPU snapshot/restore copy methods (kernel, threads, chunk size) on this host, under 2 s, and cache
    them at the store root for every later run; HPCFT_COPY, when set, is shown instead (it pins the method)."""
    from hpcft.snapshot import calibration, copiers

    got = calibration.resolve(copiers.default_threads("cpu"), force=not cached)
    if as_json:
        click.echo(json.dumps(got.as_dict()))
        return
    click.echo(f"snapshot: {got.choice.snapshot.describe()}\nrestore:  {got.choice.restore.describe()}\n"
               f"from:     {got.source}: {got.detail}")
    if got.samples:
        click.echo(f"{'case':<13} {'kernel':<7} {'threads':>7} {'chunk':>9} {'GB/s':>7}")
    for s in got.samples:
        rate = f"{s.gbps:7.2f}" if s.gbps else f"   -    {s.why}"
        click.echo(f"{s.case:<13} {s.method.kernel:<7} {s.method.threads:>7} {s.method.chunk_bytes >> 10:>7} K {rate}")
