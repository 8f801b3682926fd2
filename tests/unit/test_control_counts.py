"""How `hpcft bench control` reads its counters (hpcft/bench/control.py): sdiag's RPCs by message type, its own and
the node daemons' left out; strace's lines on the job directory, the durable tier's apart. The run itself:
tests/integration/test_bench_control.py."""
from hpcft.bench.control import fs_ops, rpc_counts, rpcs_between

SDIAG = """*******************************************************
sdiag output at Sat Dec 05 13:20:01 2026 (1796476801)
Server thread count:  3
Remote Procedure Call statistics by message type
\tREQUEST_PARTITION_INFO                  ( 2009) count:{part:<6} ave_time:156    total_time:468
\tREQUEST_NODE_INFO                       ( 2007) count:{node:<6} ave_time:220    total_time:660
\tREQUEST_STATS_INFO                      ( 2035) count:{stats:<6} ave_time:95     total_time:190
\tMESSAGE_NODE_REGISTRATION_STATUS        ( 1002) count:4      ave_time:300    total_time:1200

Remote Procedure Call statistics by user
\troot            (       0) count:{node:<6} ave_time:155    total_time:1860
"""


def test_the_jobs_rpcs_are_the_moved_counters_but_sdiags_own():
    before = rpc_counts(SDIAG.format(part=3, node=3, stats=1))
    after = rpc_counts(SDIAG.format(part=4, node=4, stats=2))
    assert before == {"REQUEST_PARTITION_INFO": 3, "REQUEST_NODE_INFO": 3, "REQUEST_STATS_INFO": 1,
                      "MESSAGE_NODE_REGISTRATION_STATUS": 4}  # the per-user section is not read as a type
    job, left_out = rpcs_between(before, after)
    assert job == {"REQUEST_PARTITION_INFO": 1, "REQUEST_NODE_INFO": 1} and left_out == {"REQUEST_STATS_INFO": 1}


def test_fs_ops_count_calls_on_the_job_directory_by_file_the_durable_tier_apart(tmp_path):
    log = tmp_path / "strace.log"
    log.write_text(
        '101 newfstatat(AT_FDCWD, "/x/job/supervisor.alive", {st_mode=S_IFREG|0644, ...}, 0) = 0\n'
        '102 newfstatat(AT_FDCWD, "/x/job/agents/agent-0-stop",  <unfinished ...>\n'
        '102 <... newfstatat resumed>0x7f, 0) = -1 ENOENT (No such file or directory)\n'
        '103 writev(9</x/job/checkpoints/.step-7.1-ab.tmp/__0_0.distcp>, [...], 2) = 4096\n'
        '104 read(5</dev/shm/hpcft-root-1/rank-0.json>, "", 10) = 0\n')
    data, ops = fs_ops(log, "/x/job", "/x/job/checkpoints")
    assert ops == {("newfstatat", "supervisor.alive"): 1, ("newfstatat", "agent-N-stop"): 1}
    assert data == {("writev", "__N_N.distcp"): 1}
