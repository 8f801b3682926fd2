"""The `hpcft` command line: click commands only — parse, call, print."""
import importlib
import logging
import sys

import click

from hpcft import __version__, deps
from hpcft.errors import HpcftError

# Each command's "module:attribute" and the first sentence of its help, which `hpcft --help` shows without importing
# the module: one command's missing dependency (crc32c, zfec, mpi4py, torch) must not break the others, nor doctor.
COMMANDS = {
    "doctor": ("hpcft.doctor:doctor", "Report Slurm, torch device backend, RCCL/NCCL and its network plugin, the copy "
               "kernel, hip-python, mpi4py, /dev/shm and NVMe; exit 1 if an essential is missing."),
    "sandbox": ("hpcft.sandbox.cli:sandbox", "A real local Slurm cluster (slurmctld + N slurmd) on this machine."),
    "bench": ("hpcft.bench.cli:bench", "Benchmarks."),
    "chaos": ("hpcft.chaos.cli:chaos", "Train under hpcft while faults of every kind arrive at a mean interval; "
              "report goodput against a torch.save baseline."),
    "report": ("hpcft.report.cli:report", "Print a run's summary from its job directory and draw its timeline (PNG): "
               "steps against wall time, each fault and decision marked."),
    "demo": ("hpcft.demo:demo", "A 4-node Slurm sandbox, `hpcft doctor`, an srun step, then training that survives a "
             "node crash."),
    "run": ("hpcft.launch.cli:run", "Run CMD on the allocation's nodes and keep it running: relaunch, replace nodes by "
            "spares, requeue."),
    "submit": ("hpcft.launch.cli:submit", "Write the batch script for `hpcft run … -- CMD` (template in slurm/) and "
               "submit it; print the job id."),
    "clean": ("hpcft.launch.cli:clean", "Remove a job's snapshots from this node's memory unless a requeue is pending "
              "(as slurm/epilog.sh does)."),
    "flush": ("hpcft.launch.cli:flush", "Ask a running job's node agents to flush the newest protected step to its "
              "durable tier now."),
    "status": ("hpcft.status:status", "Versions held per node and rank, their protection state, agent heartbeats and "
               "each protection set's health."),
    "export": ("hpcft.durable.cli:export", "Copy a complete durable checkpoint out of a persist directory (an ended "
               "job's, or any)."),
    "calibrate": ("hpcft.snapshot.calibration.cli:calibrate", "Measure the CPU snapshot/restore copy methods (kernel, "
                  "threads, chunk size) on this host, under 2 s, and cache them at the store root for every later "
                  "run; HPCFT_COPY, when set, is shown instead (it pins the method)."),
}


class LazyGroup(click.Group):
    """A group that imports a command's module only when that command runs or shows its own help (COMMANDS)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            module, attr = COMMANDS[cmd_name][0].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands' table from COMMANDS' help, shortened as click shortens a command's own, importing none."""
        limit = formatter.width - 6 - max(map(len, COMMANDS))
        with formatter.section("Commands"):
            formatter.write_dl([(name, click.Command(name, help=text).get_short_help_str(limit))
                                for name, (_, text) in sorted(COMMANDS.items())])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcft")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """Fault-tolerant large-model training on Slurm with in-memory checkpointing."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    """Entry point: HpcftError or a missing dependency becomes a one-line message and exit status 1, never a
    traceback."""
    try:
        result = cli.main(args=argv, prog_name="hpcft", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except HpcftError as exc:
        click.echo(f"hpcft: error: {exc}", err=True)
        return 1
    except ModuleNotFoundError as exc:  # a dependency this environment lacks: name it and how to install it
        if (exc.name or "hpcft").split(".")[0] == "hpcft":
            raise
        click.echo(f"hpcft: error: {deps.missing(exc.name, 'this command', exc)}", err=True)
        return 1
    # Without standalone mode click returns a command's exit status (from click.exceptions.Exit) as an int.
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
