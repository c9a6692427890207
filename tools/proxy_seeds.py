"""How much one simulated run's convergence proxy varies with its seed alone, at one size of the scaling scenario.

    python tools/proxy_seeds.py [--pipelines 1024] [--workload cnn] [--gbit 10] [--seeds 6] [--steps 100]

``sdpipe`` on ``benchmarks/sim_scaling.py``'s scenario (every eighth pipeline 4x slower, transient straggles),
one run per seed: each run's proxy loss (the mean over the pipelines of the last epoch's, as the benchmark
reports it), their median and max / min.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", type=int, default=1024)
    ap.add_argument("--workload", default="cnn")
    ap.add_argument("--gbit", type=float, default=10.0)
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(BENCH))
    from sim_scaling import BATCH, scenario, workload_costs

    import sdpipe
    from sdpipe.simulation import profiles

    S, D = 4, args.pipelines
    costs = workload_costs(args.workload, S, BENCH / "results" / "sim_agreement.json")
    micro, M = BATCH[args.workload]
    net = profiles.network(args.gbit)  # the scaling benchmark's: 50 us links, 0.5 ms to the scheduler
    losses = []
    for seed in range(1, args.seeds + 1):
        r = sdpipe.simulate(
            S,
            D,
            epochs=1,
            costs=costs,
            network=net,
            policy="sdpipe",
            steps=args.steps,
            batch_size=micro * M,
            microbatches=M,
            heterogeneity=scenario(costs, S, M, D),
            record=False,
            seed=seed,
        )
        losses.append(statistics.mean(h["loss"] for h in r.history))
        print(f"seed {seed}: proxy loss {losses[-1]:.3g}", flush=True)
    print(f"median {statistics.median(losses):.3g}, max / min {max(losses) / min(losses):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
