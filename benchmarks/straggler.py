"""sdpipe against allreduce with and without a persistent straggler.

    python benchmarks/straggler.py [--pipelines 4] [--stages 2] [--slowdown 4] [--epochs 6] [--hidden 512] [--repeats 2]

One embedded LocalCluster (S x D single-threaded worker processes on
127.0.0.1) serves every run; the policies alternate so that machine drift
affects all alike.  For each run: samples/s (all pipelines, epochs after the
first), held-out accuracy, and from the events how many groups left the slow
pipeline out and whether the connectivity bound held.  The ideal is the sum
of the pipelines' speeds, each measured alone in the same cluster
(``none`` policy, so no pipeline waits on another).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta


def throughput(result, skip_first=True) -> float:
    """Samples/s of all pipelines together: samples of the measured epochs over their wall time."""
    epochs = sorted({h["epoch"] for h in result.history})
    if skip_first and len(epochs) > 1:
        epochs = epochs[1:]
    rows = [h for h in result.history if h["epoch"] in epochs]
    samples = sum(h["samples"] for h in rows)
    seconds = sum(statistics.median([h["samples"] / h["samples_per_s"] for h in rows if h["epoch"] == e]) for e in epochs)
    return samples / seconds


def connectivity_report(result, staleness: int, slow: int) -> dict:
    groups = [e for e in result.events if e["kind"] == "group"]
    multi = [g for g in groups if len(g["group"]) > 1 and g["reason"] not in ("global",)]
    without_slow = sum(slow not in g["group"] for g in multi)
    worst = {}
    for stage in sorted({g["stage"] for g in groups}):
        since, seen_round, longest = 0, None, 0
        for g in sorted((g for g in groups if g["stage"] == stage), key=lambda g: (g["round"], g["end"])):
            if g["round"] != seen_round and g["reason"] != "preempted":
                since += 1
                seen_round = g["round"]
            longest = max(longest, since)
            if g["connected"]:
                since = 0
        worst[stage] = longest
    return {
        "groups": len(groups),
        "multi_member_groups": len(multi),
        "multi_member_groups_without_slow": without_slow,
        "graph_syncs": sum(g["reason"] == "graph" for g in groups),
        "longest_unconnected_run_of_rounds": worst,
        "bound_held": all(v <= staleness for v in worst.values()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--slowdown", type=float, default=4.0)
    ap.add_argument("--slow", type=int, default=3, help="the slowed pipeline")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "straggler.md"))
    args = ap.parse_args(argv)

    import sdpipe
    from sdpipe.data import digits, digits_mlp

    train_data, eval_data = digits()
    D, S = args.pipelines, args.stages
    client, cluster = local_cluster(D * S)
    common = dict(stages=S, pipelines=D, epochs=args.epochs, batch_size=args.batch_size, eval_data=eval_data, cluster=client)
    slow = sdpipe.Heterogeneity(slowdown={args.slow: args.slowdown})
    rows = []

    def run(label, policy, hetero, epochs=None):
        t = time.time()
        kw = dict(common)
        if epochs:
            kw["epochs"] = epochs
        r = sdpipe.train(digits_mlp(hidden=args.hidden), train_data, policy=policy, heterogeneity=hetero, **kw).result(timeout=1800)
        last = max(h["epoch"] for h in r.history)
        acc = min(h.get("accuracy", 0) for h in r.history if h["epoch"] == last)
        row = {"scenario": label, "policy": policy, "samples_per_s": throughput(r), "accuracy": acc, "wall_s": time.time() - t,
               "share": {h["pipeline"]: round(sum(x["samples"] for x in r.history if x["pipeline"] == h["pipeline"]) / sum(x["samples"] for x in r.history), 3) for h in r.history}}
        if policy == "sdpipe":
            row["groups"] = connectivity_report(r, 10, args.slow)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return r

    try:
        # speeds of the pipelines, each alone (policy none: nobody waits), for the ideal
        ideal = {}
        for label, hetero in (("homogeneous", None), ("straggler", slow)):
            r = sdpipe.train(digits_mlp(hidden=args.hidden), train_data, policy="none", heterogeneity=hetero, **{**common, "epochs": 2, "eval_data": None}).result(timeout=1800)
            per = {}
            for h in r.history:
                if h["epoch"] == 1:
                    per[h["pipeline"]] = h["samples_per_s"]
            ideal[label] = {"per_pipeline": per, "sum": sum(per.values())}
            print(label, "ideal", ideal[label], flush=True)
        for rep in range(args.repeats):
            for label, hetero in (("straggler", slow), ("homogeneous", None)):
                for policy in (("sdpipe", "allreduce") if rep % 2 == 0 else ("allreduce", "sdpipe")):
                    run(label, policy, hetero)
    finally:
        client.close()
        cluster.close()

    def med(label, policy, key="samples_per_s"):
        return statistics.median(r[key] for r in rows if r["scenario"] == label and r["policy"] == policy)

    summary = {}
    for label in ("straggler", "homogeneous"):
        sd, ar = med(label, "sdpipe"), med(label, "allreduce")
        summary[label] = {"sdpipe": sd, "allreduce": ar, "ratio": sd / ar, "ideal": ideal[label]["sum"],
                          "sdpipe_to_ideal": sd / ideal[label]["sum"], "allreduce_to_ideal": ar / ideal[label]["sum"],
                          "sdpipe_accuracy": med(label, "sdpipe", "accuracy"), "allreduce_accuracy": med(label, "allreduce", "accuracy")}
    meta = run_meta("straggler.py", argv, f"digits MLP 64-{args.hidden}-{args.hidden}-10, S={S}, D={D}, batch {args.batch_size} per pipeline, 4 micro-batches, adam lr 0.002, {args.epochs} epochs, straggler: pipeline {args.slow} slowed {args.slowdown}x (compute), gloo on CPU")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    L = [f"# sdpipe against allreduce with a {args.slowdown:g}x straggler", ""]
    L += meta_lines(meta)
    L += ["", "| scenario | sdpipe samples/s | allreduce samples/s | sdpipe / allreduce | ideal (sum of speeds) | sdpipe / ideal | allreduce / ideal | sdpipe acc | allreduce acc |",
          "|---|---|---|---|---|---|---|---|---|"]
    for label, s in summary.items():
        L.append(f"| {label} | {s['sdpipe']:.0f} | {s['allreduce']:.0f} | {s['ratio']:.2f} | {s['ideal']:.0f} | {s['sdpipe_to_ideal']:.2f} | {s['allreduce_to_ideal']:.2f} | {s['sdpipe_accuracy']:.3f} | {s['allreduce_accuracy']:.3f} |")
    L += ["", "Per-pipeline speeds alone (samples/s, policy none): " + "; ".join(f"{k}: {', '.join(f'{p}: {v:.0f}' for p, v in sorted(x['per_pipeline'].items()))}" for k, x in ideal.items())]
    L += ["", "## Every run", "", "| scenario | policy | samples/s | accuracy | share per pipeline | groups without the slow pipeline | graph syncs | longest unconnected rounds per stage | bound held |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r.get("groups")
        gtxt = f"{g['multi_member_groups_without_slow']} of {g['multi_member_groups']} | {g['graph_syncs']} | {g['longest_unconnected_run_of_rounds']} | {g['bound_held']}" if g else "- | - | - | -"
        L.append(f"| {r['scenario']} | {r['policy']} | {r['samples_per_s']:.0f} | {r['accuracy']:.3f} | {r['share']} | {gtxt} |")
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "ideal": ideal, "rows": rows}, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
