"""The `hpcft` command line: click commands only — parse, call, print."""
import logging
import sys

import click

from hpcft import __version__
from hpcft.errors import HpcftError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcft")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """Fault-tolerant large-model training on Slurm with in-memory checkpointing."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _register() -> None:
    from hpcft.bench.cli import bench
    from hpcft.doctor import doctor
    from hpcft.launch.cli import clean, flush, run, submit
    from hpcft.demo import demo
    from hpcft.durable.cli import export
    from hpcft.sandbox.cli import sandbox
    from hpcft.snapshot.calibration.cli import calibrate
    from hpcft.status import status

    for command in (doctor, sandbox, bench, demo, run, submit, clean, flush, status, export, calibrate):
        cli.add_command(command)


_register()


def main(argv: list[str] | None = None) -> int:
    """Entry point: HpcftError becomes a one-line message and exit status 1, never a traceback."""
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
    # Without standalone mode click returns a command's exit status (from click.exceptions.Exit) as an int.
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
