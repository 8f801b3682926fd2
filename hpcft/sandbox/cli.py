"""`hpcft sandbox up|status|down|crash|restart`."""
import time
from pathlib import Path

import click

from hpcft.errors import SandboxError
from hpcft.sandbox.cluster import Sandbox, ensure_up
from hpcft.sandbox.config import MODES, SandboxConfig, default_dir

dir_option = click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=None,
                          help="Sandbox directory (conf, logs, state) [default: $TMPDIR/hpcft-sandbox-<uid>].")


def sandbox_dir(directory: Path | None) -> Path:
    return directory if directory is not None else default_dir()


@click.group()
def sandbox() -> None:
    """A real local Slurm cluster (slurmctld + N slurmd) on this machine."""


@sandbox.command()
@click.option("--nodes", "-N", default=4, show_default=True, help="Number of slurmd nodes (n1..nN).")
@click.option("--mode", type=click.Choice(MODES), default="netns", show_default=True,
              help="netns: a network namespace, address and hostname per node; local: all on 127.0.0.1.")
@click.option("--ctld-port", type=int, default=None, help="slurmctld port [6817 netns, 17000 local].")
@click.option("--slurmd-port", type=int, default=None, help="slurmd port (local: the first node's) [6818, ctld+1].")
@click.option("--subnet", default="10.77.0", show_default=True, help="netns: /24 used only inside the sandbox.")
@click.option("--confine", is_flag=True, help="Confine steps as a real node does: task/cgroup, task/affinity, "
              "proctrack/cgroup (cgroup v1), 8 fake GPUs per node as GRES; the nodes declare this machine's CPUs.")
@click.option("--accounting/--no-accounting", default=True, show_default=True,
              help="Keep accounts as a real cluster does: slurmdbd and its own MariaDB beside slurmctld (sacct works).")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for every node to be idle.")
@dir_option
def up(nodes: int, mode: str, ctld_port: int | None, slurmd_port: int | None, subnet: str, confine: bool,
       accounting: bool, timeout: float, directory: Path | None) -> None:
    """Start the sandbox and wait until every node is idle (exit 0 if it is already up)."""
    config = SandboxConfig(dir=sandbox_dir(directory), nodes=nodes, mode=mode, ctld_port=ctld_port,
                           slurmd_port=slurmd_port, subnet=subnet, confine=confine, accounting=accounting)
    t0 = time.monotonic()
    sb, started = ensure_up(config, timeout=timeout)
    how = f"up in {time.monotonic() - t0:.1f} s" if started else "already up"
    shape = "".join([", confined" if sb.config.confine else "", "" if sb.config.accounting else ", no accounting"])
    click.echo(f"sandbox {how}: {len(sb.node_names)} nodes, mode {sb.config.mode}{shape}, dir {sb.dir}")
    _print_usage(sb)


def _print_usage(sb: Sandbox) -> None:
    prefix = " ".join(sb.client_prefix())
    click.echo(f"run Slurm commands in it with: SLURM_CONF={sb.layout.slurm_conf} {prefix + ' ' if prefix else ''}"
               f"srun -N{len(sb.node_names)} hostname")


@sandbox.command()
@dir_option
def status(directory: Path | None) -> None:
    """Show the sandbox's daemons and Slurm's state of every node (exit 3 if it is not up)."""
    sb = Sandbox.load(sandbox_dir(directory))
    if not sb.is_up():
        click.echo(f"sandbox in {sb.dir} is recorded but its slurmctld is not running; run `hpcft sandbox down` then "
                   "`up`")
        raise click.exceptions.Exit(3)
    lay = sb.layout
    click.echo(f"sandbox {sb.dir}: mode {sb.config.mode}, controller {lay.ctld_host} {lay.ctld_addr}:{lay.ctld_port} "
               f"(pid {sb.groups['slurmctld'].pid})")
    if sb.config.accounting:
        click.echo(f"accounting: slurmdbd {lay.ctld_addr}:{lay.dbd_port} (pid {sb.groups['slurmdbd'].pid}), MariaDB "
                   f"127.0.0.1:{lay.db_port} there (pid {sb.groups['mariadbd'].pid}), data in {lay.db_dir}")
    states = sb.node_states()
    click.echo(f"{'NODE':<6} {'ADDRESS':<16} {'PORT':<6} {'PIDS':<5} SLURM STATE")
    for node in lay.nodes:
        pids = len(sb.node_pids(node.name))
        click.echo(f"{node.name:<6} {node.addr:<16} {node.port:<6} {pids:<5} {states.get(node.name, '?')}")
    _print_usage(sb)


@sandbox.command()
@dir_option
def down(directory: Path | None) -> None:
    """Stop the sandbox's daemons and remove its namespaces (logs stay in its directory)."""
    path = sandbox_dir(directory)
    try:
        sb = Sandbox.load(path)
    except SandboxError:  # nothing recorded: nothing to stop
        click.echo(f"no sandbox recorded in {path}; nothing to stop")
        return
    sb.down()
    click.echo(f"sandbox in {path} stopped; logs kept in {sb.layout.log_dir}")


@sandbox.command()
@click.argument("node")
@dir_option
def crash(node: str, directory: Path | None) -> None:
    """Crash NODE hard: SIGKILL its slurmd, slurmstepds and tasks (its /dev/shm is lost)."""
    pids = Sandbox.load(sandbox_dir(directory)).crash_node(node)
    click.echo(f"crashed {node}: killed {len(pids)} processes")


@sandbox.command()
@click.argument("node")
@click.option("--timeout", default=30.0, show_default=True)
@dir_option
def restart(node: str, timeout: float, directory: Path | None) -> None:
    """Bring NODE back (a fresh slurmd, empty /dev/shm) and wait until Slurm uses it."""
    Sandbox.load(sandbox_dir(directory)).restart_node(node, timeout=timeout)
    click.echo(f"{node} is back")
