"""Does emulated heterogeneity mean what it says?  Slowdowns, transient straggles and slow links, measured.

    python benchmarks/heterogeneity.py [--models mlp,cnn,gpt] [--factors 1.5,2,4,8] [--pipelines 4]
                                       [--repeats 3] [--straggle 0.2,0.02] [--link-delay 0.01]

Every comparison is made within one run, so that the machine's drift from run to run (on this 2-core machine
two runs of one configuration differ by up to 20%) does not enter it.  Per model and repeat, on one LocalCluster
of S x D single-threaded workers:

- **slowdown**: one run under ``none`` (nobody waits for anybody, so a pipeline's step is its own) whose pipeline
  D-1 is slowed live, phase after phase: nothing, f1, nothing, f2, ... (``run.set_heterogeneity``).  Each phase
  lasts 40 of that pipeline's steps.  Its steps fall into phases by the heterogeneity version its stage 0
  took up at each step (the worker's ``control`` records); a step is stage 0's interval between consecutive
  optimizer steps of an epoch (the sleep that stretches a step lies between them).  Recorded per factor: the
  median slowed step over the
  median step of the same pipeline in the phases without (*/ own*: the factor's definition, its step f times
  as long as it would otherwise take), and over the other pipelines' median step in the same phase (*/ others*:
  what a user sees side by side; where workers share cores the sleeping pipeline hands its core to the others,
  which then step faster);
- **transient straggles** (probability p, delay d, every worker): one run under ``none``; each of a pipeline's
  steps (stage 0's interval between optimizer steps) grouped by how many of its workers straggled in it (their
  ``straggle`` spans); the median step with k straggles less the median step with none, next to k x d;
- **a slow link** (``link_delay={D-1: d}``): one run under ``sdpipe`` with blocking averaging; the median
  averaging span of groups with pipeline D-1 less the median of those without, next to d.

Results: ``benchmarks/results/heterogeneity.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from _common import WORKLOAD_NAMES, local_cluster, results_head, run_meta, train_workload, workload

#: steps of the slowed pipeline per phase (about half of them count: intervals across an epoch's end do not)
PHASE_STEPS = 40


def _median(v):
    return statistics.median(v) if v else float("nan")


def slowdown_phases(result, slow: int) -> dict:
    """Per pipeline and heterogeneity version its stage 0 was under: stage 0's intervals between consecutive
    optimizer steps of one epoch (a step's sleep lies between its optimizer and the next step's)."""
    applied: dict = {}  # pipeline -> [(step, version)] as its stage 0 took them up
    for e in result.events:
        if e["kind"] == "control" and e.get("what") == "heterogeneity" and e.get("applied_by") == "worker":
            if e["stage"] == 0:
                applied.setdefault(e["pipeline"], []).append((e["step"], e["version"]))

    def version_of(p, step):
        v = 0
        for k, ver in sorted(applied.get(p, [])):
            if k <= step - 2:  # two steps after the change: the first one may straddle it
                v = ver
            elif k <= step:
                return None
        return v

    opt: dict = {}
    for e in result.events:
        if e["kind"] == "optimizer" and e["stage"] == 0:
            opt.setdefault(e["pipeline"], []).append((e["step"], e.get("epoch"), e["end"]))
    # (pipeline, step) -> the seconds stage 0 slept to stretch the step before it (recorded under ``step``)
    slept: dict = {}
    for e in result.events:
        if e["kind"] == "straggle" and e.get("what") == "slowdown" and e["stage"] == 0:
            slept[(e["pipeline"], e["step"])] = slept.get((e["pipeline"], e["step"]), 0.0) + e["end"] - e["start"]
    intervals: dict = {}  # "pipeline,version" -> [seconds]
    stretched: dict = {}  # "pipeline,version" -> [interval / (interval - its sleep)]: the stretch slept
    for p, v in opt.items():
        v.sort()
        for (k0, e0, t0), (k1, e1, t1) in itertools.pairwise(v):
            ver = version_of(p, k1)
            if k1 == k0 + 1 and e0 == e1 and ver is not None and version_of(p, k0) == ver:
                intervals.setdefault(f"{p},{ver}", []).append(t1 - t0)
                sleep = slept.get((p, k1), 0.0)
                if 0 < sleep < t1 - t0:
                    stretched.setdefault(f"{p},{ver}", []).append((t1 - t0) / (t1 - t0 - sleep))
    return {"intervals": intervals, "applied": stretched}


def straggle_effect(result, S: int) -> dict:
    """k -> the stage-0 intervals of steps in which k of the pipeline's workers straggled."""
    hits: dict = {}
    for e in result.events:
        if e["kind"] == "straggle" and e.get("what") != "slowdown":
            hits[(e["pipeline"], e["step"])] = hits.get((e["pipeline"], e["step"]), 0) + 1
    opt: dict = {}
    for e in result.events:
        if e["kind"] == "optimizer" and e["stage"] == 0:
            opt.setdefault(e["pipeline"], []).append((e["step"], e.get("epoch"), e["end"]))
    by_k: dict = {}
    for p, v in opt.items():
        v.sort()
        for (k0, e0, t0), (k1, e1, t1) in itertools.pairwise(v):
            if k1 == k0 + 1 and e0 == e1:
                by_k.setdefault(hits.get((p, k1), 0), []).append(t1 - t0)
    return by_k


