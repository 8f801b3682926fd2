"""Property: whatever a careless or hostile person does to the newest version's manifest or data file (fields,
offsets, sizes, types, file kinds; the manifest's own checksum recomputed or not), restore brings back, bit for bit,
either that version (if what was changed does not matter) or the older intact one, with its RNG and `extra`; never
wrong bytes, never an exception that is not an hpcft error, never a hang. 1,000 random cases over 10 stores."""
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcft.checkpointer import Checkpointer
from hpcft.errors import HpcftError
from hpcft.options import Options
from hpcft.snapshot import rng as hrng
from hpcft.snapshot.state import collect
from hpcft.store import manifest

from live_state import state_of  # tests/unit is on sys.path (pytest's rootdir insertion)

BATCHES, CASES = 10, 100
ODD = [None, True, False, -1, 0, 1, 3, 2 ** 40, 0.5, "", "x", "2", [], {}, [1, 2, 3], {"a": 1}]


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 24), torch.nn.Linear(24, 3))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


class Pristine:
    """Two committed versions (steps 1 and 2) of one rank, kept as bytes to put back before each case, with what
    a restore of each must bring back."""

    def __init__(self, root: Path, seed: int):
        self.root = root
        model, opt = _model(seed)
        self.expect: dict[int, tuple[dict, dict, Any]] = {}
        with Checkpointer(model, opt, Options(root=root, job_id="j", chunk_bytes=128 * (1 + seed % 3)),
                          extra=lambda: {"seed": seed, "n": len(self.expect) + 1}) as c:
            for it in range(2):
                model(torch.randn(5, 4)).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
                self.expect[it + 1] = (state_of(model, opt), hrng.encode(hrng.grab()), {"seed": seed, "n": it + 1})
            c.wait()
            self.dir = c.store.dir
            self.files = {}
            for v in c.store.versions():
                data = c.store.slot(v.slot).array[:v.manifest["data_bytes"]].tobytes()
                self.files[v.step] = (v.slot, (self.dir / f"slot-{v.slot}.json").read_bytes(), data)

    def put_back(self) -> None:
        for p in self.dir.iterdir():
            if p.name != "writer.lock":
                p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        for slot, mbytes, data in self.files.values():
            for name, raw in ((f"slot-{slot}.json", mbytes), (f"slot-{slot}.data", data)):
                fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, raw)
                os.close(fd)

    def paths(self, step: int) -> tuple[Path, Path]:
        slot = self.files[step][0]
        return self.dir / f"slot-{slot}.json", self.dir / f"slot-{slot}.data"


def _pick(r: random.Random, m: Any) -> tuple[list, Any]:
    """A random node of the manifest's JSON tree (a top-level field first, then deeper with falling odds)."""
    path, node = [], m
    while isinstance(node, (dict, list)) and node and (not path or r.random() < 0.6):
        key = r.choice(sorted(node)) if isinstance(node, dict) else r.randrange(len(node))
        path.append(key)
        node = node[key]
    return path, node


def _mutated(r: random.Random, node: Any) -> tuple[Any, str]:
    op = r.random()
    if isinstance(node, int) and not isinstance(node, bool) and op < 0.6:
        delta = r.choice([-1, 1, -64, 64, 4096, -node, node, 2 ** 33])
        return node + delta, f"{node:+d}{delta:+d}"
    if isinstance(node, list) and node and op < 0.6:
        node = list(node)
        how = r.choice(["drop", "dup", "swap", "cut"])
        i, j = r.randrange(len(node)), r.randrange(len(node))
        if how == "drop":
            del node[i]
        elif how == "dup":
            node.insert(i, node[j])
        elif how == "swap":
            node[i], node[j] = node[j], node[i]
        else:
            node = node[:i]
        return node, f"list {how}"
    if isinstance(node, dict) and node and op < 0.5:
        node = dict(node)
        del node[r.choice(sorted(node))]
        return node, "key dropped"
    value = r.choice(ODD)
    return value, f"set to {value!r}"


