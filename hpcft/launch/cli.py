"""Click commands of the launcher: `hpcft run`, `hpcft submit`, `hpcft clean` — parse, call, print."""
import click

from hpcft.launch.config import model as config
from hpcft.launch.config.command import SectionedCommand, given, run_options


@click.command(cls=SectionedCommand)
@run_options
@click.argument("command", nargs=-1, required=True)
def run(config_file, command, **kwargs) -> None:
    """Run CMD on the allocation's nodes and keep it running: relaunch, replace nodes by spares, requeue.

    Use inside an allocation: `hpcft run --spares 2 --profile frontier -- python train.py`."""
    import logging

    from hpcft.launch.config.detect import devices
    from hpcft.launch.config.resolve import check_node
    from hpcft.launch.supervisor import Supervisor

    # the run's story (start, launch, decision, summary) is in the job output without -v
    story = logging.getLogger("hpcft.events")
    story.setLevel(min(story.getEffectiveLevel(), logging.INFO))
    node = devices()  # this node's GPUs: the profile's default, and the check that the profile fits
    cfg = config.load(given(kwargs), config_file=config_file, node=node)
    check_node(cfg, node)
    import sys  # a successor runs `hpcft run` again with these arguments (launch/node/succession.py)

    click.get_current_context().exit(Supervisor(cfg, command, argv=sys.argv[1:]).run())


@click.command(cls=SectionedCommand)
@run_options
@click.option("--time", "-t", "walltime", default="01:00:00", show_default=True, help="Walltime (sbatch --time).")
@click.option("--account", "-A", default=None, help="sbatch --account.")
@click.option("--partition", "-p", default=None, help="sbatch --partition.")
@click.option("--job-name", "-J", default="hpcft", show_default=True, help="sbatch --job-name.")
@click.option("--output", "-o", default="hpcft-%j.out", show_default=True, help="sbatch --output (appended to).")
@click.option("--warn", "warn_seconds", type=int, default=300, show_default=True,
              help="Seconds before the walltime at which Slurm sends USR1 (persist and requeue).")
@click.option("--module", default="hpcft", show_default=True,
              help="hpcft's own module, loaded after the site's ('' for none).")
@click.option("--site-module", "site_modules", multiple=True,
              help="A site module to load, in order (repeat; replaces [site] modules and the profile's list).")
@click.option("--no-site-modules", is_flag=True, help="Load no site modules.")
@click.option("--setup", "setup", multiple=True,
              help="A shell line setting up the Python environment, e.g. 'source activate /path/env' (repeat; "
                   "replaces [site] setup).")
@click.option("--nvme/--no-nvme", default=None,
              help="Ask for node-local NVMe (-C nvme on Frontier) and export its path as HPCFT_NVME.")
@click.option("--dry-run", is_flag=True, help="Print the batch script instead of submitting it.")
@click.argument("command", nargs=-1, required=True)
def submit(config_file, command, walltime, account, partition, job_name, output, warn_seconds, module, site_modules,
           no_site_modules, setup, nvme, dry_run, **kwargs) -> None:
    """Write the batch script for `hpcft run … -- CMD` (template in slurm/) and submit it; print the job id.

    --nodes counts the active nodes; the allocation is a range from --nodes to --nodes + --spares (the job starts
    with the spares that are free). Site module lines, the Python set-up and NVMe come from the config file's [site]
    table, the flags overriding it (docs/reference/frontier.md)."""
    from dataclasses import replace

    from hpcft.launch.config import site as site_config
    from hpcft.launch.submit import SubmitSpec, render, submit as sbatch
    from hpcft.slurm.runner import default_runner

    cfg = config.load(given(kwargs), config_file=config_file)
    site = site_config.load(config_file)
    if site_modules or no_site_modules:
        site = replace(site, modules=tuple(site_modules))
    if setup:
        site = replace(site, setup=tuple(setup))
    if cfg.launch.nodes is None:
        raise click.UsageError("hpcft submit needs --nodes (the active nodes; spares come on top)")
    forwarded = {k: v for k, v in given(kwargs).items() if v is not None}
    spec = SubmitSpec(command=tuple(command), nodes=cfg.launch.nodes, spares=cfg.launch.spares, time=walltime,
                      profile=cfg.launch.profile, account=account, partition=partition, job_name=job_name,
                      output=output, warn_seconds=warn_seconds, module=module, run_options=forwarded, site=site,
                      nvme=nvme)
    script = render(spec)
    if dry_run:
        click.echo(script, nl=False)
        return
    click.echo(sbatch(script, default_runner()))


@click.command()
@click.option("--job", "job_id", envvar="SLURM_JOB_ID", required=True, help="Job id (default $SLURM_JOB_ID).")
@click.option("--user", default=None, help="Owner of the store (default: you).")
@click.option("--root", default=None, help="Store root (default $HPCFT_STORE_ROOT or /dev/shm).")
@click.option("--force", is_flag=True, help="Remove even if Slurm says a requeue is pending.")
def clean(job_id, user, root, force) -> None:
    """Remove a job's snapshots from this node's memory unless a requeue is pending (as slurm/epilog.sh does)."""
    from hpcft.launch.node.clean import clean as clean_store
    from hpcft.slurm.runner import default_runner

    path, removed, why = clean_store(job_id, runner=default_runner(), user=user, root=root, force=force)
    click.echo(f"{path}: {why}")


@click.command()
@click.argument("job_dir", metavar="JOB_DIR", type=click.Path(file_okay=False, exists=True))
@click.option("--wait", "wait_s", type=float, default=0.0, show_default=True,
              help="Seconds to wait for the agents to report the flush done (0: ask and return).")
def flush(job_dir, wait_s) -> None:
    """Ask a running job's node agents to flush the newest protected step to its durable tier now."""
    import time
    from pathlib import Path

    from hpcft.agent.protection import flush as persist
    from hpcft.agent import status as agent_status

    rendezvous = Path(job_dir) / "agents"
    reports = agent_status.read(rendezvous if rendezvous.is_dir() else job_dir)
    if not reports:
        raise click.ClickException(f"no node agent reports in {rendezvous}: is the job running with agents?")
    rendezvous = rendezvous if rendezvous.is_dir() else Path(job_dir)
    tag = max(reports.values(), key=lambda r: r.get("time", 0))["tag"]
    rid = persist.request(rendezvous, tag)
    click.echo(f"flush requested ({rid}) from the agents of launch {tag}")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        served, durable, error = persist.outcome(list(agent_status.read(rendezvous, tag).values()), rid, len(reports))
        if served and error:
            raise click.ClickException(f"the flush failed: {error}")
        if served:
            click.echo(f"durable step {durable}")
            return
        time.sleep(0.5)
    if wait_s:
        raise click.ClickException(f"the agents did not report the flush done within {wait_s:g} s")
