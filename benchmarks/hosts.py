"""One slow host, made slow by the kernel or by sleeping: every policy on emulated hosts.

    sudo python benchmarks/hosts.py [--pipelines 4] [--epochs 6] [--repeats 3]
                                    [--bandwidth 20e6] [--cpu 0.5] [--policies sdpipe,allreduce,ps,adpsgd,none]

Emulated hosts (``sdpipe.hosts``, needs root): host 0 runs the Dask
scheduler, hosts 1..D one pipeline each (its two stages, two single-threaded
worker processes), so a stage's replicas talk between hosts and a pipeline's
stages within one.  Pipeline ``--slow`` (default the last) lives on the slow
host.  Every worker host's link is limited to B bytes/s each way (``tc``
``tbf``) and its CPU to C cores (the cgroup ``cpu`` quota), so that CPU time
is shared alike and the one slow host is the only difference.  Four
scenarios on that base:

- link, shaped: the slow host's link at B/10;
- link, slept:  the slow pipeline's workers sleep
  ``9 x (their stage's parameter bytes) / B`` per synchronization
  (``Heterogeneity.link_delay``: the time one copy of the parameters
  takes longer at B/10 than at B);
- cpu, shaped:  the slow host's CPU at C/4;
- cpu, slept:   the slow pipeline's compute stretched 4x
  (``Heterogeneity.slowdown``).

One unrecorded warm-up run first (a worker's first run pays for its
imports, for seconds on a capped host).  Scenarios and policies alternate
(orders reversed every repeat) on one set
of hosts, so drift of this noisy machine falls on all alike.  Samples/s is
all pipelines' together per epoch (epochs after the first), the median of
the epochs; the table shows the median over the repeats with min-max.  The
ideal is the sum of the pipelines' own speeds, measured in the same scenario
and repeat under policy ``none`` (no pipeline waits for another within an
epoch): a pipeline's own speed is its batch over its median step time (the
time between the ends of its last stage's consecutive optimizer spans).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from _common import VARIANTS, results_head, run_meta, time_to_target
from straggler import connectivity_report, throughput

SCENARIOS = ("link shaped", "link slept", "cpu shaped", "cpu slept")


def stage_param_bytes(model_fn, stages: int, cuts=None) -> list:
    """Bytes of each stage's parameters under sdpipe's own cut (or ``cuts``)."""
    import sdpipe

    parts = sdpipe.partition(model_fn(), stages, cuts=cuts)
    return [sum(p.numel() * p.element_size() for p in m.parameters()) for m in parts]


def own_speeds(result, pipelines: int, stages: int, batch: int) -> dict:
    """Samples/s of each pipeline at its own pace: its batch over the median time between the ends of its last
    stage's consecutive optimizer spans (a step; the few that hold an epoch's global sync do not move the median)."""
    speeds = {}
    for p in range(pipelines):
        ends = sorted(
            e["end"]
            for e in result.events
            if e["kind"] == "optimizer" and e["pipeline"] == p and e["stage"] == stages - 1
        )
        gaps = [b - a for a, b in itertools.pairwise(ends) if b > a]
        speeds[p] = batch / statistics.median(gaps) if gaps else 0.0
    return speeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--slow", type=int, default=None, help="the pipeline on the slow host (default: the last)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", choices=("mlp", "cnn"), default="mlp", help="the digits MLP, or the digits CNN cut at 6")
    ap.add_argument("--hidden", type=int, default=256, help="width of the digits MLP")
    ap.add_argument("--channels", type=int, default=64, help="channels of the digits CNN")
    ap.add_argument(
        "--seeds", action="store_true", help="repeat r trains with seed r (data split, model and batches); else seed 0"
    )
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--bandwidth", type=float, default=20e6, help="B: every worker host's link, bytes/s each way (0: no limit)"
    )
    ap.add_argument("--link-factor", type=float, default=10.0, help="the slow host's link is B / this")
    ap.add_argument("--cpu", type=float, default=0.5, help="C: every worker host's CPU cap, cores")
    ap.add_argument("--cpu-factor", type=float, default=4.0, help="the slow host's cap is C / this")
    ap.add_argument("--staleness", type=int, default=10, help="P of sdpipe (and the ps staleness bound)")
    ap.add_argument(
        "--policies",
        default="sdpipe,allreduce,ps,adpsgd,none",
        help=f"policies, or variants of one: {', '.join(VARIANTS)}",
    )
    ap.add_argument("--target", type=float, default=0.95, help="held-out accuracy for the time to accuracy")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hosts.md"))
    args = ap.parse_args(argv)

    import sdpipe
    from sdpipe.data import digits, digits_cnn, digits_mlp
    from sdpipe.hosts import EmulatedHosts, HostsUnavailable

    D, S = args.pipelines, args.stages
    slow = D - 1 if args.slow is None else args.slow
    policies = args.policies.split(",")
    if "none" not in policies:
        policies.append("none")  # the ideal is measured from it
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            sys.exit(f"--scenarios: {s!r} is not one of {', '.join(SCENARIOS)}")

    def make_model(seed: int = 0):
        return digits_cnn(args.channels, seed=seed) if args.model == "cnn" else digits_mlp(hidden=args.hidden)

    cuts = (6,) if args.model == "cnn" and S == 2 else None
    B, C = (args.bandwidth or None), args.cpu
    if B is None and any(s.startswith("link") for s in scenarios):
        sys.exit("--bandwidth 0 (no link limit) leaves nothing to slow in the link scenarios")
    param_bytes = stage_param_bytes(make_model, S, cuts)
    extra = {(slow, s): (args.link_factor - 1) * param_bytes[s] / B for s in range(S)} if B else {}
    slept = {
        "link slept": sdpipe.Heterogeneity(link_delay=extra),
        "cpu slept": sdpipe.Heterogeneity(slowdown={slow: args.cpu_factor}),
    }
    common = dict(
        stages=S,
        pipelines=D,
        epochs=args.epochs,
        batch_size=args.batch_size,
        scheduler={"staleness": args.staleness},
        timeout=300,
    )

    try:
        hosts = EmulatedHosts(workers=[S] * D)
    except HostsUnavailable as e:
        sys.exit(f"benchmarks/hosts.py: {e}")
    rows = []
    with hosts:
        slow_host = 1 + slow  # host 0 is the scheduler's; ranks go to workers in address order: pipeline p on host p+1

        def shape_for(scenario: str) -> None:
            for h in range(1, D + 1):
                link = B / args.link_factor if (scenario == "link shaped" and h == slow_host) else B  # None: no limit
                cpu = C / args.cpu_factor if (scenario == "cpu shaped" and h == slow_host) else C
                hosts.shape(h, bandwidth=link, cpu=cpu)  # one base for all: every worker host at B and C

        def run(scenario: str, policy: str, rep: int) -> None:
            t = time.time()
            name, _, schedule = policy.partition("@")  # "sdpipe@async-1f1b": another schedule than 1F1B
            mode, variant = VARIANTS.get(name, (name, {}))
            seed = rep if args.seeds else 0
            train_data, eval_data = digits(seed=seed)
            r = sdpipe.train(
                make_model(seed),
                train_data,
                eval_data=eval_data,
                cuts=cuts,
                seed=seed,
                policy=mode,
                schedule=schedule or "1f1b",
                heterogeneity=slept.get(scenario),
                cluster=hosts,
                **{**common, "scheduler": {**common["scheduler"], **variant}},
            ).result(timeout=1800)
            # where each pipeline ran, from its workers' own records: the layout the scenarios assume
            placed = {(e["pipeline"], hosts.host_of(e["address"])) for e in r.events if e["kind"] == "stage"}
            if placed != {(p, p + 1) for p in range(D)}:
                raise RuntimeError(f"pipelines ran on other hosts than one each, in order: {sorted(placed)}")
            last = max(h["epoch"] for h in r.history)
            per = own_speeds(r, D, S, args.batch_size)
            row = {
                "scenario": scenario,
                "policy": policy,
                "repeat": rep,
                "seed": seed,
                "samples_per_s": throughput(r),
                "per_pipeline": per,
                "accuracy": min(h.get("accuracy", 0) for h in r.history if h["epoch"] == last),
                "wall_s": round(time.time() - t, 1),
                "time_to_target": time_to_target(r.events, D, args.target),
            }
            if mode == "sdpipe":
                row["groups"] = connectivity_report(r, args.staleness, D, slow)
            rows.append(row)
            print(json.dumps(row), flush=True)

        # warm-up, not recorded: every worker's first run pays for its imports and first-time allocations (on a
        # capped host for seconds), which would otherwise fall on whichever policy comes first
        shape_for(scenarios[0])
        sdpipe.train(
            make_model(), digits()[0], policy="sdpipe", cluster=hosts, cuts=cuts, **{**common, "epochs": 1}
        ).result(timeout=1800)
        for rep in range(args.repeats):
            for scenario in scenarios if rep % 2 == 0 else scenarios[::-1]:
                shape_for(scenario)
                for policy in policies if rep % 2 == 0 else policies[::-1]:
                    run(scenario, policy, rep)

    def pick(scenario, policy):
        return [r for r in rows if r["scenario"] == scenario and r["policy"] == policy]

    summary = {}
    for scenario in scenarios:
        ideals = [sum(r["per_pipeline"].values()) for r in pick(scenario, "none")]
        ideal = statistics.median(ideals)
        summary[scenario] = {"ideal": {"samples_per_s": ideal, "spread": [min(ideals), max(ideals)]}}
        for p in policies:
            v = [r["samples_per_s"] for r in pick(scenario, p)]
            summary[scenario][p] = {
                "samples_per_s": statistics.median(v),
                "spread": [min(v), max(v)],
                "to_ideal": statistics.median(v) / ideal,
                "accuracy": statistics.median(r["accuracy"] for r in pick(scenario, p)),
            }
            reached = [r["time_to_target"] for r in pick(scenario, p) if r["time_to_target"] is not None]
            summary[scenario][p]["time_to_target"] = statistics.median(reached) if reached else None
            summary[scenario][p]["time_to_target_all"] = [r["time_to_target"] for r in pick(scenario, p)]
            if VARIANTS.get(p.partition("@")[0], (p.partition("@")[0],))[0] == "sdpipe":
                g = [r["groups"] for r in pick(scenario, p)]
                summary[scenario][p]["groups_without_slow"] = statistics.median(
                    x["multi_member_groups_without_slow"] / max(1, x["multi_member_groups"]) for x in g
                )
        slow_speed = [
            r["per_pipeline"][slow] / statistics.median(v for q, v in r["per_pipeline"].items() if q != slow)
            for r in pick(scenario, "none")
        ]
        summary[scenario]["slow_pipeline_speed_ratio"] = statistics.median(slow_speed)

    meta = run_meta(
        "hosts.py",
        argv,
        (
            f"digits CNN ({args.channels} channels, cut at 6)"
            if args.model == "cnn"
            else f"digits MLP 64-{args.hidden}-{args.hidden}-10"
        )
        + f", S={S}, D={D}, one pipeline per "
        f"emulated host (hosts 1..{D}, scheduler on host 0), batch {args.batch_size} per pipeline, "
        f"{args.epochs} epochs, P={args.staleness}, slow pipeline {slow}; "
        f"B={B or 0:.3g} bytes/s (0: no limit), link factor "
        f"{args.link_factor:g}; C={C:g} cores, cpu factor {args.cpu_factor:g}; stage parameter bytes "
        f"{param_bytes}; slept link delay per sync "
        + (f"{[round(extra[(slow, s)], 4) for s in range(S)]} s; " if B else "none (no link limit); ")
        + f"gloo on CPU, {args.repeats} repeats"
        + (" (seed = repeat)" if args.seeds else " (seed 0)"),
    )
    out, L = results_head(
        args.out,
        f"One slow host, shaped by the kernel or slept: link 1/{args.link_factor:g}, CPU 1/{args.cpu_factor:g}",
        meta,
    )
    L += [
        "",
        "Samples/s of all pipelines together, median over the repeats [min-max]; in brackets after it the share "
        "of the ideal (the sum of the pipelines' own speeds, each its batch over its median step time, under `none` "
        "in the same scenario).",
        "",
    ]
    L += ["| policy | " + " | ".join(scenarios) + " |", "|---" * (len(scenarios) + 1) + "|"]
    for p in ["ideal", *policies]:
        cells = []
        for s in scenarios:
            x = summary[s][p]
            share = f" ({x['to_ideal']:.2f})" if "to_ideal" in x else ""
            cells.append(f"{x['samples_per_s']:.0f} [{x['spread'][0]:.0f}-{x['spread'][1]:.0f}]{share}")
        L.append(f"| {p} | " + " | ".join(cells) + " |")
    L += ["", "| per scenario | " + " | ".join(scenarios) + " |", "|---" * (len(scenarios) + 1) + "|"]
    L.append(
        "| slow pipeline's own speed / the others' median (under none) | "
        + " | ".join(f"{summary[s]['slow_pipeline_speed_ratio']:.2f}" for s in scenarios)
        + " |"
    )
    for p in policies:
        if "groups_without_slow" in summary[scenarios[0]][p]:
            L.append(
                f"| {p}: share of multi-member groups without the slow pipeline | "
                + " | ".join(f"{summary[s][p]['groups_without_slow']:.2f}" for s in scenarios)
                + " |"
            )
    for p in policies:
        cells = []
        for s in scenarios:
            x = summary[s][p]
            runs = ", ".join("-" if t is None else f"{t:.1f}" for t in x["time_to_target_all"])
            cells.append(
                ("not reached" if x["time_to_target"] is None else f"{x['time_to_target']:.1f}") + f" ({runs})"
            )
        L.append(
            f"| {p}: seconds to {args.target:g} held-out accuracy, median (each run) | " + " | ".join(cells) + " |"
        )
    L.append(
        "| held-out accuracy, median of policies (min) | "
        + " | ".join(
            f"{statistics.median(summary[s][p]['accuracy'] for p in policies):.3f} "
            f"({min(summary[s][p]['accuracy'] for p in policies):.3f})"
            for s in scenarios
        )
        + " |"
    )
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
