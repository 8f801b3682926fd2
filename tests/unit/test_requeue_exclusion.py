"""Which nodes hpcft keeps out of a requeued job's next allocation: never so many that it could not start."""
import subprocess
from pathlib import Path

from hpcft.slurm.state import Placement, affordable, placement


def test_a_suspect_is_kept_out_while_the_pool_has_room_for_the_job():
    states = {n: "IDLE" for n in ("n1", "n2", "n3", "n4")}
    assert affordable(["n2"], states, Placement(3, ["n1", "n2", "n3", "n4"], [])) == ["n2"]


def test_a_suspect_the_job_cannot_start_without_stays_allowed():
    states = {"n1": "ALLOCATED", "n2": "ALLOCATED", "n3": "ALLOCATED", "n4": "DRAIN", "n5": "DOWN*", "n6": "IDLE"}
    pool = ["n1", "n2", "n3", "n4", "n5", "n6"]
    assert affordable(["n2"], states, Placement(4, pool, [])) == []  # n1, n2, n3, n6 in service: all needed
    assert affordable(["n2", "n3"], states, Placement(3, pool, [])) == ["n2"]  # room for one
    assert affordable(["n2"], states, Placement(3, pool, ["n6"])) == []  # the user's --exclude counts too


def test_an_unknown_pool_or_size_keeps_every_suspect_out():
    assert affordable(["n2"], {}, Placement(0, [], [])) == ["n2"]
    assert affordable(["n2"], {}, Placement(2, [], [])) == ["n2"]


class _Slurm:
    """scontrol's answers, as text: the parsing under test, no cluster needed."""

    def __init__(self, answers: dict[str, str]):
        self.answers, self.asked = answers, []

    def run(self, argv, check=True):
        self.asked.append(argv[:3])
        return subprocess.CompletedProcess(argv, 0, self.answers[" ".join(argv[2:3])], "")


def test_placement_reads_the_partitions_or_the_reservation_and_the_jobs_exclusion():
    job = ("JobId=7 JobName=train JobState=RUNNING Partition=batch,extended NumNodes=3-4 NumCPUs=6 "
           "ExcNodeList=frontier[00001-00002] Reservation=(null)")
    slurm = _Slurm({"job": job, "partition": "PartitionName=batch Nodes=frontier[00001-00004] State=UP"})
    got = placement(slurm, "7")
    assert got == Placement(3, ["frontier00001", "frontier00002", "frontier00003", "frontier00004"],
                            ["frontier00001", "frontier00002"])
    assert [a[2] for a in slurm.asked] == ["job", "partition", "partition"]
    slurm = _Slurm({"job": "JobId=7 Partition=batch NumNodes=2 ExcNodeList=(null) Reservation=hero",
                    "reservation": "ReservationName=hero Nodes=frontier[00010-00011] NodeCnt=2"})
    assert placement(slurm, "7") == Placement(2, ["frontier00010", "frontier00011"], [])


class _Requeue(_Slurm):
    """Also the nodes' states and the commands run with SIGTERM ignored (requeue, update), recorded."""

    def __init__(self, answers: dict[str, str], update: list[str] = ("true",), release: list[str] = ("true",),
                 states: dict[str, str] | None = None):
        super().__init__({"config": "AccountingStorageType   = accounting_storage/slurmdbd", **answers})
        self.unkillable, self.timeout, self.update, self.release, self.cwd = [], 5, list(update), list(release), []
        self.states = states or {}

    def run(self, argv, check=True):
        if argv[:3] == ["scontrol", "show", "node"]:  # every node idle, as the repaired ones are, unless said
            said = "\n".join(f"NodeName={n} State={self.states.get(n, 'IDLE')}" for n in argv[4].split(","))
            return subprocess.CompletedProcess(argv, 0, said, "")
        return super().run(argv, check)

    def popen(self, argv, cwd=None, **_):
        self.unkillable.append(argv)
        if argv[-1].startswith("NodeList="):
            self.cwd.append(cwd)
            return subprocess.Popen(self.release, stdout=subprocess.PIPE, text=True)
        return subprocess.Popen(self.update if argv[1] == "update" else ["true"], stdout=subprocess.PIPE, text=True)


def test_a_job_slurm_shrank_keeps_out_only_what_its_whole_allocation_can_spare():
    """A --no-kill job loses a DOWN node from its allocation for good: its NumNodes read 4 for 6 tasks of one per
    node, both lost nodes were excluded by that count, and the requeued job, left 5 of 7 nodes, was never runnable
    (found by hpcft chaos: two nodes of a set lost, then the walltime warning)."""
    from hpcft.slurm.state import requeue

    job = {"job": "JobId=7 Partition=batch NodeList=n[1-5] NumNodes=4 NumTasks=6 ExcNodeList=(null) "
                  "Reservation=(null)", "partition": "PartitionName=batch Nodes=n[1-7] State=UP"}
    slurm = _Requeue(job)
    done = requeue(slurm, "7", ["n4", "n5"], nodes=6)
    assert slurm.unkillable == [["scontrol", "update", "JobId=7", "NodeList=n[1-3,5]"], ["scontrol", "requeue", "7"],
                                ["scontrol", "update", "JobId=7", "ExcNodeList=n4", "StartTime=now+5"]]
    # n5 stays in the job: released while Slurm still took it for healthy, it would be allocated again at once
    assert done.excluded == ["n4"] and done.allowed == ["n5"] and done.released == ["n4"]


