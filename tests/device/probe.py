"""Where a GPU snapshot's time goes (#15 item 3), on a lent GPU machine: `rates`: the device→host copy into
registered /dev/shm pages alone, the host crc32c of those bytes on 1..8 threads alone and while the copy runs;
`kernel`: the device checksum's rate and its equality with the host's crc32c; `start`: a profile of the training
thread's snapshot calls; `restore`: a warm and a relaunch's restore into the GPU, timed and profiled; `bench`: the
snapshot bench's hpcft variant, with `--no-crc` the host checksum left out.
Prints one JSON object per measurement."""
import argparse
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from hpcft.store import crc32c

GB = 1e9


def _shm(nbytes: int) -> np.ndarray:
    fd = os.open(f"/dev/shm/hpcft-probe-{os.getpid()}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        buf = np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    finally:
        os.unlink(f"/dev/shm/hpcft-probe-{os.getpid()}")
        os.close(fd)
    buf[::4096] = 1  # fault every page in
    return buf


def _crc_all(pool: ThreadPoolExecutor, host: np.ndarray, chunk: int) -> float:
    t0 = time.perf_counter()
    list(pool.map(lambda lo: crc32c(host[lo:lo + chunk]), range(0, host.size, chunk)))
    return time.perf_counter() - t0


def rates(nbytes: int) -> None:
    host_np = _shm(nbytes)
    host = torch.from_numpy(host_np)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)) == 0
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def d2h() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            host.copy_(src, non_blocking=True)
        stream.synchronize()
        return time.perf_counter() - t0

    d2h(), d2h()
    print(json.dumps({"probe": "d2h_into_registered_shm", "GBps": nbytes / min(d2h() for _ in range(3)) / GB}))
    for threads in (1, 2, 4, 8):
        with ThreadPoolExecutor(threads) as pool:
            _crc_all(pool, host_np, 4 << 20)
            alone = min(_crc_all(pool, host_np, 4 << 20) for _ in range(2))
            with torch.cuda.stream(stream):  # the crc of the bytes while a copy writes the same amount of memory
                host.copy_(src, non_blocking=True)
            both = _crc_all(pool, host_np, 4 << 20)
            stream.synchronize()
        print(json.dumps({"probe": "host_crc32c", "threads": threads, "GBps": nbytes / alone / GB,
                          "GBps_during_d2h": nbytes / both / GB}))
    cudart.cudaHostUnregister(host.data_ptr())


def kernel(nbytes: int) -> None:
    """The device checksum alone over `nbytes` of device memory in 4 MiB chunks: bit-equal to the host's crc32c, and
    its rate for a few kernel shapes (CUDA events)."""
    from hpcft.snapshot import devcrc, plan

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    chunks = plan.chunks(plan.layout([nbytes], [], 0, 1).pieces, nbytes, 4 << 20)
    host = src.cpu().numpy()
    want = [crc32c(host[c.offset:c.offset + c.nbytes]) for c in chunks]
    for lanes, words in ((128, 128), (64, 256), (128, 64), (256, 64)):
        crc = devcrc.DeviceCrc(torch.device("cuda"), lanes=lanes, words=words)
        p = crc.plan([src], chunks, set())
        crc.launch(p)
        torch.cuda.synchronize()
        ok = devcrc.finish(p, host) == want
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(5):
            crc.launch(p)
        t1.record()
        torch.cuda.synchronize()
        s = t0.elapsed_time(t1) / 5 / 1e3
        print(json.dumps({"probe": "device_crc", "lanes": lanes, "words": words, "equal_to_host": ok,
                          "ms": s * 1e3, "GBps": nbytes / s / GB}))


