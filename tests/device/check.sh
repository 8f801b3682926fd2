#!/usr/bin/env bash
# The GPU check, run on a lent GPU machine from the repository root (no Slurm there, no network): the
# device copy path's tests, then `hpcft bench snapshot` on the GPU. Results go to $OUT (default ./device-out).
# Wheels of crc32c and zfec for that machine's Python may be carried in .whl/ (docs/benchmarks.md).
set -u
OUT=${OUT:-device-out}; mkdir -p "$OUT"
PARAMS=${PARAMS:-200M}; BATCH=${BATCH:-24}; STEPS=${STEPS:-12}; BLOCK=${BLOCK:-4}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; df -h /dev/shm /tmp; echo "ulimit -l: $(ulimit -l)"; nproc
  python3 -c "import torch, crc32c; print('torch', torch.__version__, torch.cuda.get_device_name())"; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# the store needs (keep + 1) snapshots of the state: /dev/shm if it holds them, else node-local disk
need=$(python3 -c "import sys; p=sys.argv[1].upper(); print(int(float(p.rstrip('MG')) * {'M': 1e6, 'G': 1e9}.get(p[-1], 1)) * 12 * 3 // 1024)" "$PARAMS")
root=/dev/shm; [ "$(df -k --output=avail /dev/shm | tail -1)" -gt "$need" ] || root=/tmp
echo "store root: $root"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/unit/test_snapshot_gpu.py tests/unit/test_snapshot_stream.py \
    2>&1 | tee "$OUT/pytest.txt"
timeout 90 bin/hpcft bench snapshot --device cuda --params 1M --steps 2 --root "$root" --json \
    >"$OUT/smoke.json" 2>"$OUT/smoke.err" && echo "smoke bench: ok" || { echo "smoke bench failed:"; tail -30 "$OUT/smoke.err"; }
timeout 330 bin/hpcft bench snapshot --device cuda --params "$PARAMS" --batch "$BATCH" --steps "$STEPS" --block "$BLOCK" --root "$root" \
    --json >"$OUT/snapshot-gpu.json" 2>"$OUT/snapshot-gpu.err"
echo "bench rc=$?"; cat "$OUT/snapshot-gpu.err" | tail -40
