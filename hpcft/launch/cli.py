"""Click commands of the launcher: `hpcft run`, `hpcft submit`, `hpcft clean` — parse, call, print."""
import click

from hpcft.launch.config import options as config


def _run_options(f):
    """The supervisor's options, shared by `run` and `submit` (None = not given, so the environment or the
    config file may set it)."""
    options = [
        click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                     help="TOML file of options (also $HPCFT_CONFIG); CLI > HPCFT_<NAME> > file."),
        click.option("--nodes", type=int, default=None, help="Active nodes (default: allocation minus spares)."),
        click.option("--spares", type=int, default=None, help="Spare nodes that replace failed ones."),
        click.option("--profile", type=click.Choice(["frontier", "cuda", "cpu"]), default=None,
                     help="Machine profile (tasks per node, srun options, library environment)."),
        click.option("--tasks-per-node", type=int, default=None, help="Override the profile's tasks per node."),
        click.option("--max-restarts", type=int, default=None, help="Relaunches before giving up."),
        click.option("--hang-timeout", type=float, default=None, help="Seconds without a completed step = hang (0: off)."),
        click.option("--start-timeout", type=float, default=None,
                     help="With --hang-timeout: seconds a launch may take to its first completed step (0: the hang "
                          "timeout)."),
        click.option("--poll-interval", type=float, default=None, help="Seconds between checks."),
        click.option("--kill-grace", type=float, default=None, help="Seconds between SIGTERM and SIGKILL of a step."),
        click.option("--requeue-margin", type=float, default=None,
                     help="Requeue instead of relaunching with less walltime left than this (s)."),
        click.option("--requeue/--no-requeue", default=None, help="Allow `scontrol requeue`."),
        click.option("--job-dir", default=None, help="Events, decisions, progress (default ./hpcft-<job id>)."),
        click.option("--srun-args", default=None, help="Extra srun options for the trainer step (one string)."),
        click.option("--probe-timeout", type=float, default=None, help="Seconds a node health probe may take."),
        click.option("--loss-timeout", type=float, default=None,
                     help="Seconds without a heartbeat after which a node agent names its peer a suspect, whose node "
                          f"is then probed (default {config.LOSS_TIMEOUT_S:g}; 0: no heartbeats)."),
        click.option("--protect", type=click.Choice(list(config.PROTECT_SCHEMES)), default=None,
                     help="Node agents' in-memory protection scheme (default auto: xor from 3 nodes, partner on 2, "
                          "none on 1; none: no agents)."),
        click.option("--group", type=int, default=None, help="Protection set size (xor, rs; default 4)."),
        click.option("--losses", type=int, default=None, help="Node losses tolerated per set (rs; default 1)."),
        click.option("--distance", type=int, default=None, help="Partner distance in slots (partner; default 1)."),
        click.option("--protect-rate", type=float, default=None, help="Bytes/s cap on protection traffic."),
        click.option("--protect-timeout", type=float, default=None,
                     help="Seconds the agents may take to be ready (rebuild included) before the trainers start."),
        click.option("--protect-lag", type=int, default=None,
                     help="Steps the newest protected snapshot may trail the newest one: the agents' CPU cap rises "
                          "while it does (default: the profile's fixed cap)."),
        click.option("--persist-dir", default=None,
                     help="Durable tier (torch.distributed.checkpoint layout) on a shared file system (default "
                          "<job dir>/checkpoints; none: no flushing)."),
        click.option("--persist-every", type=int, default=None,
                     help="Flush every this many steps of protection progress (default 100; always before a requeue)."),
        click.option("--persist-keep", type=int, default=None, help="Durable checkpoints kept (default 2)."),
        click.option("--persist-rate", type=float, default=None, help="Bytes/s cap on each node's flush writes."),
        click.option("--persist-local", default=None,
                     help="Node-local first level of the durable tier, drained to --persist-dir (default "
                          "$HPCFT_NVME/hpcft-persist with `hpcft submit --nvme`; $VARs expanded per node; none: off)."),
        click.option("--agent-iface", default=None,
                     help="Network interface the node agents bind to (default: the profile's, hsn0 on Frontier)."),
        click.option("--agent-transport", type=click.Choice(list(config.AGENT_TRANSPORTS)), default=None,
                     help="What carries the node agents' bulk data and agreements: tcp (default) or mpi (mpi4py over "
                          "the site's MPI; the heartbeats stay on TCP)."),
        click.option("--agent-mpi", default=None,
                     help="With --agent-transport mpi: the srun MPI plugin of the agents' step (default: the "
                          "profile's, pmix; cray_shasta on Frontier)."),
        click.option("--keep", type=int, default=None, help="The Checkpointer's keep, for memory planning (default 2)."),
        click.option("--state-bytes", default=None,
                     help="One snapshot's bytes per node (e.g. 120G): checked against the nodes' memory before launch."),
        click.option("--node-memory", default=None,
                     help="Memory per node to plan with (e.g. 512G; default: the batch host's /dev/shm and MemAvailable)."),
        click.option("--memory-headroom", type=float, default=None,
                     help="Fraction of node memory left to the trainers and the system (default 0.2)."),
        click.option("--elastic/--no-elastic", default=None,
                     help="No spare left when a node is lost: continue on fewer nodes, resharded from memory."),
        click.option("--min-nodes", type=int, default=None,
                     help="With --elastic: below this many active nodes, requeue instead (default: 1)."),
        click.option("--elastic-batch", type=click.Choice(list(config.ELASTIC_BATCH)), default=None,
                     help="What a shrink keeps: the global batch (more accumulation) or each replica's (default "
                          "keep-global)."),
        click.option("--elastic-grow/--no-elastic-grow", default=None,
                     help="With --elastic: grow back toward --nodes when nodes of the allocation return to service."),
        click.option("--grow-settle", type=float, default=None,
                     help="Seconds a returned node must stay healthy before it is taken back (default 60; doubled "
                          "for each earlier loss of that node)."),
        click.option("--grow-every", type=float, default=None,
                     help="At most one grow per this many seconds after the last shrink or grow (default 300)."),
        click.option("--grow-max-losses", type=int, default=None,
                     help="A node lost more often than this in the run is not taken back (default 2)."),
        click.option("--straggler-factor", type=float, default=None,
                     help="A node whose ranks' own share of a step is this many times the other nodes' median is a "
                          "straggler (default 1.5; 0: off)."),
        click.option("--straggler-window", type=float, default=None,
                     help="Seconds of steps judged together for a straggler (default 30)."),
        click.option("--evict-stragglers/--no-evict-stragglers", default=None,
                     help="Replace a straggler's node with a spare at the next protected step."),
        click.option("--standby/--no-standby", default=None,
                     help="Warm standby processes on every node run the trainers' `python SCRIPT` (default on): a "
                          "relaunch starts no interpreter."),
        click.option("--preload", default=None,
                     help="Comma-separated modules the standbys import before a launch (default: torch, torch._dynamo, "
                          "numpy, hpcft's training side, ...)."),
        click.option("--stage-env/--no-stage-env", default=None,
                     help="Copy the Python environment to node-local storage (sbcast) and start every step from it "
                          "(default: on with the frontier profile and node-local NVMe, else off)."),
        click.option("--stage-dir", default=None,
                     help="Node-local directory for --stage-env, the same path on every node (default $HPCFT_NVME, "
                          "else /tmp)."),
        click.option("--stage-cache", default=None,
                     help="Where --stage-env keeps its archives, named by content (default <job dir>/stage)."),
        click.option("--copy", default=None,
                     help="The trainers' CPU snapshot/restore copy method, as HPCFT_COPY: auto (calibrated per host, "
                          "the default), default, or pinned, e.g. stream,threads=2,chunk=1M."),
        click.option("--adopt", default=None, metavar="JOB",
                     help="Resume from job JOB's snapshots in the nodes' memory too (another job's are refused)."),
        click.option("--lost-progress-exit", type=int, default=None, metavar="N",
                     help="Exit status of a run that finished but lost progress on the way (default "
                          f"{config.LOST_PROGRESS_EXIT}; 0: exit 0)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _cli_values(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k in config.KEYS}


@click.command(context_settings={"ignore_unknown_options": False})
@_run_options
@click.argument("command", nargs=-1, required=True)
def run(config_file, command, **kwargs) -> None:
    """Run CMD on the allocation's nodes and keep it running: relaunch, replace nodes by spares, requeue.

    Use inside an allocation: `hpcft run --spares 2 --profile frontier -- python train.py`."""
    import logging

    from hpcft.launch.supervisor import Supervisor

    # the run's story (start, launch, decision, summary) is in the job output without -v
    story = logging.getLogger("hpcft.events")
    story.setLevel(min(story.getEffectiveLevel(), logging.INFO))
    cfg = config.load(_cli_values(kwargs), config_file=config_file)
    click.get_current_context().exit(Supervisor(cfg, command).run())


@click.command()
@_run_options
@click.option("--time", "-t", "walltime", default="01:00:00", show_default=True, help="Walltime (sbatch --time).")
@click.option("--account", "-A", default=None, help="sbatch --account.")
@click.option("--partition", "-p", default=None, help="sbatch --partition.")
@click.option("--job-name", "-J", default="hpcft", show_default=True, help="sbatch --job-name.")
@click.option("--output", "-o", default="hpcft-%j.out", show_default=True, help="sbatch --output (appended to).")
@click.option("--warn", "warn_seconds", type=int, default=300, show_default=True,
              help="Seconds before the walltime at which Slurm sends USR1 (persist and requeue).")
@click.option("--module", default="hpcft", show_default=True, help="hpcft's own module, loaded after the site's ('' for none).")
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

    --nodes counts the active nodes; the allocation is --nodes + --spares. Site module lines, the Python set-up
    and NVMe come from the config file's [site] table, the flags overriding it (docs/supervisor.md)."""
    from dataclasses import replace

    from hpcft.launch.config import site as site_config
    from hpcft.launch.submit import SubmitSpec, render, submit as sbatch
    from hpcft.slurm.runner import default_runner

    cfg = config.load(_cli_values(kwargs), config_file=config_file)
    site = site_config.load(config_file)
    if site_modules or no_site_modules:
        site = replace(site, modules=tuple(site_modules))
    if setup:
        site = replace(site, setup=tuple(setup))
    if cfg.nodes is None:
        raise click.UsageError("hpcft submit needs --nodes (the active nodes; spares come on top)")
    forwarded = {k: v for k, v in _cli_values(kwargs).items() if v is not None}
    spec = SubmitSpec(command=tuple(command), nodes=cfg.nodes, spares=cfg.spares, time=walltime, profile=cfg.profile,
                      account=account, partition=partition, job_name=job_name, output=output,
                      warn_seconds=warn_seconds, module=module, run_options=forwarded, site=site, nvme=nvme)
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