def start_profile(params: int, batch: int) -> None:
    """cProfile of 8 snapshot calls (`Checkpointer.step`) of the bench model on the GPU: where the training thread's
    share goes."""
    import cProfile
    import pstats
    import tempfile

    from hpcft.bench.model import Trainer, config_for_params
    from hpcft.checkpointer import Checkpointer
    from hpcft.options import Options

    trainer = Trainer(config_for_params(params, batch), device="cuda")
    trainer.step()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        ckpt = Checkpointer(trainer.model, trainer.optimizer, Options(root=root, job_id="probe", auto=False))
        print(json.dumps({"probe": "copier", "checksums": ckpt.engine.copier.checksums}))
        for i in range(4):
            trainer.step()
            ckpt.step(i)
        ckpt.wait()
        prof = cProfile.Profile()
        for i in range(4, 12):
            trainer.step()
            prof.enable()
            ckpt.step(i)
            prof.disable()
        ckpt.wait()
        st = ckpt.stats.as_dict()
        print(json.dumps({"probe": "start", "start_ms": 1e3 * st["start_s"] / st["snapshots"],
                          "blocked_ms": 1e3 * st["blocked_s"] / st["snapshots"]}))
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(22)
        ckpt.close()


def restore_profile(params: int, batch: int, root: str) -> None:
    """Where a restore into the GPU goes: the warm restore (the same Checkpointer) and the relaunch's (a new
    Checkpointer + `restore()`; 0.65 s against 0.14 s warm on an H200, half a second unexplained), each timed three
    times and profiled once (cumulative: the Checkpointer's construction, the store's mapping, the copies)."""
    import cProfile
    import pstats
    import tempfile

    from hpcft.bench.model import Trainer, config_for_params
    from hpcft.checkpointer import Checkpointer
    from hpcft.options import Options

    trainer = Trainer(config_for_params(params, batch), device="cuda")
    trainer.step()
    with tempfile.TemporaryDirectory(dir=root) as where:
        def made() -> Checkpointer:
            return Checkpointer(trainer.model, trainer.optimizer, Options(root=where, job_id="probe", auto=False))

        def timed(cold: bool, prof: "cProfile.Profile | None" = None) -> dict[str, float]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            ckpt = made() if cold else warm
            t1 = time.perf_counter()
            ckpt.restore()
            torch.cuda.synchronize()
            if prof:
                prof.disable()
            t2 = time.perf_counter()
            if cold:
                ckpt.close()
            return {"construct_ms": 1e3 * (t1 - t0), "restore_ms": 1e3 * (t2 - t1)}

        warm = made()
        warm.step(0)
        warm.wait()
        for cold in (False, True):
            runs = [timed(cold) for _ in range(3)]
            print(json.dumps({"probe": "restore", "cold": cold, "runs": runs}))
            prof = cProfile.Profile()
            timed(cold, prof)
            pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(30)
        warm.close()


def bench(no_crc: bool, params: int, batch: int, steps: int, block: int, root: str) -> None:
    from hpcft.bench.snapshot import SnapshotOptions, run

    if no_crc:
        import hpcft.snapshot.copiers.stream as stream

        stream.crc32c = lambda buf, crc=0: 0
    r = run(SnapshotOptions(params=params, steps=steps, block=block, device="cuda", batch=batch, root=root,
                            baselines=False, flush_every=0)).as_dict()
    keys = ("overhead_hpcft", "blocked_fraction_hpcft", "blocked_s_per_snapshot", "start_s_per_snapshot",
            "step_s_none", "copy_GBps", "copy_GBps_in_training", "memcpy_GBps", "cpu_overhead_hpcft")
    print(json.dumps({"probe": "snapshot_bench", "no_crc": no_crc, **{k: r.get(k) for k in keys},
                      "variants": r.get("variants")}, default=str))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["rates", "bench", "kernel", "start", "restore"])
    ap.add_argument("--bytes", type=float, default=2.4e9)
    ap.add_argument("--no-crc", action="store_true")
    ap.add_argument("--params", type=lambda t: float(t[:-1]) * 1e6 if t[-1] in "Mm" else float(t), default=200e6)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--root", default="/dev/shm")
    a = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    if a.what == "rates":
        rates(int(a.bytes))
    elif a.what == "kernel":
        kernel(int(a.bytes))
    elif a.what == "start":
        start_profile(int(a.params), a.batch)
    elif a.what == "restore":
        restore_profile(int(a.params), a.batch, a.root)
    else:
        bench(a.no_crc, int(a.params), a.batch, a.steps, a.block, a.root)