def test_a_node_found_bad_in_an_earlier_allocation_is_allowed_again_and_the_users_exclusion_stays():
    """hpcft's exclusions used to pile up for the job's life: a node kept out once (or marked down by Slurm and
    repaired since) stayed out, and seed 1 of the mtbf-60 chaos ran its last 100 minutes on a pool of its exact size,
    each node loss then waiting for a repair. Only a suspect the job still holds is kept out; the last requeue's
    exclusion (`ours`) is lifted, the user's --exclude stays."""
    from hpcft.slurm.state import requeue

    job = {"job": "JobId=7 Partition=batch NodeList=n[1-4] NumNodes=4 ExcNodeList=n[6-7] Reservation=(null)",
           "partition": "PartitionName=batch Nodes=n[1-8] State=UP"}
    slurm = _Requeue(job)
    done = requeue(slurm, "7", ["n6", "n2"], nodes=4, ours=["n6"])
    assert slurm.unkillable[-1] == ["scontrol", "update", "JobId=7", "ExcNodeList=n7,n2", "StartTime=now+5"]
    assert (done.excluded, done.trusted) == (["n2"], ["n6"]) and "n6 (IDLE) allowed again" in done.reason()
    slurm = _Requeue({**job, "job": job["job"].replace("n[6-7]", "n7")})
    done = requeue(slurm, "7", ["n6"], nodes=4, ours=[])  # no exclusion to change: the start time only
    assert slurm.unkillable == [["scontrol", "requeue", "7"], ["scontrol", "update", "JobId=7", "StartTime=now+5"]]
    assert done.trusted == ["n6"]


def test_a_requeue_does_not_wait_for_the_answer_to_its_exclusion_that_slurm_gives_once_the_job_has_ended():
    """slurmctld answers `scontrol update JobId= ExcNodeList=` of a job being requeued only once the job has ended,
    and the batch step it waits for is hpcft run itself: the walltime requeues of hpcft chaos spent ~5 s there, until
    Slurm killed the batch step (KillWait), and said nothing of what was excluded."""
    import time

    from hpcft.slurm.state import UPDATE_ANSWER_S, requeue

    job = {"job": "JobId=7 Partition=batch NodeList=n[1-4] NumNodes=4 NumTasks=4 ExcNodeList=(null) "
                  "Reservation=(null)", "partition": "PartitionName=batch Nodes=n[1-7] State=UP"}
    slurm = _Requeue(job, update=["sleep", "5"])
    started = time.monotonic()
    done = requeue(slurm, "7", ["n4"], nodes=4)
    assert time.monotonic() - started < UPDATE_ANSWER_S + 2  # not the update's 5 s
    assert done.excluded == ["n4"] and slurm.unkillable[-1][-2:] == ["ExcNodeList=n4", "StartTime=now+5"]
    assert "not yet answered" in done.restart


def test_a_job_slurm_requeued_itself_after_a_node_failure_is_still_a_batch_job():
    """Slurm's own requeue (a node failure; a lost batch host back without its script: 'missing from batch node') sets
    BatchFlag=2 ('only one retry'). Read as an salloc, the next run refused to requeue at the walltime warning
    ('requeue not allowed': the job stopped half trained, found by hpcft chaos) and no janitor would take a lost batch
    host over."""
    from hpcft.slurm.state import job_info

    for flag, batch in (("0", False), ("1", True), ("2", True), ("", False)):
        slurm = _Slurm({"job": f"JobId=7 NodeList=n[1-2] TimeLimit=UNLIMITED BatchFlag={flag} Requeue=1 Restarts=3"})
        assert job_info(slurm, "7").batch is batch, flag


def test_a_requeue_with_nothing_to_keep_out_or_lift_reads_nothing():
    """A walltime requeue of a job with no node found bad: no job, partition or node reads (a shared slurmctld)."""
    from hpcft.slurm.state import requeue

    slurm = _Requeue({})
    done = requeue(slurm, "7", [], nodes=4)
    assert (slurm.asked, slurm.unkillable) == ([], [["scontrol", "requeue", "7"],
                                                    ["scontrol", "update", "JobId=7", "StartTime=now+5"]])
    assert done.reason() == "no node was found bad: nothing to keep out of the next allocation"