def _mutate_manifest(r: random.Random, path: Path) -> str:
    m = json.loads(path.read_bytes())
    where, node = _pick(r, m)
    value, how = _mutated(r, node)
    if where:
        parent = m
        for key in where[:-1]:
            parent = parent[key]
        parent[where[-1]] = value
    resign = r.random() < 0.9
    path.write_bytes(manifest.encode(m) if resign else json.dumps(m).encode())
    return f"manifest {'/'.join(map(str, where))} {how}{'' if resign else ' (checksum stale)'}"


def _replace_file(r: random.Random, path: Path, other: Path) -> str:
    """Put something else where a store file is: another kind of file, the other version's file, or nothing."""
    kind = r.choice(["fifo", "directory", "symlink", "missing", "world-readable", "foreign", "other's bytes", "empty"])
    raw = path.read_bytes()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        path.mkdir(0o700)
    elif kind == "symlink":
        path.symlink_to(other)
    elif kind in ("world-readable", "foreign", "other's bytes", "empty"):
        path.write_bytes({"other's bytes": other.read_bytes(), "empty": b""}.get(kind, raw))
        path.chmod(0o644 if kind == "world-readable" else 0o600)
        if kind == "foreign":
            os.chown(path, 65534, 65534)
    return f"{path.name} replaced: {kind}"


def _mutate_data(r: random.Random, path: Path) -> str:
    raw = bytearray(path.read_bytes())
    how = r.choice(["flip", "cut", "extend"])
    if how == "flip":
        i = r.randrange(len(raw))
        raw[i] ^= 1 << r.randrange(8)
        what = f"bit flipped at {i}"
    elif how == "cut":
        raw = raw[:r.randrange(len(raw))]
        what = f"cut to {len(raw)} bytes"
    else:
        raw += os.urandom(r.randrange(1, 300))
        what = "extended"
    path.write_bytes(raw)
    return f"data {what}"


def _mutate(r: random.Random, pristine: Pristine) -> str:
    mpath, dpath = pristine.paths(2)
    older_m, older_d = pristine.paths(1)
    x = r.random()
    if x < 0.6:
        return _mutate_manifest(r, mpath)
    if x < 0.7:
        return _replace_file(r, mpath, older_m)
    if x < 0.85:
        return _mutate_data(r, dpath)
    return _replace_file(r, dpath, older_d)


@pytest.mark.timeout(240)
def test_random_mutations_restore_the_newest_intact_version_bit_exact(shm_root: Path, monkeypatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    monkeypatch.delenv("HPCFT_EVENT_DIR")  # 1,000 restores' events are not what this test looks at
    outcomes = {1: 0, 2: 0}
    for batch in range(BATCHES):
        (shm_root / f"b{batch}").mkdir()
        pristine = Pristine(shm_root / f"b{batch}", seed=batch)
        r = random.Random(batch)
        model, opt = _model(seed=100 + batch)  # one live model per batch (its optimizer state made by the first restore)
        for case in range(CASES):
            pristine.put_back()
            what = _mutate(r, pristine)
            with torch.no_grad():  # nothing of a previous case's restore may pass for this one's
                for e in collect(model, opt, None):
                    e.local.fill_(-1.0 - case)
            try:
                with Checkpointer(model, opt, Options(root=pristine.root, job_id="j")) as c:
                    step = c.restore()
                    tensors, rng_now, extra = state_of(model, opt), hrng.encode(hrng.grab()), c.extra
            except HpcftError as exc:
                pytest.fail(f"batch {batch} case {case} ({what}): the intact step 1 was not restored: {exc}")
            except Exception as exc:  # the property: nothing but an hpcft error, ever
                pytest.fail(f"batch {batch} case {case} ({what}): {type(exc).__name__}: {exc}")
            assert step in (1, 2), f"batch {batch} case {case} ({what}): restored step {step}"
            want_tensors, want_rng, want_extra = pristine.expect[step]
            assert tensors.keys() == want_tensors.keys(), what
            bad = [k for k in tensors if not torch.equal(tensors[k], want_tensors[k])]
            assert not bad and rng_now == want_rng and extra == want_extra, \
                f"batch {batch} case {case} ({what}): step {step} restored with other bytes: {bad or 'rng/extra'}"
            outcomes[step] += 1
    assert outcomes[1] > 0 and outcomes[2] > 0, outcomes  # both kinds of mutation were drawn
