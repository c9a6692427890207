"""Fingerprints of the simulator's results, to check that a change leaves them bit for bit the same.

    python tools/sim_fingerprint.py            # one line per scenario: its name, wall time, md5 of its records

Each scenario is a small simulation (2 stages x 8 pipelines) under one policy with a 4x pipeline and transient
straggles, plus ``sdpipe`` and ``none`` under a spot trace (pipelines leaving and coming back); the md5 is of the
JSON of ``result.events`` (keys sorted). Run it before and after a change and compare the lines.  Groups are priced
as flat rings (``Network(allreduce="ring")``), the model of every revision before the default became "best" (the
cheaper of ring and tree), so the lines recorded in ``benchmarks/results/house.md`` stay comparable.
"""

from __future__ import annotations

import hashlib
import json


def fingerprints() -> list:
    import sdpipe

    costs = sdpipe.Costs(forward=[0.002] * 2, backward=[0.004] * 2, weight_bytes=[4e5] * 2, activation_bytes=[4e4])
    hetero = sdpipe.Heterogeneity(slowdown={3: 4.0}, straggle_prob=0.05, straggle_delay=0.01)
    runs = [
        (policy, dict(policy=policy, steps=20, epochs=1, heterogeneity=hetero, seed=1))
        for policy in ("sdpipe", "allreduce", "ps", "adpsgd", "none")
    ]
    trace = sdpipe.spot_trace(8, preemptions_per_min=20, mean_down=0.3, duration=2.0, seed=3)
    runs += [(f"{p}+trace", dict(policy=p, steps=30, trace=trace, seed=2, epochs=2)) for p in ("sdpipe", "none")]
    out = []
    ring = sdpipe.Network(allreduce="ring")  # the pricing the recorded lines were made with (see the docstring)
    for name, kwargs in runs:
        result = sdpipe.simulate(2, 8, costs=costs, network=ring, **kwargs)
        digest = hashlib.md5(json.dumps(result.events, sort_keys=True, default=str).encode()).hexdigest()
        out.append((name, repr(result.wall_time), digest))
    return out


if __name__ == "__main__":
    for row in fingerprints():
        print(*row)
