"""Does emulated heterogeneity mean what it says?  Slowdowns, transient straggles and slow links, measured.

    python benchmarks/heterogeneity.py [--models mlp,cnn,gpt] [--factors 1.5,2,4,8] [--pipelines 4]
                                       [--epochs 4] [--repeats 3] [--straggle 0.2,0.02] [--link-delay 0.01]

Under policy ``none`` nobody waits for anybody, so a pipeline's step time is its own.  Per model, on one
LocalCluster of S x D single-threaded workers, the runs of one repeat alternate (their order reversed every
other repeat): pipeline D-1 slowed by each factor f (``Heterogeneity(slowdown={D-1: f})``), nothing slowed, and
transient straggles on every worker.  A pipeline's step time is the median interval between its stage 0's
consecutive optimizer steps within an epoch.  Recorded:

- the slowed pipeline's step against its own step in the same repeat's run without a slowdown (what the
  factor promises: its step f times as long as it would otherwise take), and against the other pipelines'
  steps in the same run (what a user sees side by side; on a machine with fewer cores than workers the slowed
  pipeline's sleep hands its core to the others, which then step faster);
- transient straggles (probability p, delay d, every worker): a pipeline's mean step against the mean step
  without, next to the expected ``S x p x d`` more;
- a slow link (``link_delay={D-1: d}``, policy ``sdpipe`` with blocking averaging): the mean averaging span of
  groups with pipeline D-1 against those without, next to d.

Results: ``benchmarks/results/heterogeneity.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _common import WORKLOAD_NAMES, local_cluster, results_head, run_meta, train_workload, workload


def step_times(result) -> dict:
    """pipeline -> (median, mean, count) of its stage 0's intervals between consecutive optimizer steps of an epoch."""
    ends: dict = {}
    for e in result.events:
        if e["kind"] == "optimizer" and e["stage"] == 0:
            ends.setdefault((e["pipeline"], e["epoch"]), []).append(e["end"])
    per: dict = {}
    for (p, _), v in ends.items():
        v.sort()
        per.setdefault(p, []).extend(b - a for a, b in zip(v, v[1:]))
    return {p: (statistics.median(v), statistics.mean(v), len(v)) for p, v in sorted(per.items()) if v}


