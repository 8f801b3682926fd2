#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/path/to/slurm/epilog.sh): remove the job's hpcft snapshot store from this
# node's memory when the job is over — but keep it while a requeue is pending, since the requeued job resumes
# from it. Runs as root with SLURM_JOB_ID and SLURM_JOB_USER set. `hpcft clean` does the same by hand.
job=${SLURM_JOB_ID:-}
user=${SLURM_JOB_USER:-}
[ -n "$job" ] && [ -n "$user" ] || exit 0
root=${HPCFT_STORE_ROOT:-/dev/shm}
safe() { printf %s "$1" | tr -c 'A-Za-z0-9_.-' '_'; }
dir="$root/hpcft-$(safe "$user")-$(safe "$job")"
[ -d "$dir" ] || exit 0
# Ending a requeued run and ending the job both show JobState=COMPLETING here. What tells them apart: the store
# records the Slurm restart count of the run that wrote it (hpcft.store.paths.mark_run); a requeue has moved
# Slurm's count (SLURM_JOB_RESTART_COUNT) past it.
ran=$(cat "$dir/slurm-run" 2>/dev/null)
now=${SLURM_JOB_RESTART_COUNT:-0}
if [ -n "$ran" ] && [ -z "$(printf %s "$ran$now" | tr -d 0-9)" ] && [ "$now" -gt "$ran" ]; then
  logger -t hpcft-epilog "job $job requeued (run $ran over, restart count now $now): keeping $dir" 2>/dev/null
  exit 0
fi
state=$(scontrol show job -o "$job" 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p')
case "$state" in
  "")  # slurmctld did not answer: the job may be requeued, and a checkpoint is never dropped on a guess
    logger -t hpcft-epilog "job $job: state unknown (scontrol failed): keeping $dir; remove it with hpcft clean" 2>/dev/null
    exit 0 ;;
  PENDING|REQUEUED|REQUEUE_HOLD|REQUEUE_FED|CONFIGURING|RESIZING|SUSPENDED)
    logger -t hpcft-epilog "job $job is $state: keeping $dir for its next run" 2>/dev/null
    exit 0 ;;
esac
rm -rf -- "$dir"
logger -t hpcft-epilog "job $job ($state): removed $dir" 2>/dev/null
exit 0
