"""The durable tier in `hpcft bench snapshot`: hpcft every step with a real node agent flushing every k steps
(`overhead_hpcft_flush`), and one flush's bandwidth against a plain sequential write of the same bytes to the same
directory (`flush_vs_write`)."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcft.agent.transport import secret as job_secret
from hpcft.agent import status as agent_status
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.settings import AgentConfig
from hpcft.bench.snapshot_variants import Hpcft
from hpcft.durable import files, flush
from hpcft.durable.settings import PersistConfig
from hpcft.errors import HpcftError
from hpcft.store import job_dir, secure_dir
from hpcft.store import pin as store_pin

JOB = "bench-flush"


class HpcftFlush(Hpcft):
    """hpcft every step into its own store, and a node agent (one slot, no protection) flushing the newest snapshot
    to `persist` every `every` steps while training goes on. A block ends once a flush in progress has finished:
    the wait counts as blocked (conservative: a real run would overlap it with its next steps)."""

    name = "hpcft_flush"

    def __init__(self, trainer, root: Path, persist: Path, every: int) -> None:
        store_pin.announce(secure_dir(job_dir(root, JOB)))  # the store keeps a slot free for the agent's pin
        self.shared = Path(tempfile.mkdtemp(prefix="agents-", dir=root))
        job_secret.create(self.shared)
        env = {**os.environ, "HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(self.shared)}
        settings = AgentConfig(str(self.shared), secret_file=str(self.shared / job_secret.NAME), scheme=Scheme("none"),
                               rounds=0, interval=0.1, cpu_share=0, persist=PersistConfig(str(persist), every=every))
        argv = [sys.executable, "-m", "hpcft.agent", "--settings", settings.to_json(), "--job-id", JOB, "--slot", "0",
                "--slots", "1"]
        self.agent = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        super().__init__(trainer, root, job_id=JOB)

    def finish(self) -> None:
        super().finish()
        t0 = time.perf_counter()
        while any(s.get("flushing") for s in agent_status.read(self.shared, "0").values()):
            if self.agent.poll() is not None:
                raise HpcftError(f"the bench's agent ended: {self.agent.stderr.read()[-2000:]}")
            time.sleep(0.01)
        self.per_call["blocked_s"][self._last] += time.perf_counter() - t0

    def durable(self) -> int | None:
        st = agent_status.read(self.shared, "0").get(0) or {}
        return st.get("persisted")

    def close(self) -> None:
        agent_status.request_stop(self.shared, "0")
        try:
            self.agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.agent.kill()
        super().close()


def flush_vs_write(hp: Hpcft, directory: Path, repeats: int = 3) -> tuple[float, float]:
    """(flush bytes/s, plain write bytes/s): the newest snapshot of `hp` written by `flush.write_rank` (verified,
    as DCP records, fsynced) and the same number of bytes written from the same memory as one file (fsynced),
    interleaved, medians of `repeats`."""
    version = hp.ckpt.store.versions()[-1]
    data = hp.ckpt.store.slot(version.slot, create=False).array[:version.manifest["data_bytes"]]
    flush_s, write_s, nbytes = [], [], 0
    for i in range(repeats):
        ckpt = files.make_dir(directory / f"flush-{i}")
        files.make_dir(flush.sidecar_dir(ckpt))
        t0 = time.perf_counter()
        nbytes = flush.write_rank(version.manifest, data, ckpt)["file_bytes"]
        flush_s.append(time.perf_counter() - t0)
        path = directory / f"plain-{i}"
        t0 = time.perf_counter()
        fd = files.create(path)
        files.write_all(fd, data, path)
        files.finish(fd, path)
        write_s.append(time.perf_counter() - t0)
    return nbytes / statistics.median(flush_s), data.size / statistics.median(write_s)