def link_effect(result, slow: int) -> tuple:
    """(mean seconds of the averaging spans of groups with ``slow``, of those without, how many of each)."""
    syncs = [e for e in result.events if e["kind"] == "sync" and e.get("reason") not in ("global", None)]
    syncs = [e for e in syncs if len(e["group"]) > 1 and not e.get("failed")]
    with_ = [e["end"] - e["start"] for e in syncs if slow in e["group"]]
    without = [e["end"] - e["start"] for e in syncs if slow not in e["group"]]
    mean = lambda v: statistics.mean(v) if v else float("nan")
    return mean(with_), mean(without), len(with_), len(without)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(WORKLOAD_NAMES))
    ap.add_argument("--factors", default="1.5,2,4,8")
    ap.add_argument("--pipelines", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--straggle", default="0.2,0.02", help="p,d of the transient straggles (every worker)")
    ap.add_argument("--link-delay", type=float, default=0.01, help="seconds of pipeline D-1's slow link")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "heterogeneity.md"))
    args = ap.parse_args(argv)

    import sdpipe

    D, S = args.pipelines, args.stages
    slow = D - 1
    factors = [float(x) for x in args.factors.split(",")]
    p_straggle, d_straggle = (float(x) for x in args.straggle.split(","))
    contenders = [("plain", None)] + [(f"slowdown {f:g}", sdpipe.Heterogeneity(slowdown={slow: f})) for f in factors]
    contenders.append(
        ("straggles", sdpipe.Heterogeneity(straggle_prob=p_straggle, straggle_delay=d_straggle)),
    )
    rows = []
    client, cluster = local_cluster(D * S)
    try:
        for name in args.models.split(","):
            text = workload(name, S)["text"]
            for rep in range(args.repeats):
                order = contenders if rep % 2 == 0 else contenders[::-1]
                for label, hetero in order:
                    f = hetero.slowdown_of(slow, 0) if hetero is not None else 1.0
                    r = train_workload(
                        name,
                        S,
                        pipelines=D,
                        policy="none",
                        # a pipeline slowed f times takes about 1/f of the others' batches: more epochs give it as
                        # many steps to measure as a factor of 2 would
                        epochs=max(args.epochs, round(args.epochs * f / 2)),
                        batch_size=args.batch_size,
                        heterogeneity=hetero,
                        cluster=client,
                    )
                    row = {"model": name, "text": text, "repeat": rep, "run": label, "steps": step_times(r)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                # a slow link: groups with the slowed pipeline average d later
                r = train_workload(
                    name,
                    S,
                    pipelines=D,
                    policy="sdpipe",
                    scheduler={"overlap": False},
                    epochs=args.epochs,
                    batch_size=args.batch_size,
                    heterogeneity=sdpipe.Heterogeneity(link_delay={slow: args.link_delay}),
                    cluster=client,
                )
                row = {"model": name, "text": text, "repeat": rep, "run": "link", "link": link_effect(r, slow)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        client.close()
        cluster.close()

    meta = run_meta(
        "heterogeneity.py",
        argv,
        f"S={S}, D={D}, batch {args.batch_size} per pipeline, 4 micro-batches, {args.epochs} epochs per run (f / 2 "
        f"times as many for a factor f above 2), policy none (the slow link: sdpipe, blocking averaging), slowed "
        f"pipeline {slow}, straggles p={p_straggle:g} of {d_straggle:g} s on every worker, link delay "
        f"{args.link_delay:g} s, gloo on CPU, {args.repeats} repeats; "
        f"slept heterogeneity (sdpipe._pace)",
    )
    Path(args.out).with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out, L = results_head(args.out, "Emulated heterogeneity, measured", meta)

    def med_spread(v) -> str:
        return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"

    L += [
        "",
        "Step: the median interval between a pipeline's consecutive optimizer steps within an epoch (stage 0). "
        "Per repeat, the slowed pipeline's step is divided by its own step in that repeat's run without a "
        "slowdown (*/ own*: the definition), and by the median of the other pipelines' steps in the same run "
        "(*/ others*); the table gives the median over the repeats and, in brackets, their range.",
        "",
        "| model | f | / own | / others | within 10% of f (/ own) |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for name in args.models.split(","):
        mine = [r for r in rows if r["model"] == name]
        plain = {r["repeat"]: r["steps"] for r in mine if r["run"] == "plain"}
        for f in factors:
            own, others = [], []
            for r in mine:
                if r["run"] != f"slowdown {f:g}" or str(slow) not in map(str, r["steps"]):
                    continue
                steps = {int(k): v for k, v in r["steps"].items()}
                base = {int(k): v for k, v in plain[r["repeat"]].items()}
                own.append(steps[slow][0] / base[slow][0])
                others.append(steps[slow][0] / statistics.median(v[0] for p, v in steps.items() if p != slow))
            ok = abs(statistics.median(own) / f - 1) <= 0.10
            verdicts.append(ok)
            L.append(f"| {name} | {f:g} | {med_spread(own)} | {med_spread(others)} | {'yes' if ok else 'no'} |")
    L += [
        "",
        f"Transient straggles, p = {p_straggle:g} of {d_straggle:g} s on every worker: a pipeline's mean step "
        f"grows by S x p x d = {S * p_straggle * d_straggle * 1000:.1f} ms on average (each stage that straggles "
        "holds the step back by d).  Measured: the mean step of every pipeline in the run with straggles less "
        "its mean step in the same repeat's run without, the median over pipelines and repeats.",
        "",
        "| model | expected (ms) | measured (ms) [range] |",
        "|---|---|---|",
    ]
    for name in args.models.split(","):
        mine = [r for r in rows if r["model"] == name]
        plain = {r["repeat"]: r["steps"] for r in mine if r["run"] == "plain"}
        extra = []
        for r in mine:
            if r["run"] == "straggles":
                for p, v in r["steps"].items():
                    extra.append(1000 * (v[1] - plain[r["repeat"]][p][1]))
        L.append(
            f"| {name} | {S * p_straggle * d_straggle * 1000:.1f} | {statistics.median(extra):.1f} "
            f"[{min(extra):.1f}-{max(extra):.1f}] |"
        )
    L += [
        "",
        f"A slow link, d = {args.link_delay * 1000:g} ms on pipeline {slow} (each averaging its workers take part in "
        "starts d later, so the whole group waits d): the mean averaging span of groups with that pipeline less "
        "those without, per repeat (policy sdpipe, blocking averaging).",
        "",
        "| model | expected (ms) | measured per repeat (ms) |",
        "|---|---|---|",
    ]
    for name in args.models.split(","):
        links = [r["link"] for r in rows if r["model"] == name and r["run"] == "link"]
        got = ", ".join(f"{1000 * (a - b):.1f}" for a, b, _, _ in links)
        L.append(f"| {name} | {args.link_delay * 1000:g} | {got} |")
    out.write_text("\n".join(L) + "\n")
    print(out.read_text())
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
