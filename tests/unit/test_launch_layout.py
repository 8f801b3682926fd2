"""Slots, spares, profiles, options precedence and per-task ranks of `hpcft run` (pure, no Slurm)."""
import pytest

from hpcft.env import job_env
from hpcft.errors import ConfigError
from hpcft.launch.config import model as config
from hpcft.launch.config import resolve
from hpcft.launch.config import profiles
from hpcft.launch.policy.layout import Layout, NoSpareError, given_back, run_shape
from hpcft.launch.node.srun import master_port, step_env, task_env

NODES = ["n1", "n2", "n3", "n4", "n5", "n6"]


def test_plan_takes_active_then_spares_in_allocation_order():
    lay = Layout.plan(NODES, spares=2, tasks_per_node=2)
    assert lay.slots == ("n1", "n2", "n3", "n4") and lay.spares == ("n5", "n6")
    assert lay.world_size == 8 and lay.master == "n1"
    assert [lay.rank("n3", i) for i in range(2)] == [4, 5]


def test_spare_takes_the_failed_slot_and_ranks_keep_their_roles():
    lay = Layout.plan(NODES, spares=2, tasks_per_node=2)
    new, moved = lay.replace(["n3"])
    assert moved == {"n3": "n5"}
    assert new.slots == ("n1", "n2", "n5", "n4") and new.spares == ("n6",) and new.excluded == ("n3",)
    assert new.rank("n5", 1) == lay.rank("n3", 1) == 5
    assert new.rank("n4", 0) == lay.rank("n4", 0)


def test_a_failed_spare_is_dropped_and_a_bad_node_stays_excluded():
    lay, _ = Layout.plan(NODES, spares=2).replace(["n6"])
    assert lay.slots == ("n1", "n2", "n3", "n4") and lay.spares == ("n5",)
    again = Layout.plan(NODES, active=4, excluded=lay.excluded)  # e.g. after a requeue on the same nodes
    assert "n6" not in again.slots + again.spares


def test_no_spare_left_is_an_error_and_leaves_the_layout_alone():
    lay = Layout.plan(NODES[:4], spares=1)
    lay, _ = lay.replace(["n1"])
    with pytest.raises(NoSpareError, match="no spare node is left"):
        lay.replace(["n2"])


def test_a_requeued_job_keeps_each_node_that_comes_back_in_its_slot():
    # before the requeue: n4 had taken n2's slot, then n3 failed with no spare left
    previous = ("n1", "n4", "n3")
    lay = Layout.plan(["n1", "n4", "n5", "n6"], active=3, spares=1, excluded=["n2", "n3"], previous=previous)
    assert lay.slots == ("n1", "n4", "n5") and lay.spares == ("n6",)
    shuffled = Layout.plan(["n5", "n6", "n4", "n1"], active=3, spares=1, previous=previous)
    assert shuffled.slots == ("n1", "n4", "n5") and shuffled.spares == ("n6",)
    # a different active count (the user changed -N): the old slots mean nothing
    assert Layout.plan(NODES, active=4, previous=previous).slots == ("n1", "n2", "n3", "n4")


def test_only_a_new_allocation_gives_an_excluded_node_back():
    # a requeued job's allocation holds n3 again: Slurm put it back in service
    assert given_back(["n3", "n5"], ["n1", "n2", "n3", "n4"], successor=False) == ["n3"]
    # a successor's allocation is the one n3 was lost in, still listing it until Slurm marks it down (chaos, seed 1:
    # a third-generation successor took the just-crashed n3 for a spare, and lost it again 5 s later)
    assert given_back(["n3", "n5"], ["n1", "n2", "n3", "n4", "n5"], successor=True) == []


def test_too_few_nodes_names_the_counts():
    with pytest.raises(ConfigError, match="4 active \\+ 3 spare node\\(s\\) need 7 nodes, but the allocation has 6"):
        Layout.plan(NODES, active=4, spares=3)


def test_layout_round_trips_through_env():
    lay, _ = Layout.plan(NODES, spares=2, tasks_per_node=8).replace(["n2"])
    back = Layout.from_env(lay.to_env())
    assert back.slots == lay.slots and back.tasks_per_node == 8


def test_each_task_gets_its_slot_ranks_whatever_srun_order():
    lay, _ = Layout.plan(NODES, spares=2, tasks_per_node=2).replace(["n1"])  # n5 is slot 0 and the master
    base = step_env(lay, job_id="1234", restart_count=1, job_dir="/jobs/1234")
    env = {**base, **task_env({**base, "SLURMD_NODENAME": "n5", "SLURM_LOCALID": "1"})}
    assert (env["RANK"], env["LOCAL_RANK"], env["HPCFT_NODE_RANK"]) == ("1", "1", "0")
    assert env["MASTER_ADDR"] == "n5" and env["WORLD_SIZE"] == "8"
    seen = job_env(env)  # what hpcft.init() reads
    assert (seen.source, seen.rank, seen.local_rank, seen.world_size, seen.node_rank) == ("hpcft", 1, 1, 8, 0)
    assert seen.nodelist == ["n5", "n2", "n3", "n4"] and seen.restart_count == 1
    assert seen.master_port == master_port("1234", 1) != master_port("1234", 0)


def test_task_on_a_node_without_slot_is_refused():
    base = Layout.plan(NODES, spares=2).to_env()
    with pytest.raises(ConfigError, match="node n6 has no slot"):
        task_env({**base, "SLURMD_NODENAME": "n6", "SLURM_LOCALID": "0"})


