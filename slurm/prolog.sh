#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/path/to/slurm/prolog.sh): before a job runs on this node, remove the hpcft
# snapshot stores that no job can resume from any more. The epilog keeps a store whenever it cannot be sure the
# job is over (scontrol did not answer), so such leftovers are swept here, once Slurm says their job has ended
# or has forgotten it. A pending (requeued) job's store is kept. Always exits 0: a failing prolog drains the node.
root=${HPCFT_STORE_ROOT:-/dev/shm}
# Opt-in (set in the prolog's environment by the site): HPCFT_SHM_HUGE=within_size remounts the store's tmpfs so
# that new files come in 2 MiB pages; a relaunched rank then maps a snapshot without one page fault per 4 KiB
# (hpcft/store/hugepages.py; `hpcft doctor` shows the store's pages). Files already there keep their pages.
case "${HPCFT_SHM_HUGE:-}" in
  always|within_size)
    if mountpoint -q "$root" && [ "$(stat -f -c %T "$root" 2>/dev/null)" = tmpfs ]; then
      mount -o remount,huge="$HPCFT_SHM_HUGE" "$root" 2>/dev/null ||
        logger -t hpcft-prolog "job ${SLURM_JOB_ID:-?}: could not remount $root huge=$HPCFT_SHM_HUGE" 2>/dev/null
    fi ;;
esac
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
