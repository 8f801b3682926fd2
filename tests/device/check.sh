#!/usr/bin/env bash
# The GPU check, run on a lent GPU machine from the repository root (no Slurm there, no network), on ROCm
# (rocm-smi, hip-python) and CUDA (nvidia-smi) machines alike: the device copy path's tests, a 2-process job
# through hpcft.init → Checkpointer → restore → relaunch when two or more GPUs are visible, then
# `hpcft bench snapshot` and `hpcft bench restore` on the GPU (BENCH=0 skips the long benches; BASELINES=0 leaves
# torch.save and dcp.async_save out of the snapshot bench, seconds a step each at 200M; PROBE=1 adds
# tests/device/probe.py: the device checksum's rate, a profile of the snapshot calls, copy and host-checksum rates,
# with PROBES="... restore" a warm and a relaunch's restore into the GPU timed and profiled;
# RESTORE=0 skips the restore bench). Results go to $OUT (default ./device-out).
# Wheels for that machine's Python (crc32c, zfec, hip-python) may be carried in .whl/ (docs/results.md,
# the snapshot section).
set -u
OUT=${OUT:-device-out}; mkdir -p "$OUT"
PARAMS=${PARAMS:-200M}; BATCH=${BATCH:-24}; STEPS=${STEPS:-12}; BLOCK=${BLOCK:-4}; BENCH=${BENCH:-1}
BASELINES=${BASELINES:-1}; PROBE=${PROBE:-0}; TESTS=${TESTS:-1}; SMOKE=${SMOKE:-1}
# the device tool brings back at most 8 files: everything also goes back as one archive
trap 'tar -C "$OUT" -czf /tmp/device-out.tgz . && rm -f "$OUT"/*.err "$OUT"/*.txt && mv /tmp/device-out.tgz "$OUT/all.tgz"' EXIT
base=--baselines; [ "$BASELINES" = 0 ] && base=--no-baselines
SITE=/tmp/site; mkdir -p "$SITE"
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
fi

# ROCm: the hip backend needs hip-python of the machine's ROCm version (hip-python X.Y.Z.* fits ROCm X.Y.Z)
hip_build=$(python3 -c "import torch; print(torch.version.hip or '')" 2>/dev/null)
if [ -n "$hip_build" ] && ! python3 -c "from hip import hip" 2>/dev/null; then
    rocm=$(cut -d- -f1 "${ROCM_PATH:-/opt/rocm}/.info/version" 2>/dev/null)
    [ -n "$rocm" ] || rocm=$(echo "$hip_build" | cut -d. -f1,2)  # torch's HIP build: major.minor only
    echo "hip-python absent: installing hip-python==$rocm.* for ROCm $rocm"
    python3 -m pip install -q --no-deps --target "$SITE" "hip-python==$rocm.*" \
        || python3 -m pip install -q --no-deps --target "$SITE" "hip-python==$(echo "$rocm" | cut -d. -f1,2).*" \
        || echo "hip-python could not be installed (no registry here? carry its wheel in .whl/): the hip backend's GPU tests are skipped"
fi

# the streaming-store copy kernel, built in place as `make setup` does (a checkout carries no built library)
python3 setup.py -q build_ext --inplace >"$OUT/kernel-build.txt" 2>&1 || echo "copy kernel not built: copies use memcpy (see $OUT/kernel-build.txt)"

{ if command -v nvidia-smi >/dev/null; then nvidia-smi -L
  elif command -v rocm-smi >/dev/null; then rocm-smi --showproductname
  else echo "neither nvidia-smi nor rocm-smi on PATH"; fi
  df -h /dev/shm /tmp; echo "ulimit -l: $(ulimit -l)"; nproc
  python3 -c "import torch, crc32c; print('torch', torch.__version__, 'hip', torch.version.hip, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPU(s):', torch.cuda.get_device_name())"
  python3 -c "from hip import hip; import hip as h; print('hip-python', getattr(h, '__version__', 'installed'))" 2>/dev/null || echo "hip-python: not importable"
  python3 -c "from hpcft.store import ntcopy; print('copy kernel:', ntcopy.probe()[1])"; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# the store needs (keep + 1) snapshots of the state: /dev/shm if it holds them, else node-local disk
need=$(python3 -c "import sys; p=sys.argv[1].upper(); print(int(float(p.rstrip('MG')) * {'M': 1e6, 'G': 1e9}.get(p[-1], 1)) * 12 * 3 // 1024)" "$PARAMS")
root=/dev/shm; [ "$(df -k --output=avail /dev/shm | tail -1)" -gt "$need" ] || root=/tmp
echo "store root: $root"
[ "$TESTS" = 0 ] || timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/unit/test_snapshot_gpu.py tests/unit/test_snapshot_stream.py \
    tests/unit/test_snapshot_hip.py 2>&1 | tee "$OUT/pytest.txt"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$ngpu" -ge 2 ]; then
    timeout 200 python3 tests/device/two_rank_job.py --launch 2 --timeout 90 --out "$OUT/two-rank" 2>&1 | tee "$OUT/two-rank.txt"
else
    echo "two-process job: skipped ($ngpu GPU(s) visible, it needs 2)" | tee "$OUT/two-rank.txt"
fi
if [ "$SMOKE" = 1 ]; then
    timeout 90 bin/hpcft bench snapshot --device cuda --params 1M --steps 2 $base --root "$root" --json \
        >"$OUT/smoke.json" 2>"$OUT/smoke.err" && echo "smoke bench: ok" || { echo "smoke bench failed:"; tail -30 "$OUT/smoke.err"; }
fi
[ "$BENCH" = 0 ] && { echo "bench: skipped (BENCH=0)"; exit 0; }
if [ "$PROBE" = 1 ]; then
    for what in ${PROBES:-kernel start rates}; do
        timeout 120 python3 tests/device/probe.py $what --params "$PARAMS" --batch "$BATCH" 2>&1 | tee "$OUT/probe-$what.txt"
    done
fi
timeout 330 bin/hpcft bench snapshot --device cuda --params "$PARAMS" --batch "$BATCH" --steps "$STEPS" --block "$BLOCK" --root "$root" \
    $base --flush-every "${FLUSH_EVERY:-5}" --runs "${RUNS:-1}" --json >"$OUT/snapshot-gpu.json" 2>"$OUT/snapshot-gpu.err"
echo "bench rc=$?"; cat "$OUT/snapshot-gpu.err" | tail -40
# the restore of the same state from the host store into device memory, against a pinned host->device copy
[ "${RESTORE:-1}" = 0 ] && exit 0
timeout 240 bin/hpcft bench restore --device cuda --params "$PARAMS" --repeats 3 --root "$root" \
    --json >"$OUT/restore-gpu.json" 2>"$OUT/restore-gpu.err"
echo "restore bench rc=$?"; tail -25 "$OUT/restore-gpu.err"
