"""The agents' settings as one JSON object (hpcft/agent/settings.py): what `to_json` writes `from_json` reads back
equal; a key unknown, a node's own or of the wrong type is refused by name, and `python -m hpcft.agent` says so."""
import json
import signal

import pytest

from hpcft.agent.__main__ import main
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.settings import AgentConfig
from hpcft.durable.settings import PersistConfig
from hpcft.errors import ConfigError


def test_the_settings_round_trip_and_leave_the_node_s_own_fields_out():
    cfg = AgentConfig("/job/agents", secret_file="/job/secret", layout=("n1", "n2"), host="auto", iface="hsn0",
                      scheme=Scheme("rs", 4, 2), rate=5e8, rounds=0, lag_bound=3, loss_timeout=0,
                      persist=PersistConfig("/lustre/ckpt", every=5, rate=1e9, local="/nvme/$USER"), transport="mpi")
    text = cfg.to_json()
    assert AgentConfig.from_json(text) == cfg
    data = json.loads(text)
    assert data["scheme"] == {"name": "rs", "group": 4, "losses": 2, "distance": 1}
    assert not {"job_id", "slot", "slots", "secret", "bind", "tag", "rebuild", "root"} & set(data)


@pytest.mark.parametrize("text, named", [
    ('{"rendezvous": "/r", "rouds": 2}', "unknown key 'rouds'"),
    ('{"rendezvous": "/r", "slot": 1}', "unknown key 'slot'"),  # the node's own: derived there, never sent
    ('{"rendezvous": "/r", "rounds": "2"}', "rounds='2' is not of type int"),
    ('{"rendezvous": "/r", "rounds": true}', "rounds=True is not of type int"),
    ('{"rendezvous": "/r", "rate": "fast"}', "rate='fast' is not of type float or NoneType"),
    ('{"rendezvous": "/r", "layout": "n1,n2"}', "layout='n1,n2' is not of type tuple"),
    ('{"rendezvous": "/r", "persist": {"evry": 1}}', "unknown key 'persist.evry'"),
    ('{"rendezvous": "/r", "scheme": {"group": "4"}}', "scheme.group='4' is not of type int"),
    ('{"rendezvous": "/r", "transport": "ucx"}', "transport 'ucx' is neither tcp nor mpi"),
    ('[1]', "must be a JSON object"),
    ('{"rendezvous": ', "not JSON"),
])
def test_a_wrong_key_is_refused_by_name(text, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        AgentConfig.from_json(text)


@pytest.fixture
def sigterm():
    """main() installs the agent's SIGTERM handler: this process gets its own back."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_the_agent_reads_its_settings_from_a_file_or_inline_and_names_what_is_wrong(tmp_path, capsys, sigterm):
    settings = tmp_path / "settings-0.json"
    settings.write_text(AgentConfig(str(tmp_path), layout=("elsewhere",)).to_json())
    assert main(["--settings", str(settings), "--job-id", "7"]) == 1  # this node is not in the layout
    assert "has no slot in the layout elsewhere" in capsys.readouterr().err
    assert main(["--settings", '{"rendezvous": "/r", "nice": 1.5}', "--job-id", "7"]) == 1
    assert "nice=1.5 is not of type int" in capsys.readouterr().err
    assert main(["--settings", str(tmp_path / "missing.json"), "--job-id", "7"]) == 1
    assert "cannot read the agent settings" in capsys.readouterr().err
