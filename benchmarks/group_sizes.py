"""How large sdpipe's groups are, by window rule: real runs on a LocalCluster and simulated runs at scale.

    python benchmarks/group_sizes.py [--contenders arrival,prototype,arrival+overlap,arrival+overlap@0.8] [--repeats 2]
                                     [--scenarios homogeneous,straggler4x,first3x] [--epochs 4]
                                     [--sim-pipelines 64,1024] [--sim-steps 100] [--no-real] [--no-sim]

Real part: the digits CNN (64 channels, ``cuts=(6,)``), 2 stages x 4
pipelines, batch 64, policy ``sdpipe``, on one LocalCluster of 8
single-threaded worker processes (127.0.0.1); the contenders alternate within
each repeat.  A contender is a window rule (``arrival``: rounds wait for the
workers predicted within the horizon; ``prototype``: the prototype's 1-10 ms
adaptive window), ``+overlap`` adds averaging overlapped with compute and
``@H`` sets the horizon (default 0.5).
Scenarios: ``homogeneous``; ``straggler4x`` (pipeline 3 slowed 4x);
``first3x`` (pipeline 0 slowed 3x).  From each run's ``group`` events, the
*ordinary* rounds (every reason but ``graph``, ``global`` and
``preempted``): their sizes, the share with 3 or more members, the share of
the fast pipelines' rounds with 2 or more, the share holding the slow
pipeline; from its ``wait`` spans the time a step waited for its group, as a
share of the step; samples/s after the first epoch.

Simulated part: ``sdpipe.simulate`` at ``--sim-pipelines`` with 4 stages,
the digits CNN's costs of ``benchmarks/results/sim_agreement.json`` on a
10 Gbit/s network, transient straggles (probability 0.1 per step, 50 ms):
group sizes and samples/s over the ideal (policy ``none``: nobody waits).

Results: ``benchmarks/results/group_sizes.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from _common import local_cluster, results_head, run_meta
from straggler import throughput

HERE = Path(__file__).parent
ORDINARY_EXCLUDED = ("graph", "global", "preempted")


def contender(name: str) -> dict:
    """``arrival``, ``prototype``, optionally ``+overlap``, optionally ``@H`` (the horizon): scheduler parameters."""
    base, _, horizon = name.partition("@")
    rule, _, extra = base.partition("+")
    try:
        h = {"horizon": float(horizon)} if horizon else {}
    except ValueError:
        h = None
    if rule not in ("arrival", "prototype") or extra not in ("", "overlap") or h is None:
        raise SystemExit(f"--contenders: {name!r}; use arrival or prototype, optionally +overlap, optionally @horizon")
    return {"window": rule, "overlap": extra == "overlap", **h}


def scenarios(D: int) -> dict:
    import sdpipe

    return {
        "homogeneous": (None, None),
        "straggler4x": (sdpipe.Heterogeneity(slowdown={D - 1: 4.0}), D - 1),
        "first3x": (sdpipe.Heterogeneity(slowdown={0: 3.0}), 0),
    }


def group_report(events, D: int, slow) -> dict:
    """Sizes of the ordinary rounds (a round's groups together) and who was in them."""
    rounds: dict = {}
    for e in events:
        if e["kind"] == "group" and e["reason"] not in ORDINARY_EXCLUDED:
            rounds.setdefault((e["stage"], e["round"]), set()).update(e["group"])
    sizes = Counter(len(m) for m in rounds.values())
    n = len(rounds) or 1
    fast = [m for m in rounds.values() if m - {slow}]
    return {
        "rounds": len(rounds),
        "sizes": {str(k): v for k, v in sorted(sizes.items())},
        "three_plus": sum(len(m) >= 3 for m in rounds.values()) / n,
        "fast_two_plus": sum(len(m) >= 2 for m in fast) / (len(fast) or 1),
        "with_slow": None if slow is None else sum(slow in m for m in rounds.values()) / n,
        "alone": sizes.get(1, 0) / n,
    }


def wait_report(result) -> dict:
    """Seconds a step waited for its ordinary group (the epochs' global syncs aside), over the step's time: all
    workers, the epochs after the first."""
    waits, steps = Counter(), Counter()
    first_end = {}
    for e in result.events:
        if e["kind"] == "epoch" and e["metrics"]["epoch"] == 0:
            first_end[e["pipeline"]] = e["end"]
    spans = {}
    global_rounds = {
        (e["stage"], e["round"]) for e in result.events if e["kind"] == "group" and e["reason"] == "global"
    }
    for e in result.events:
        if e.get("pipeline") is None or e["start"] < first_end.get(e["pipeline"], 0.0):
            continue
        key = (e["pipeline"], e["stage"])
        if e["kind"] == "wait" and e.get("what") == "group" and (e["stage"], e.get("round")) not in global_rounds:
            waits[key] += e["end"] - e["start"]
        if e["kind"] == "optimizer":
            steps[key] += 1
            spans.setdefault(key, []).append(e["end"])
    step_time = {k: (max(v) - min(v)) / (len(v) - 1) for k, v in spans.items() if len(v) > 1}
    shares = [waits[k] / (steps[k] * step_time[k]) for k in step_time if steps[k]]
    return {"wait_share": statistics.median(shares) if shares else None}


def real_part(args, names) -> list:
    import sdpipe
    from sdpipe.data import digits, digits_cnn

    train_data, eval_data = digits()
    D, S = 4, 2
    client, cluster = local_cluster(D * S)
    rows = []
    try:
        scen = scenarios(D)
        for rep in range(args.repeats):
            for label in args.scenarios.split(","):
                hetero, slow = scen[label]
                for name in names if rep % 2 == 0 else names[::-1]:
                    t = time.time()
                    r = sdpipe.train(
                        digits_cnn(64),
                        train_data,
                        eval_data=eval_data,
                        stages=S,
                        pipelines=D,
                        epochs=args.epochs,
                        batch_size=64,
                        cuts=(6,),
                        policy="sdpipe",
                        scheduler=contender(name),
                        heterogeneity=hetero,
                        seed=rep,
                        cluster=client,
                    ).result(timeout=1800)
                    last = max(h["epoch"] for h in r.history)
                    row = {
                        "scenario": label,
                        "contender": name,
                        "repeat": rep,
                        "samples_per_s": throughput(r),
                        "accuracy": min(h.get("accuracy", 0.0) for h in r.history if h["epoch"] == last),
                        "wall_s": time.time() - t,
                        **group_report(r.events, D, slow),
                        **wait_report(r),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        client.close()
        cluster.close()
    return rows


def sim_part(args, names) -> list:
    from sim_scaling import load_costs

    import sdpipe

    costs = load_costs(HERE / "results" / "sim_agreement.json", 4)
    hetero = sdpipe.Heterogeneity(straggle_prob=0.1, straggle_delay=0.05)
    net = sdpipe.Network(bandwidth=10e9 / 8, latency=50e-6, scheduler_rtt=0.0005)
    rows = []
    for D in (int(x) for x in args.sim_pipelines.split(",")):
        common = dict(costs=costs, steps=args.sim_steps, epochs=1, heterogeneity=hetero, network=net, seed=1)
        t = time.time()
        ideal = sdpipe.simulate(4, D, policy="none", record=False, **common)
        ideal_rate = sum(h["samples"] for h in ideal.history) / ideal.wall_time
        for name in names:
            t = time.time()
            r = sdpipe.simulate(4, D, policy="sdpipe", scheduler=contender(name), **common)
            got = sum(h["samples"] for h in r.history) / r.wall_time
            row = {
                "pipelines": D,
                "contender": name,
                "samples_per_s": got,
                "to_ideal": got / ideal_rate,
                "seconds": time.time() - t,
                **group_report(r.events, D, None),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def summarize(rows, names, scen) -> list:
    med = statistics.median
    L = [
        "| scenario | contender | rounds | sizes (members: rounds) | 3+ members | fast pipelines' rounds with 2+ "
        "| rounds with the slow pipeline | step waiting for its group | samples/s [min-max] | held-out accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in scen:
        for name in names:
            rs = [r for r in rows if r["scenario"] == label and r["contender"] == name]
            if not rs:
                continue
            sizes = Counter()
            for r in rs:
                sizes.update({int(k): v for k, v in r["sizes"].items()})
            slow = "-" if rs[0]["with_slow"] is None else f"{100 * med(r['with_slow'] for r in rs):.0f}%"
            wait = [r["wait_share"] for r in rs if r["wait_share"] is not None]
            L.append(
                f"| {label} | {name} | {med(r['rounds'] for r in rs):.0f} | "
                + ", ".join(f"{k}: {v}" for k, v in sorted(sizes.items()))
                + f" | {100 * med(r['three_plus'] for r in rs):.0f}% | {100 * med(r['fast_two_plus'] for r in rs):.0f}%"
                f" | {slow} | {100 * med(wait):.1f}% | {med(r['samples_per_s'] for r in rs):.0f} "
                f"[{min(r['samples_per_s'] for r in rs):.0f}-{max(r['samples_per_s'] for r in rs):.0f}] | "
                f"{med(r['accuracy'] for r in rs):.3f} |"
            )
    return L


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contenders", default="arrival,prototype,arrival+overlap")
    ap.add_argument("--scenarios", default="homogeneous,straggler4x,first3x")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--sim-pipelines", default="64,1024")
    ap.add_argument("--sim-steps", type=int, default=100)
    ap.add_argument("--no-real", action="store_true")
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "group_sizes.md"))
    args = ap.parse_args(argv)
    names = args.contenders.split(",")
    for n in names:
        contender(n)
    real = [] if args.no_real else real_part(args, names)
    sim = [] if args.no_sim else sim_part(args, names)
    meta = run_meta(
        "group_sizes.py",
        argv,
        f"real: digits CNN (64 channels, cuts=(6,)), 2 stages x 4 pipelines, batch 64, {args.epochs} epochs, "
        f"policy sdpipe, {args.repeats} repeats (contenders alternated); simulated: 4 stages, "
        f"{args.sim_pipelines} pipelines, {args.sim_steps} steps, 10 Gbit/s, transient straggles p=0.1 of 50 ms",
    )
    out, L = results_head(args.out, "Group sizes by window rule", meta)
    if real:
        L += [
            "",
            "## Real runs",
            "",
            "Ordinary rounds: every reason but graph, global and preempted (a round's groups counted together). "
            "Medians over the repeats; sizes summed over them.",
            "",
            *summarize(real, names, args.scenarios.split(",")),
        ]
    if sim:
        L += [
            "",
            "## Simulated",
            "",
            "| pipelines | contender | rounds | alone | 3+ members | samples/s | / ideal | simulation (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sim:
            L.append(
                f"| {r['pipelines']} | {r['contender']} | {r['rounds']} | {100 * r['alone']:.0f}% | "
                f"{100 * r['three_plus']:.0f}% | {r['samples_per_s']:.0f} | {r['to_ideal']:.2f} | {r['seconds']:.1f} |"
            )
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "real": real, "sim": sim}, indent=1))
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
