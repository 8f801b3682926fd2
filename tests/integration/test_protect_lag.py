"""Protection keeps its lag bound through the durable flushes (#34): five nodes, a flush every 5 steps for 60 steps.
The first flush once stopped protection for the rest of the run (its CPU, torch's import at slot 0's commit, was
billed to the agents' protection cap: 190 s of pacing at 1 % of a core); `hpcft status` said "healthy" meanwhile."""
import time

from runs import finished_ok, start

from hpcft import status

STEPS, EVERY, BOUND = 60, 5, 3


def test_protection_keeps_its_lag_bound_while_a_flush_lands_every_few_steps(healthy_sandbox, tmp_path):
    out = tmp_path / "run"
    proc = start(healthy_sandbox, out, 5, "--persist-every", str(EVERY), "--protect-lag", str(BOUND),
                 steps=STEPS, delay=0.4)
    seen = []  # (trainers' step, steps at risk, warnings) as `hpcft status --json` says them, sampled
    while proc.poll() is None:
        try:
            view = status.collect(out / "job")
        except Exception:  # noqa: BLE001 - not started yet, or between the supervisor's writes
            view = None
        if view is not None and view.steps_at_risk is not None and view.nodes[0].phase != "stopped":
            seen.append((view.training, view.steps_at_risk, view.warnings,
                         all(s.protected_step is not None for s in view.sets)))
        time.sleep(0.3)
    recs, _, output = finished_ok(proc, out)
    # once every set's first pass was reported (before it, everything staged is at risk, said so by `hpcft status`:
    # a sample taken while one agent's first report is still on its way read 5 of 5 steps at risk)
    first = next((i for i, s in enumerate(seen) if s[3]), len(seen))
    running = [s[:3] for s in seen[first:]]
    assert len(running) > 20, (seen, output[-3000:])
    # the bound steers the agents' CPU cap, it cannot promise a starved box (CI's read 5 steps at risk once, of 3):
    # nearly every sample keeps it, none trails far (the stall trailed by the whole run), and `hpcft status` warns
    # exactly while it is exceeded
    over = [r for r in running if r[1] > BOUND]
    assert len(over) <= len(running) // 10 and max(r for _, r, _ in running) <= 2 * BOUND, running
    assert all(bool(w) == (r > BOUND) for _, r, w in running), running
    # a flush is due every EVERY steps, started at the next pass; the first one's commit loads torch's checkpoint
    # modules once (2-3 s here, 12 steps' worth on a loaded CI box), so the one after it alone may come later
    durable = [e["step"] for e in recs if e["event"] == "flush_done" and e.get("slot") == 0]
    assert durable[0] <= 2 * EVERY and durable[-1] >= STEPS - EVERY and len(durable) >= STEPS // (2 * EVERY) \
        and all(b - a <= 2 * EVERY for a, b in zip(durable[1:], durable[2:])), durable
    assert not [e for e in recs if e["event"] in ("flush_failed", "agents_failed", "protect_lag_unmet")]
