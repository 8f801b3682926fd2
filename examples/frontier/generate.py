"""Write the examples' Frontier batch scripts (examples/frontier/NAME.sbatch) with `hpcft submit --dry-run --profile
frontier`: 4 nodes of 8 GCDs (one rank per GCD) and a spare, each example at a size a GCD holds, 2 hours.

  python examples/frontier/generate.py           # rewrite the scripts (after a change here or to slurm/sbatch-*.sh)
  python examples/frontier/generate.py --check   # exit 1, naming them, if the scripts are not what it would write

The scripts carry no site set-up: add yours with `[site]` in $HPCFT_CONFIG or `--setup` (docs/reference/frontier.md) and
submit from the checkout's root (`sbatch examples/frontier/ddp.sbatch`: the command names examples/NAME.py).
"""
import os
import subprocess
import sys
from pathlib import Path

from hpcft.launch.config.sections import DEFAULT_PRELOAD

HERE = Path(__file__).resolve().parent
SUBMIT = ("--profile", "frontier", "--nodes", "4", "--spares", "1", "-t", "02:00:00")
COMMON = ("--steps", "5000", "--vocab", "32000", "--seq", "2048", "--log-every", "50")
# per example: its own `hpcft run` options and a model a 64 GB GCD holds with its activations (TP 8 and FSDP2 shard a
# model DDP could not hold; FSDP2 keeps every layer's activations whole, hence its smaller batch)
JOBS = {
    "ddp": ((), ("--width", "2048", "--layers", "16", "--heads", "16", "--batch", "4")),
    "tp": ((), ("--width", "4096", "--layers", "16", "--heads", "32", "--batch", "4")),
    "fsdp2": ((), ("--width", "4096", "--layers", "24", "--heads", "32", "--batch", "2")),
    "llama": (("--preload", f"{DEFAULT_PRELOAD},transformers.models.llama.modeling_llama"),  # no rank imports it
              ("--width", "2048", "--layers", "16", "--heads", "16", "--batch", "4")),
}


def render(name: str) -> str:
    """The batch script of examples/NAME.py, as `hpcft submit --dry-run` prints it; no HPCFT_* setting of this shell
    (a config file, an option's variable) leaks into it."""
    run_options, size = JOBS[name]
    argv = [sys.executable, "-m", "hpcft.cli", "submit", "--dry-run", *SUBMIT, "-J", f"hpcft-{name}",
            "-o", f"hpcft-{name}-%j.out", *run_options, "--", "python", f"examples/{name}.py", *COMMON, *size]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCFT_")}
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout


def main(argv: list[str]) -> int:
    stale = []
    for name in JOBS:
        path, text = HERE / f"{name}.sbatch", render(name)
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"not current: {', '.join(stale)}; run python examples/frontier/generate.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
