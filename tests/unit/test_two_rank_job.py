"""tests/device/two_rank_job.py, the multi-process job check.sh runs on a machine with several GPUs, run
here on CPU (gloo) with 2 processes, so its logic is exercised on every CI run: init → Checkpointer →
restore → steps, then a relaunch that restores the first run's state bit-identical."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "device" / "two_rank_job.py"


@pytest.mark.slow
def test_two_rank_job_relaunch_restores_bit_identical(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--launch", "2", "--device", "cpu", "--steps", "3",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "two-rank job: ok (2 ranks, cpu" in proc.stdout
    for r in (0, 1):
        assert f"rank {r}/2 first: ok on cpu" in (tmp_path / f"first-rank{r}.log").read_text()
        assert "restored 3, now at step 6" in (tmp_path / f"second-rank{r}.log").read_text()
