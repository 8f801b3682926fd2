"""`hpcft bench scale` at a tiny N (8 real agent processes on loopback): the JSON contract and sanity of its figures,
never their values in time; the growth fit on plain numbers."""
import json
import math
import subprocess
import sys

from hpcft.bench.scale import growth, loopback

KEYS = ("setup_s", "agree_ms", "agree_cpu_ms", "sockets_per_agent", "beat_Bps_per_agent")


def test_scale_json_at_eight_agents():
    proc = subprocess.run([sys.executable, "-m", "hpcft.cli", "bench", "scale", "--agents", "2,8", "--rounds", "3",
                           "--window", "1.5", "--json"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    assert out["bench"] == "scale" and out["agents"] == [2, 8]
    for key in KEYS:
        assert set(out[key]) == {"2", "8"}, key
    for n, p in out["per_n"].items():
        n = int(n)
        assert p["setup_s"] > 0 and p["agree_ms"] > 0 and p["agree_cpu_ms"] > 0
        assert p["agree_hops"] == math.ceil(math.log2(n))
        assert p["silent_named"] == 0  # nobody was silent: heartbeats flowed
        assert p["beat_Bps_per_agent"] is None or p["beat_Bps_per_agent"] > 0
        # every connection is a socket; beyond them a constant few (two listeners and their wake-up pairs)
        assert p["connections_per_agent"] <= p["set_peers"] + 2 * p["overlay_peers"]
        assert p["connections_per_agent"] <= p["sockets_per_agent"] <= p["connections_per_agent"] + 8
    eight = out["per_n"]["8"]
    assert eight["set_peers"] == 3 and eight["overlay_peers"] == 5
    assert 0 < eight["agree_bytes_per_agent"] < eight["gather_bytes_per_agent"]  # one value per hop vs all of them
    assert out["frontier"]["nodes"] == 9408 and out["frontier"]["agree_hops"] == 14
    assert set(out["growth"]) >= set(KEYS)


def test_growth_tells_logarithmic_from_linear():
    log_like = growth([{"agents": n, "y": 2.0 + math.log2(n)} for n in (16, 64, 256)], "y")
    linear = growth([{"agents": n, "y": 0.5 * n} for n in (16, 64, 256)], "y")
    assert log_like["exponent"] < 0.5 < 0.99 < linear["exponent"] < 1.01
    assert abs(log_like["per_log2n"] - 1.0) < 1e-9 and abs(log_like["at_9408_by_log2n"] - (2 + math.log2(9408))) < 1e-2
    assert growth([{"agents": 16, "y": 1.0}], "y") is None


def test_each_agent_has_a_loopback_address_of_its_own():
    addrs = [loopback(i) for i in range(70000)]
    assert len(set(addrs)) == len(addrs) and all(a.startswith("127.") for a in addrs)
