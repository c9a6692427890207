"""Every policy with and without a persistent straggler, on a real LocalCluster.

    python benchmarks/straggler.py [--pipelines 4] [--stages 2] [--slowdown 4] [--epochs 6]
                                   [--model cnn|mlp] [--policies sdpipe,allreduce,adpsgd,ps] [--repeats 2]

One embedded LocalCluster (S x D single-threaded worker processes on
127.0.0.1) serves every run; the policies alternate so that machine drift
affects all alike.  For each run: samples/s (all pipelines, epochs after the
first), held-out accuracy, and for sdpipe from the events how many groups
left the slow pipeline out and whether the connectivity bound held.  The
ideal is the sum of the pipelines' speeds, measured with all pipelines
running and none waiting for another (policy ``none``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, results_head, run_meta


def throughput(result, skip_first=True) -> float:
    """Samples/s of all pipelines together: per epoch the sum of each pipeline's samples over its epoch time
    (which includes its waits and the global sync), the median over the measured epochs."""
    epochs = sorted({h["epoch"] for h in result.history})
    if skip_first and len(epochs) > 1:
        epochs = epochs[1:]
    return statistics.median(sum(h["samples_per_s"] for h in result.history if h["epoch"] == e) for e in epochs)


def connectivity_report(result, staleness: int, pipelines: int, slow: int) -> dict:
    """From the group events: groups without the slow pipeline and the longest stretch of updates
    (group members) before the union of a stage's groups connected all its workers."""
    groups = [e for e in result.events if e["kind"] == "group"]
    multi = [g for g in groups if len(g["group"]) > 1 and g["reason"] != "global"]
    worst = {}
    for stage in sorted({g["stage"] for g in groups}):
        since, longest = 0, 0
        for g in sorted((g for g in groups if g["stage"] == stage), key=lambda g: (g["round"], g["end"])):
            if g["reason"] == "preempted":
                continue
            if g["connected"]:
                since = 0
                continue
            since += len(g["group"])
            longest = max(longest, since)
        worst[stage] = longest
    return {
        "groups": len(groups),
        "multi_member_groups": len(multi),
        "multi_member_groups_without_slow": sum(slow not in g["group"] for g in multi),
        "graph_syncs": sum(g["reason"] == "graph" for g in groups),
        "longest_unconnected_updates": worst,
        "bound": staleness * pipelines,
        "bound_held": all(v < staleness * pipelines for v in worst.values()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--slowdown", type=float, default=4.0)
    ap.add_argument("--slow", type=int, default=3, help="the slowed pipeline")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--sync-every", type=int, default=1, help="epochs between global syncs")
    ap.add_argument("--staleness", type=int, default=10, help="P of sdpipe (and the ps staleness bound)")
    ap.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    ap.add_argument("--channels", type=int, default=64, help="width of the CNN")
    ap.add_argument("--hidden", type=int, default=512, help="width of the MLP")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--policies", default="sdpipe,allreduce,adpsgd,ps")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "straggler.md"))
    args = ap.parse_args(argv)

    import sdpipe
    from sdpipe.data import digits, digits_cnn, digits_mlp

    policies = args.policies.split(",")
    train_data, eval_data = digits()
    D, S = args.pipelines, args.stages
    if args.model == "cnn":
        make_model, cuts = (lambda: digits_cnn(args.channels)), ((6,) if S == 2 else None)
        model_txt = f"digits CNN ({args.channels}/{2 * args.channels}/{4 * args.channels} channels)"
    else:
        make_model, cuts = (lambda: digits_mlp(hidden=args.hidden)), None
        model_txt = f"digits MLP 64-{args.hidden}-{args.hidden}-10"
    client, cluster = local_cluster(D * S)
    common = dict(
        stages=S,
        pipelines=D,
        epochs=args.epochs,
        batch_size=args.batch_size,
        eval_data=eval_data,
        cuts=cuts,
        sync_every=args.sync_every,
        scheduler={"staleness": args.staleness},
        cluster=client,
    )
    scenarios = {"straggler": sdpipe.Heterogeneity(slowdown={args.slow: args.slowdown}), "homogeneous": None}
    rows = []

    def run(label, policy, hetero):
        t = time.time()
        r = sdpipe.train(make_model(), train_data, policy=policy, heterogeneity=hetero, **common).result(timeout=1800)
        last = max(h["epoch"] for h in r.history)
        acc = min(h.get("accuracy", 0) for h in r.history if h["epoch"] == last)
        total = sum(x["samples"] for x in r.history)
        share = {p: round(sum(x["samples"] for x in r.history if x["pipeline"] == p) / total, 3) for p in range(D)}
        row = {
            "scenario": label,
            "policy": policy,
            "samples_per_s": throughput(r),
            "accuracy": acc,
            "wall_s": time.time() - t,
            "share": share,
        }
        if policy == "sdpipe":
            row["groups"] = connectivity_report(r, args.staleness, D, args.slow)
        rows.append(row)
        print(json.dumps(row), flush=True)

    try:
        # speeds of the pipelines when none waits for another (policy none), for the ideal
        ideal = {}
        for label, hetero in scenarios.items():
            r = sdpipe.train(
                make_model(),
                train_data,
                policy="none",
                heterogeneity=hetero,
                **{**common, "epochs": 3, "eval_data": None},
            ).result(timeout=1800)
            per = {
                p: statistics.median(h["samples_per_s"] for h in r.history if h["pipeline"] == p and h["epoch"] > 0)
                for p in range(D)
            }
            ideal[label] = {"per_pipeline": per, "sum": sum(per.values())}
            print(label, "ideal", ideal[label], flush=True)
        for rep in range(args.repeats):
            for label, hetero in scenarios.items():
                order = policies if rep % 2 == 0 else policies[::-1]
                for policy in order:
                    run(label, policy, hetero)
    finally:
        client.close()
        cluster.close()

    def med(label, policy, key="samples_per_s"):
        return statistics.median(r[key] for r in rows if r["scenario"] == label and r["policy"] == policy)

    summary = {}
    for label in scenarios:
        base = med(label, "allreduce") if "allreduce" in policies else None
        summary[label] = {
            p: {
                "samples_per_s": med(label, p),
                "to_allreduce": med(label, p) / base if base else None,
                "to_ideal": med(label, p) / ideal[label]["sum"],
                "accuracy": med(label, p, "accuracy"),
                "spread": [
                    min(r["samples_per_s"] for r in rows if r["scenario"] == label and r["policy"] == p),
                    max(r["samples_per_s"] for r in rows if r["scenario"] == label and r["policy"] == p),
                ],
            }
            for p in policies
        }
    meta = run_meta(
        "straggler.py",
        argv,
        f"{model_txt}, S={S}, D={D}, batch {args.batch_size} per pipeline, 4 micro-batches, "
        f"adam lr 0.002, {args.epochs} epochs, global sync every {args.sync_every} epoch(s), P={args.staleness}, "
        f"straggler: pipeline {args.slow} slowed {args.slowdown:g}x (compute), gloo on CPU, {args.repeats} repeats",
    )
    out, L = results_head(args.out, f"Policies with and without a {args.slowdown:g}x straggler", meta)
    L += [
        "",
        "Samples/s are the median over the repeats (min-max in brackets); the ideal is the sum of the pipelines' "
        "speeds with none waiting for another (policy `none`, measured in the same cluster).",
        "",
        "| scenario | policy | samples/s | / allreduce | / ideal | held-out accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for label, per in summary.items():
        for p, x in per.items():
            ratio = f"{x['to_allreduce']:.2f}" if x["to_allreduce"] else "-"
            L.append(
                f"| {label} | {p} | {x['samples_per_s']:.0f} [{x['spread'][0]:.0f}-{x['spread'][1]:.0f}] | {ratio} | "
                f"{x['to_ideal']:.2f} | {x['accuracy']:.3f} |"
            )
        L.append(f"| {label} | ideal | {ideal[label]['sum']:.0f} | | 1.00 | |")
    L += [
        "",
        "Per-pipeline speeds with none waiting (samples/s): "
        + "; ".join(
            f"{k}: {', '.join(f'{p}: {v:.0f}' for p, v in sorted(x['per_pipeline'].items()))}" for k, x in ideal.items()
        ),
    ]
    L += [
        "",
        "## Every run",
        "",
        "| scenario | policy | samples/s | accuracy | share per pipeline | sdpipe groups without the slow pipeline "
        "| graph syncs | longest unconnected updates per stage (bound P x D) | bound held |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g = r.get("groups")
        gtxt = (
            (
                f"{g['multi_member_groups_without_slow']} of {g['multi_member_groups']} | {g['graph_syncs']} | "
                f"{g['longest_unconnected_updates']} (< {g['bound']}) | {g['bound_held']}"
            )
            if g
            else "- | - | - | -"
        )
        L.append(
            f"| {r['scenario']} | {r['policy']} | {r['samples_per_s']:.0f} | {r['accuracy']:.3f} | "
            f"{r['share']} | {gtxt} |"
        )
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "summary": summary, "ideal": ideal, "rows": rows}, indent=2, default=str) + "\n"
    )
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
