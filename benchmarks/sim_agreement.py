"""Does the simulator agree with the real runtime?  Samples/s, real against simulated.

    python benchmarks/sim_agreement.py [--configs 2x2,4x2] [--policies sdpipe,allreduce] [--epochs 4]
                                       [--slowdown 4] [--channels 32] [--batch-size 64]

For every configuration S x D and policy, with and without a persistent
straggler (the last pipeline slowed ``--slowdown`` times): a real run of the
digits CNN on an embedded LocalCluster (8 single-threaded worker processes on
127.0.0.1, shared by all runs; the runs alternate), then ``sdpipe.calibrate``
turns that run's events into ``Costs`` and a ``Network``, and
``sdpipe.simulate`` runs one epoch of the same configuration with them.

Two predictions per straggler run:

- *self*: costs calibrated from the straggler run itself;
- *cross*: costs calibrated from the homogeneous run of the same S x D and
  policy; only the heterogeneity differs.

Real samples/s: per epoch the sum of each pipeline's samples over its epoch
time (global sync included, evaluation not), the median over the epochs
after the first.  Simulated: the same sum over the simulated epoch.
Results: ``benchmarks/results/sim_agreement.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta


def real_rate(result) -> float:
    epochs = sorted({h["epoch"] for h in result.history})
    epochs = epochs[1:] if len(epochs) > 1 else epochs
    return statistics.median(sum(h["samples_per_s"] for h in result.history if h["epoch"] == e) for e in epochs)


def sim_rate(result) -> float:
    return sum(h["samples_per_s"] for h in result.history)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="2x2,4x2", help="S x D pairs")
    ap.add_argument("--policies", default="sdpipe,allreduce")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--slowdown", type=float, default=4.0)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="real runs per configuration (median)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_agreement.md"))
    ap.add_argument(
        "--runs",
        default=None,
        help="folder: keep each real run's events and configuration there "
        "(a pickle per run), or with --replay read them from there instead of running",
    )
    ap.add_argument("--replay", action="store_true", help="calibrate and simulate the runs kept in --runs")
    args = ap.parse_args(argv)
    if args.replay and not args.runs:
        ap.error("--replay needs --runs")

    import sdpipe
    from sdpipe.data import digits, digits_cnn
    from sdpipe.driver.result import RunResult
    from sdpipe.driver.result import history as _history
    from sdpipe.simulation import cores_of

    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    policies = args.policies.split(",")
    train_data, eval_data = digits()
    n_train = len(train_data[0])
    batches = n_train // args.batch_size
    cuts = {1: None, 2: (6,), 4: (3, 5, 8)}
    client, cluster = (None, None) if args.replay else local_cluster(max(S * D for S, D in configs))
    rows = []
    kept: dict = {}  # (S, D, policy, label) -> [(result, heterogeneity), ...] one per repeat
    try:
        for rep in range(args.repeats):  # repeats outermost: machine drift affects every configuration alike
            for S, D in configs:
                for policy in policies:
                    for label in ("homogeneous", "straggler"):
                        hetero = sdpipe.Heterogeneity(slowdown={D - 1: args.slowdown}) if label == "straggler" else None
                        t = time.time()
                        path = Path(args.runs or ".") / f"{S}x{D}-{policy}-{label}-{rep}.pkl"
                        if args.replay:
                            events, config = pickle.loads(path.read_bytes())
                            r = RunResult(
                                models=[], history=_history(events), events=events, config=config, wall_time=0.0
                            )
                        else:
                            r = sdpipe.train(
                                digits_cnn(args.channels),
                                train_data,
                                stages=S,
                                pipelines=D,
                                policy=policy,
                                epochs=args.epochs,
                                batch_size=args.batch_size,
                                microbatches=args.microbatches,
                                cuts=cuts.get(S),
                                eval_data=eval_data,
                                heterogeneity=hetero,
                                cluster=client,
                            ).result(timeout=1800)
                            if args.runs:
                                path.parent.mkdir(parents=True, exist_ok=True)
                                path.write_bytes(pickle.dumps((r.events, r.config)))
                        kept.setdefault((S, D, policy, label), []).append((r, hetero))
                        print(
                            f"{S}x{D} {policy} {label} #{rep}: "
                            f"real {real_rate(r):.0f} samples/s ({time.time() - t:.0f} s)",
                            file=sys.stderr,
                        )
    finally:
        if client is not None:
            client.close()
            cluster.close()

    def simulated(source, S, D, policy, hetero, shared=False) -> tuple:
        """Median over 3 simulation seeds, with costs calibrated from ``source``.

        ``hetero`` None means the slowdown that ``source`` showed (``shared``: its nominal one).  ``shared``: the
        workers share the cores ``source``'s workers had (``calibrate(shared=True)``, ``simulate(cores=...)``).
        """
        costs, net, shown = sdpipe.calibrate(source, shared=shared)
        rates = [
            sim_rate(
                sdpipe.simulate(
                    S,
                    D,
                    epochs=1,
                    costs=costs,
                    network=net,
                    policy=policy,
                    microbatches=args.microbatches,
                    batch_size=args.batch_size,
                    steps=batches // D,
                    record=False,
                    seed=seed,
                    heterogeneity=shown if hetero is None else hetero,
                    cores=cores_of(source) if shared else None,
                )
            )
            for seed in range(3)
        ]
        return statistics.median(rates), {
            **dataclasses.asdict(costs),
            **dataclasses.asdict(net),
            "shown_slowdown": {str(k): v for k, v in shown.slowdown.items()},
        }

    for (S, D, policy, label), reps in kept.items():
        row = {
            "stages": S,
            "pipelines": D,
            "policy": policy,
            "scenario": label,
            "real_each": [real_rate(r) for r, _ in reps],
        }
        row["real"] = statistics.median(row["real_each"])
        selfs = [simulated(r, S, D, policy, None) for r, _ in reps]
        row["self_each"] = [v for v, _ in selfs]
        row["self"] = statistics.median(row["self_each"])
        row["self_costs"] = [c for _, c in selfs]
        row["shared_each"] = [simulated(r, S, D, policy, None, shared=True)[0] for r, _ in reps]
        row["shared"] = statistics.median(row["shared_each"])
        row["shared_error"] = row["shared"] / row["real"] - 1.0
        if label == "straggler":  # the homogeneous run of the same repeat, with the nominal slowdown
            homog = kept[(S, D, policy, "homogeneous")]
            row["cross_each"] = [
                simulated(h, S, D, policy, hetero)[0] for (h, _), (_, hetero) in zip(homog, reps, strict=False)
            ]
            row["cross"] = statistics.median(row["cross_each"])
            row["cross_error"] = row["cross"] / row["real"] - 1.0
            row["cross_shared"] = statistics.median(
                simulated(h, S, D, policy, hetero, shared=True)[0]
                for (h, _), (_, hetero) in zip(homog, reps, strict=False)
            )
            row["cross_shared_error"] = row["cross_shared"] / row["real"] - 1.0
        row["self_error"] = row["self"] / row["real"] - 1.0
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_costs")}), file=sys.stderr)

    meta = run_meta(
        "sim_agreement.py",
        argv,
        f"digits CNN ({args.channels} channels), batch {args.batch_size}, "
        f"{args.microbatches} micro-batches, 1F1B, {args.epochs} epochs, straggler: last pipeline x{args.slowdown}",
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def pct(v):
        return f"{100 * v:+.1f}%"

    lines = [
        "# Simulator against the real runtime",
        "",
        *meta_lines(meta),
        "",
        f"Real: median samples/s (all pipelines together) of {args.repeats} runs on the embedded LocalCluster. "
        "*self*: simulated with costs, network and shown slowdown calibrated from each of those runs "
        "(median over runs and 3 simulation seeds). *cross*: calibrated from the homogeneous run of the same "
        "S x D, policy and repeat, simulated with the nominal slowdown. *shared cores*: the same, with the workers "
        "sharing the cores the run's workers had (`calibrate(shared=True)`: CPU-second costs; "
        "`simulate(cores=...)`; the nominal slowdown).",
        "",
        "| S x D | policy | scenario | real (each run) | self | error | cross | error | "
        "self, shared cores | error | cross, shared cores | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cross = f"{r['cross']:.0f} | {pct(r['cross_error'])}" if "cross" in r else "- | -"
        cross_shared = f"{r['cross_shared']:.0f} | {pct(r['cross_shared_error'])}" if "cross" in r else "- | -"
        each = ", ".join(f"{v:.0f}" for v in r["real_each"])
        lines.append(
            f"| {r['stages']}x{r['pipelines']} | {r['policy']} | {r['scenario']} | {r['real']:.0f} ({each}) | "
            f"{r['self']:.0f} | {pct(r['self_error'])} | {cross} | {r['shared']:.0f} | {pct(r['shared_error'])} | "
            f"{cross_shared} |"
        )
    for policy in policies:
        lines.append("")
        for key, name in (("self_error", "a core per worker"), ("shared_error", "shared cores")):
            errs = [abs(r[key]) for r in rows if r["policy"] == policy]
            lines.append(
                f"- `{policy}`, {name}: largest self-calibrated error {100 * max(errs):.1f}%, median "
                f"{100 * statistics.median(errs):.1f}% ({'within' if max(errs) <= 0.15 else 'outside'} 15%)."
            )
    lines += ["", "Calibrated costs per run are in the JSON file next to this one."]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