def test_profile_env_never_overrides_the_user():
    got = profiles.env_defaults(profiles.get("frontier"), {"NCCL_SOCKET_IFNAME": "hsn1"}, user="u", job="7")
    assert "NCCL_SOCKET_IFNAME" not in got
    assert got["MIOPEN_USER_DB_PATH"] == "/tmp/hpcft-miopen-u-7" and got["FI_CXI_DEFAULT_CQ_SIZE"] == "131072"
    with pytest.raises(ConfigError, match="unknown profile 'summit'; choose one of: frontier, cuda, cpu"):
        profiles.get("summit")


def test_options_cli_beats_environment_beats_file(tmp_path):
    cfg_file = tmp_path / "hpcft.toml"
    cfg_file.write_text("spares = 1\nmax-restarts = 7\nhang_timeout = 30\nprofile = 'frontier'\n")
    env = {"HPCFT_SPARES": "2", "HPCFT_HANG_TIMEOUT": "45", "HPCFT_RANK": "3"}  # HPCFT_RANK is not an option
    cfg = config.load({"spares": 3, "hang_timeout": None}, env, cfg_file)
    assert (cfg.launch.spares, cfg.recovery.hang_timeout, cfg.recovery.max_restarts, cfg.launch.profile) == (3, 45.0, 7, "frontier")
    assert config.load({}, {"HPCFT_CONFIG": str(cfg_file)}).launch.spares == 1
    assert config.load({}, {}).launch.spares == 0


def test_unknown_or_bad_option_is_named_with_the_valid_ones(tmp_path):
    cfg_file = tmp_path / "hpcft.toml"
    cfg_file.write_text("[run]\nspare = 2\n")
    with pytest.raises(ConfigError, match="unknown option 'spare'; valid options: nodes, spares, profile"):
        config.load({}, {}, cfg_file)
    with pytest.raises(ConfigError, match="HPCFT_SPARES: spares='two' is not a valid int"):
        config.load({}, {"HPCFT_SPARES": "two"})
    with pytest.raises(ConfigError, match="max_restarts must be 0 or more"):
        config.load({"max_restarts": -1}, {})


def test_protection_options_from_file_environment_and_cli(tmp_path):
    cfg_file = tmp_path / "hpcft.toml"
    cfg_file.write_text("protect = 'rs'\ngroup = 4\nlosses = 2\n")
    cfg = config.load({"protect_rate": None}, {"HPCFT_PROTECT_RATE": "5e8"}, cfg_file)
    assert (cfg.protection.protect, cfg.protection.group, cfg.protection.losses, cfg.protection.protect_rate, cfg.protection.protected) == ("rs", 4, 2, 5e8, True)
    assert cfg.protection.scheme().tolerated == 2
    assert config.load({}, {}).protection.protect == "auto" and config.load({}, {}).protection.protect_rate is None
    assert not config.load({"protect": "none"}, {}).protection.protected


@pytest.mark.parametrize("active,want", [(1, ("none", None)), (2, ("partner", None)), (3, ("xor", 3)), (4, ("xor", 4)),
                                         (9, ("xor", 4))])
def test_the_default_protects_wherever_the_allocation_allows_it(active, want):
    cfg = resolve.resolve_protect(config.load({}, {}), active)
    assert (cfg.protection.protect, cfg.protection.group) == want
    assert resolve.resolve_protect(config.load({"protect": "rs", "losses": 2}, {}), active).protection.protect == "rs"


@pytest.mark.parametrize("options,message", [
    ({"protect": "raid"}, "protect='raid' is not one of auto, none, partner, xor, rs: choose one"),
    ({"protect": "xor", "losses": 2}, "xor tolerates exactly one loss"),
    ({"protect": "rs", "group": 2, "losses": 2}, "rs needs 1 <= losses < group"),
    ({"protect": "xor", "protect_rate": 0}, "protect_rate must be positive"),
    ({"protect": "xor", "protect_timeout": -1}, "protect_timeout must be 0 or more"),
])
def test_bad_protection_options_are_named(options, message):
    with pytest.raises(ConfigError, match=message):
        config.load(options, {})


def test_a_run_takes_the_spares_its_allocation_has_and_a_requeued_one_grows_back_where_it_can():
    assert run_shape(0, 4, 2, 6, successor=False) == (4, 2)
    assert run_shape(0, 4, 2, 5, successor=False) == (4, 1)  # Slurm filled the range --nodes=4-6 with 5
    assert run_shape(0, 4, 2, 3, successor=False) == (4, 0)  # too few for the active nodes: check_shape says so
    assert run_shape(0, None, 1, 5, successor=False) == (None, 1)  # no --nodes: the allocation less the spares
    assert run_shape(4, 4, 2, 5, successor=False) == (4, 1)  # requeued onto the 5 nodes in service
    assert run_shape(3, 4, 2, 6, successor=False) == (4, 2)  # shrunk (--elastic), requeued: grows back
    assert run_shape(3, 4, 2, 3, successor=False) == (3, 0)  # not enough nodes to grow back
    assert run_shape(3, 4, 2, 5, successor=True) == (3, 2)  # a successor runs the slots as they were
    assert run_shape(4, None, 1, 5, successor=False) == (4, 1)  # --nodes not given: the slots it ran
