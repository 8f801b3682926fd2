#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/path/to/slurm/prolog.sh): before a job runs on this node, remove the hpcft
# snapshot stores that no job can resume from any more. The epilog keeps a store whenever it cannot be sure the
# job is over (scontrol did not answer), so such leftovers are swept here, once Slurm says their job has ended
# or has forgotten it. A pending (requeued) job's store is kept. Always exits 0: a failing prolog drains the node.
root=${HPCFT_STORE_ROOT:-/dev/shm}
for dir in "$root"/hpcft-*-*; do
  [ -d "$dir" ] && [ ! -L "$dir" ] || continue
  job=${dir##*-}
  case "$job" in *[!0-9]*|"") continue ;; esac
  [ "$job" = "${SLURM_JOB_ID:-}" ] && continue
  if line=$(scontrol show job -o "$job" 2>&1); then
    state=$(printf %s "$line" | tr ' ' '\n' | sed -n 's/^JobState=//p')
  else
    case "$line" in
      *"Invalid job id"*) state=FORGOTTEN ;;  # ended long enough ago that slurmctld purged it (MinJobAge)
      *) continue ;;                            # slurmctld did not answer: decide another time
    esac
  fi
  case "$state" in
    COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED|FORGOTTEN)
      rm -rf -- "$dir"
      logger -t hpcft-prolog "job ${SLURM_JOB_ID:-?}: removed $dir (job $job $state)" 2>/dev/null ;;
  esac
done
exit 0
