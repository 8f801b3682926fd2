"""`hpcft submit`: render the sbatch script from a template in slurm/ and submit it through the Runner."""
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcft.env import NVME_ENV
from hpcft.errors import ConfigError, SlurmError
from hpcft.launch.config import profiles
from hpcft.launch.config.netplugin import DIRS_ENV
from hpcft.launch.config.site import SiteConfig
from hpcft.slurm.runner import Runner

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "slurm"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


@dataclass(frozen=True)
class SubmitSpec:
    """What goes into the batch script; `run_options` are forwarded to `hpcft run` as given."""
    command: tuple[str, ...]
    nodes: int
    spares: int = 0
    time: str = "01:00:00"
    profile: str = "cpu"
    account: str | None = None
    partition: str | None = None
    job_name: str = "hpcft"
    output: str = "hpcft-%j.out"
    warn_seconds: int = 300
    module: str = "hpcft"
    run_options: Mapping[str, object] = field(default_factory=dict)
    site: SiteConfig = field(default_factory=SiteConfig)  # module lines, Python setup, NVMe, plugin dirs
    nvme: bool | None = None  # ask for node-local NVMe (None: the site's default)

    @property
    def wants_nvme(self) -> bool:
        return self.site.nvme if self.nvme is None else self.nvme


def template_for(profile: str, template_dir: Path = TEMPLATE_DIR) -> Path:
    """slurm/sbatch-<profile>.sh if there is one, else slurm/sbatch-generic.sh."""
    specific = template_dir / f"sbatch-{profile}.sh"
    path = specific if specific.exists() else template_dir / "sbatch-generic.sh"
    if not path.exists():
        raise ConfigError(f"no sbatch template {path}; hpcft's slurm/ directory is missing from this installation")
    return path


def render_template(text: str, values: Mapping[str, str]) -> str:
    """Fill `{{name}}` placeholders; a placeholder without a value is an error naming it."""
    def fill(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ConfigError(f"sbatch template needs a value for {{{{{m.group(1)}}}}}")
        return values[m.group(1)]
    return _PLACEHOLDER.sub(fill, text)


_WALLTIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def walltime_seconds(text: str) -> int | None:
    """Seconds in a Slurm --time value ("M", "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S"); None for
    "UNLIMITED"/"infinite"; ConfigError for anything else."""
    if text.strip().lower() in ("unlimited", "infinite"):
        return None
    m = _WALLTIME.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"--time {text!r} is not a Slurm time (minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S)")
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # D-H[:M[:S]]
        return ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return (a * 60 + b) * 60 + c
    return a * 60 + (b or 0)  # M or M:S


def _flag(key: str, value: object) -> list[str]:
    name = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [name if value else "--no-" + key.replace("_", "-")]
    return [name, str(value)]


def site_lines(spec: SubmitSpec) -> str:
    """The batch script's environment: the site's modules and set-up, hpcft's module, NVMe's and plugins' exports."""
    site = spec.site
    modules = profiles.get(spec.profile).modules if site.modules is None else site.modules
    lines = [f"module load {m}" for m in modules] + list(site.setup)
    if spec.module:
        lines.append(f"module load {spec.module}")
    if spec.wants_nvme:
        lines.append(f'export {NVME_ENV}="{site.nvme_dir}"  # node-local NVMe (-C {site.nvme_constraint})')
    if site.plugin_dirs:
        lines.append(f'export {DIRS_ENV}="{":".join(site.plugin_dirs)}"')
    return "".join(line + "\n" for line in lines)


def render(spec: SubmitSpec, template_dir: Path = TEMPLATE_DIR) -> str:
    """The batch script for `spec` (a pure function of it: golden-file tested)."""
    if not spec.command:
        raise ConfigError("no training command given: use `hpcft submit [options] -- CMD ...`")
    if spec.nodes < 1 or spec.spares < 0:
        raise ConfigError(f"need at least 1 node and 0 or more spares (got --nodes {spec.nodes} "
                          f"--spares {spec.spares})")
    if not re.fullmatch(r"[\w.-]+", spec.job_name):
        raise ConfigError(f"job name {spec.job_name!r} may use letters, digits, '_', '.' and '-' only")
    limit = walltime_seconds(spec.time)
    if not 0 < spec.warn_seconds <= 65535:
        raise ConfigError(f"--warn {spec.warn_seconds} must be between 1 and 65535 seconds (Slurm's --signal limit)")
    if limit is not None and spec.warn_seconds >= limit:
        raise ConfigError(f"--warn {spec.warn_seconds} s is not shorter than the walltime --time {spec.time} "
                          f"({limit} s): Slurm would send the requeue warning at once; give a smaller --warn or a "
                          "longer --time")
    # every node's CPUs for its tasks: without it a cluster that shares nodes allocates one CPU per node, and the
    # trainer step fails "More processors requested than permitted". --mincpus, not --ntasks-per-node: that fixes
    # the job's task count, and with it its node count, to the least of the range
    tasks = spec.run_options.get("tasks_per_node") or profiles.get(spec.profile).tasks_per_node
    nvme = spec.site.nvme_constraint if spec.wants_nvme else None
    sbatch = [f"#SBATCH --{k}={v}\n" for k, v in (("account", spec.account), ("partition", spec.partition),
                                                  ("mincpus", tasks), ("constraint", nvme)) if v]
    run = ["--nodes", str(spec.nodes), "--spares", str(spec.spares), "--profile", spec.profile]
    for key, value in spec.run_options.items():
        if value is not None and key not in ("nodes", "spares", "profile"):
            run += _flag(key, value)
    values = {
        "job_name": spec.job_name, "active": str(spec.nodes), "spares": str(spec.spares),
        # a range: Slurm starts the job on the nodes in service, spares as many as it has, and a requeued job waits
        # for no spare (in a reservation of its size a lost node's repair can take hours)
        "nodes": f"{spec.nodes}-{spec.nodes + spec.spares}" if spec.spares else str(spec.nodes),
        "time": spec.time, "sbatch_lines": "".join(sbatch),
        "warn_seconds": str(spec.warn_seconds), "output": spec.output,
        "site_lines": site_lines(spec),
        "run_options": shlex.join(run), "command": shlex.join(spec.command),
    }
    return render_template(template_for(spec.profile, template_dir).read_text(encoding="utf-8"), values)


def submit(script: str, runner: Runner, extra: Sequence[str] = ()) -> str:
    """Submit `script` with sbatch (on stdin) and return the job id."""
    out = runner.run(["sbatch", "--parsable", *extra], input=script).stdout.strip()
    job_id = out.split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch did not print a job id (got {out!r})")
    return job_id