def test_a_requeued_job_starts_again_seconds_after_the_requeue_not_after_slurms_hold():
    """Slurm holds a requeued job for the credential's lifetime (120 s by default, 10 s in the sandbox: 20 requeues
    were 4.5-5.4 % of each mtbf-60 chaos run's wall time); hpcft sets its start 5 s on. When the update fails, the job
    waits out the hold and the exclusion it carried is reported as not made."""
    from hpcft.slurm.state import requeue

    job = {"job": "JobId=7 Partition=batch NodeList=n[1-4] NumNodes=4 ExcNodeList=(null) Reservation=(null)",
           "partition": "PartitionName=batch Nodes=n[1-8] State=UP"}
    done = requeue(_Requeue(job), "7", ["n2"], nodes=4)
    assert done.excluded == ["n2"] and done.restart.startswith("5 s after the requeue (StartTime=now+5)")
    done = requeue(_Requeue(job, update=["false"]), "7", ["n2"], nodes=4)
    assert (done.excluded, done.unexcluded) == ([], ["n2"]) and done.restart.startswith("after Slurm's requeue hold")
    done = requeue(_Requeue({}, update=["false"]), "7", [], nodes=4)
    assert (done.excluded, done.unexcluded) == ([], []) and "failed (exit status 1" in done.restart


def test_the_lost_nodes_a_job_holds_are_taken_out_of_it_before_its_requeue_never_its_batch_host():
    """A crashed node stays in the job until Slurm marks it down (SlurmdTimeout): the requeued job stayed COMPLETING
    that long, then waited out Slurm's requeue hold (6-31 s per requeue after a node loss in hpcft chaos, against 4-6 s
    after a walltime one). Taken out of the job first, the job ends at once. Slurm refuses to take the batch host; a
    refusal (disable_job_shrink) leaves the requeue as it was."""
    from hpcft.slurm.state import requeue

    job = {"job": "JobId=7 Partition=batch NodeList=n[1-5] NumNodes=5 BatchFlag=1 BatchHost=n1 ExcNodeList=(null) "
                  "Reservation=(null)", "partition": "PartitionName=batch Nodes=n[1-9] State=UP"}
    slurm = _Requeue(job)
    done = requeue(slurm, "7", ["n1", "n3", "n9"], nodes=5)
    assert slurm.unkillable[:2] == [["scontrol", "update", "JobId=7", "NodeList=n[1-2,4-5]"],
                                    ["scontrol", "requeue", "7"]]
    assert done.released == ["n3"] and "n3 taken out of the job before the requeue" in done.reason()
    assert slurm.cwd[0] and not Path(slurm.cwd[0]).exists()  # scontrol's resize scripts land in a directory of ours
    slurm = _Requeue(job, release=["false"])
    done = requeue(slurm, "7", ["n3"], nodes=5)
    assert done.released == [] and slurm.unkillable[1] == ["scontrol", "requeue", "7"] and done.excluded == ["n3"]
    slurm = _Requeue(job)
    assert requeue(slurm, "7", ["n1"], nodes=5).released == []  # the batch host alone: nothing to ask
    assert slurm.unkillable[0] == ["scontrol", "requeue", "7"]
    # not responding yet, not DOWN: not put into ExcNodeList (Slurm allocates it no more), still what the end waits for
    slurm = _Requeue(job, states={"n3": "MIXED+NOT_RESPONDING"})
    done = requeue(slurm, "7", ["n3"], nodes=5)
    assert done.released == ["n3"] and done.excluded == [] and slurm.unkillable[1] == ["scontrol", "requeue", "7"]
    # the batch host lost and taken out by Slurm (hpcft chaos: a janitor's successor supervising on): Slurm refuses
    # every node list without it ("You cannot remove the batch host from a job when resizing"), so none is asked
    gone = {**job, "job": job["job"].replace("NodeList=n[1-5]", "NodeList=n[2-5]")}
    slurm = _Requeue(gone, states={"n3": "MIXED+NOT_RESPONDING"})
    assert requeue(slurm, "7", ["n3"], nodes=5).released == [] and slurm.unkillable[0] == ["scontrol", "requeue", "7"]


def test_a_job_slurm_already_shrank_is_not_shrunk_again_where_slurm_keeps_no_accounting_record():
    """After a resize (a --no-kill job's node marked down) slurmctld without accounting (accounting_storage/none)
    refuses every update of the job until its end, after retrying for 5 s: in seed 2 of the mtbf-60 chaos run such a
    release cost 6 s and released nothing. Through slurmdbd the record is written again at once: released."""
    from hpcft.slurm.state import requeue

    job = {"job": "JobId=7 Partition=batch NodeList=n[1-4] NumNodes=4 BatchFlag=1 BatchHost=n1 ExcNodeList=(null) "
                  "Reservation=(null)", "partition": "PartitionName=batch Nodes=n[1-9] State=UP",
           "config": "ClusterName=frontier\nAccountingStorageType   = accounting_storage/none\nAuthType = auth/munge"}
    slurm = _Requeue(job)
    done = requeue(slurm, "7", ["n3"], nodes=5)  # started with 5, holds 4: shrunk by Slurm
    assert done.released == [] and slurm.unkillable[0] == ["scontrol", "requeue", "7"] and done.excluded == ["n3"]
    slurm = _Requeue(job)
    assert requeue(slurm, "7", ["n3"], nodes=4).released == ["n3"]  # not shrunk: its update is taken
    slurm = _Requeue({**job, "config": "AccountingStorageType   = accounting_storage/slurmdbd"})
    assert requeue(slurm, "7", ["n3"], nodes=5).released == ["n3"]