def link_effect(result, slow: int) -> tuple:
    """(median seconds of the averaging spans of groups with ``slow``, of those without, how many of each)."""
    syncs = [e for e in result.events if e["kind"] == "sync" and e.get("round") is not None]
    syncs = [e for e in syncs if len(e["group"]) > 1 and e.get("reason") != "global" and not e.get("failed")]
    with_ = [e["end"] - e["start"] for e in syncs if slow in e["group"]]
    without = [e["end"] - e["start"] for e in syncs if slow not in e["group"]]
    return _median(with_), _median(without), len(with_), len(without)


def live_slowdowns(name: str, S: int, D: int, factors: list, batch_size: int, client) -> tuple:
    """One ``none`` run of workload ``name`` whose last pipeline is slowed by each factor in turn, a phase without
    between them; returns (its result, heterogeneity version -> factor)."""
    import sdpipe

    slow = D - 1
    w = workload(name, S)
    w.pop("text"), w.pop("eval_data")
    model, data = w.pop("model"), w.pop("train_data")
    run = sdpipe.train(
        model, data, stages=S, pipelines=D, policy="none", epochs=10_000, batch_size=batch_size, cluster=client, **w
    )
    versions = {0: 1.0}
    failure = []

    def steps_of(p):
        return [e for e in run.events if e["kind"] == "optimizer" and e["stage"] == 0 and e["pipeline"] == p]

    def wait_steps(n, timeout=600):
        start, deadline = len(steps_of(slow)), time.monotonic() + timeout
        while len(steps_of(slow)) < start + n and time.monotonic() < deadline and not run.done():
            time.sleep(0.05)

    def plan():
        try:
            wait_steps(20)  # warm
            for k, f in enumerate(factors):
                run.set_heterogeneity(slowdown={slow: f})
                versions[2 * k + 1] = f
                wait_steps(PHASE_STEPS)
                run.set_heterogeneity(None)
                versions[2 * k + 2] = 1.0
                wait_steps(PHASE_STEPS)
        except Exception as e:  # said by the caller
            failure.append(e)
        finally:
            run.stop()

    steering = threading.Thread(target=plan, name="heterogeneity-plan", daemon=True)
    steering.start()
    result = run.result(timeout=3600)
    steering.join(30)
    if failure:
        raise failure[0]
    return result, versions


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(WORKLOAD_NAMES))
    ap.add_argument("--factors", default="1.5,2,4,8")
    ap.add_argument("--pipelines", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4, help="epochs of the straggle and link runs")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--straggle", default="0.2,0.02", help="p,d of the transient straggles (every worker)")
    ap.add_argument("--link-delay", type=float, default=0.01, help="seconds of pipeline D-1's slow link")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "heterogeneity.md"))
    ap.add_argument(
        "--runs",
        default="slowdown,straggles,link",
        help="the runs to measure; the others' rows are kept from the results' .json file",
    )
    args = ap.parse_args(argv)
    runs = set(args.runs.split(","))

    import sdpipe

    D, S = args.pipelines, args.stages
    slow = D - 1
    factors = [float(x) for x in args.factors.split(",")]
    p_straggle, d_straggle = (float(x) for x in args.straggle.split(","))
    made = Path(args.out).with_suffix(".json")
    rows = [r for r in json.loads(made.read_text())["rows"] if r["run"] not in runs] if made.exists() else []
    client, cluster = local_cluster(D * S)
    try:
        for name in args.models.split(","):
            text = workload(name, S)["text"]
            for rep in range(args.repeats):
                common = dict(pipelines=D, epochs=args.epochs, batch_size=args.batch_size, cluster=client)
                if "slowdown" in runs:
                    order = factors if rep % 2 == 0 else factors[::-1]
                    r, versions = live_slowdowns(name, S, D, order, args.batch_size, client)
                    row = {"model": name, "text": text, "repeat": rep, "run": "slowdown", "versions": versions}
                    row.update(slowdown_phases(r, slow))
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k in ("model", "repeat", "run", "versions")}))
                if "straggles" in runs:
                    r = train_workload(
                        name,
                        S,
                        policy="none",
                        heterogeneity=sdpipe.Heterogeneity(straggle_prob=p_straggle, straggle_delay=d_straggle),
                        **common,
                    )
                    rows.append({"model": name, "repeat": rep, "run": "straggles", "by_hits": straggle_effect(r, S)})
                if "link" in runs:
                    r = train_workload(
                        name,
                        S,
                        policy="sdpipe",
                        scheduler={"overlap": False},
                        heterogeneity=sdpipe.Heterogeneity(link_delay={slow: args.link_delay}),
                        **common,
                    )
                    rows.append({"model": name, "repeat": rep, "run": "link", "link": link_effect(r, slow)})
                if rows and rows[-1]["run"] != "slowdown":  # (a slowdown row's summary is printed above)
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        client.close()
        cluster.close()
    return report(rows, args, argv)


