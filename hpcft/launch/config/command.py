"""The command line of `hpcft run` and `hpcft submit`, generated from the options model: one click option per field,
`--help` grouped by section and showing the options of a normal day, `--help-all` every one."""
from collections.abc import Callable
from dataclasses import Field, fields

import click

from hpcft.launch.config import model

REFERENCE = "docs/configuration.md"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def describe(spec: Field) -> str:
    """An option's help with its default where the text does not say it."""
    text, default = spec.metadata["help"], spec.default
    if default in (None, "") or "default" in text or len(str(default)) > 40:
        return text
    shown = ("on" if default else "off") if isinstance(default, bool) else f"{default:g}" \
        if isinstance(default, float) else default
    return f"{text} [default: {shown}]"


def _option(name: str, spec: Field) -> click.Option:
    kind, meta = model.kind_of(spec), spec.metadata
    if kind.startswith("bool"):
        return click.Option([f"{flag(name)}/--no-{flag(name)[2:]}", name], default=None, help=describe(spec))
    if meta["choices"]:
        kind_ = click.Choice(meta["choices"])
    else:
        kind_ = str if meta["size"] else int if kind.startswith("int") else float if kind.startswith("float") else str
    metavar = meta["metavar"] or {int: "N", float: "NUM", str: "TEXT"}.get(kind_)
    return click.Option([flag(name), name], type=kind_, default=None, metavar=metavar, help=describe(spec))


def _show_all(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        ctx.meta["help_all"] = True
        click.echo(ctx.get_help(), color=ctx.color)
        ctx.exit()


class SectionedCommand(click.Command):
    """A command whose --help lists its own options, then the model's by section (daily ones unless --help-all)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        every = ctx.meta.get("help_all", False)
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if isinstance(p, click.Option)}
        own = [r for name, r in records.items() if name not in model.OPTIONS and r]
        with formatter.section("Options"):
            formatter.write_dl(own)
        hidden = 0
        for section, cls in model.SECTIONS.items():
            shown = [records[f.name] for f in fields(cls) if every or f.metadata["daily"]]
            hidden += len(fields(cls)) - len(shown)
            if shown:
                with formatter.section(f"{section.capitalize()} options"):
                    formatter.write_dl(shown)
        if hidden:
            formatter.write_paragraph()
            formatter.write_text(f"{hidden} more options: --help-all, or {REFERENCE}. Each is also HPCFT_<NAME> in "
                                 "the environment or a key of the --config file.")


def run_options(f: Callable) -> Callable:
    """The model's options (None: not given, for the environment or file), --config and --help-all, on a command."""
    for name, (_section, spec) in reversed(model.OPTIONS.items()):
        f.__click_params__ = [*getattr(f, "__click_params__", []), _option(name, spec)]  # type: ignore[attr-defined]
    f = click.option("--help-all", is_flag=True, expose_value=False, is_eager=True, callback=_show_all,
                     help="Show every option.")(f)
    return click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                        help="TOML file of options (also $HPCFT_CONFIG); CLI > HPCFT_<NAME> > file.")(f)


def given(kwargs: dict) -> dict:
    """The model's options among a command's arguments."""
    return {k: v for k, v in kwargs.items() if k in model.OPTIONS}


def reference() -> str:
    """docs/configuration.md: every option by section, with its flag, variable, file key, default and help."""
    lines = ["# Configuration reference", "",
             "<!-- generated from hpcft/launch/config/model.py by `python -m hpcft.launch.config.command > "
             f"{REFERENCE}`; CI fails when it is out of date -->", "",
             "Every option of `hpcft run` (and `hpcft submit`, which passes them on) has one name, set in three "
             "places: the command line (`--persist-every 50`), the environment (`HPCFT_PERSIST_EVERY=50`) or the "
             "TOML file given with `--config` or `$HPCFT_CONFIG` (`persist_every = 50` at the top level, in a `[run]` "
             "table or in its section's table, `[durable]`). The command line wins over the environment, which wins "
             "over the file. `hpcft run --help` shows the options of a normal day; `--help-all` shows them all.", ""]
    for section, cls in model.SECTIONS.items():
        lines += [f"## {section}", "", cls.__doc__.strip(), "", "| option | default | meaning |", "|---|---|---|"]
        for spec in fields(cls):
            default = "" if spec.default in (None, "") else f"`{spec.default}`"
            choices = f" One of: {', '.join(spec.metadata['choices'])}." if spec.metadata["choices"] else ""
            lines.append(f"| `{flag(spec.name)}` `{model.env_name(spec.name)}` | {default} | "
                         f"{spec.metadata['help']}{choices} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