def report(rows: list, args, argv) -> int:
    D, S = args.pipelines, args.stages
    slow = D - 1
    factors = [float(x) for x in args.factors.split(",")]
    p_straggle, d_straggle = (float(x) for x in args.straggle.split(","))
    meta = run_meta(
        "heterogeneity.py",
        argv,
        f"S={S}, D={D}, batch {args.batch_size} per pipeline, 4 micro-batches; slowdowns of pipeline {slow} set live "
        f"in one run under none per repeat; straggles p={p_straggle:g} of {d_straggle:g} s on every worker and a "
        f"link delay of {args.link_delay:g} s on pipeline {slow} in runs of {args.epochs} epochs; gloo on CPU, "
        f"{args.repeats} repeats; slept heterogeneity (sdpipe.worker.pace)"
        + (
            f"; measured by this command: {args.runs} (the other runs' rows kept from the results before it)"
            if args.runs != "slowdown,straggles,link"
            else ""
        ),
    )
    Path(args.out).with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out, L = results_head(args.out, "Emulated heterogeneity, measured", meta)

    def med_spread(v) -> str:
        v = [x for x in v if x == x]
        return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" if v else "-"

    L += [
        "",
        "**Slowdown.** Per repeat and factor: the slowed pipeline's median step in the phase (its own time plus "
        "the sleep that stretches it) over its median step in the phases without a slowdown (*/ own*), and over "
        "the other pipelines' median step in the same phase (*/ others*); the median over the repeats, their range "
        "in brackets.  *steps*: the slowed steps measured, over the repeats.  *applied*: per slowed step, the step "
        "over the step less the sleep that stretched it (the stretch the worker applied to what that step took; "
        "*/ own* differs from it where the unslept part of a step took another time than in the phases without, "
        "as when the machine's other workers hand it more or less of a core).",
        "",
        "| model | f | / own | / others | applied | steps | / own within 10% of f |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name in dict.fromkeys(r["model"] for r in rows):
        runs = [r for r in rows if r["model"] == name and r["run"] == "slowdown"]
        for f in factors:
            own, others, stretch, n = [], [], [], 0
            for r in runs:
                intervals = {tuple(int(x) for x in k.split(",")): v for k, v in r["intervals"].items()}
                versions = {int(k): v for k, v in r["versions"].items()}
                plain = [x for (p, ver), v in intervals.items() if p == slow and versions.get(ver) == 1.0 for x in v]
                for ver, fv in versions.items():
                    steps = intervals.get((slow, ver), [])
                    if fv != f or not steps:
                        continue
                    n += len(steps)
                    mine = statistics.median(steps)
                    own.append(mine / _median(plain))
                    rest = [x for (p, v2), v in intervals.items() if p != slow and v2 == ver for x in v]
                    others.append(mine / _median(rest))
                    stretch.append(_median(r.get("applied", {}).get(f"{slow},{ver}", [])))
            ok = bool(own) and abs(statistics.median(own) / f - 1) <= 0.10
            verdicts.append(ok)
            L.append(
                f"| {name} | {f:g} | {med_spread(own)} | {med_spread(others)} | {med_spread(stretch)} | {n} "
                f"| {'yes' if ok else 'no'} |"
            )
    L += [
        "",
        f"**Transient straggles**, p = {p_straggle:g} of {d_straggle:g} s on every worker (S = {S}: a pipeline's "
        f"step grows by S x p x d = {S * p_straggle * d_straggle * 1000:.1f} ms on average).  Per repeat: the "
        "median step (stage 0's interval) in which k of the pipeline's workers straggled less the median step in "
        "which none did, next to k x d; the median over the repeats and their range.",
        "",
        "| model | k | expected (ms) | measured (ms) | steps |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        runs = [r for r in rows if r["model"] == name and r["run"] == "straggles"]
        for k in (1, 2):
            got, n = [], 0
            for r in runs:
                by = {int(x): v for x, v in r["by_hits"].items()}
                if by.get(k) and by.get(0):
                    got.append(1000 * (statistics.median(by[k]) - statistics.median(by[0])))
                    n += len(by[k])
            if got:
                L.append(
                    f"| {name} | {k} | {1000 * k * d_straggle:.0f} | {statistics.median(got):.1f} "
                    f"[{min(got):.1f}-{max(got):.1f}] | {n} |"
                )
    L += [
        "",
        f"**A slow link**, d = {args.link_delay * 1000:g} ms on pipeline {slow} (each averaging its workers take part "
        "in starts d later, so the whole group waits d): per repeat, the median averaging span of groups with that "
        "pipeline less the median of those without (policy sdpipe, blocking averaging), with how many of each.",
        "",
        "| model | expected (ms) | measured per repeat (ms) |",
        "|---|---|---|",
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        links = [r["link"] for r in rows if r["model"] == name and r["run"] == "link"]
        got = ", ".join(f"{1000 * (a - b):.1f} ({n1} / {n2})" for a, b, n1, n2 in links)
        L.append(f"| {name} | {args.link_delay * 1000:g} | {got} |")
    out.write_text("\n".join(L) + "\n")
    print(out.read_text())
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
