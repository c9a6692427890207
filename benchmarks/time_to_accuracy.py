"""Time to a target held-out accuracy, every policy under heterogeneity scenarios, several seeds.

    python benchmarks/time_to_accuracy.py [--scenarios none,straggler2x,straggler4x,transient,slowlink]
                                          [--policies sdpipe,allreduce,adpsgd,ps,none] [--seeds 3]
                                          [--target 0.95] [--max-epochs 12] [--pipelines 4] [--stages 2]
                                          [--channels 64] [--lr 0.002]

The digits CNN (``--channels``, default 64) on one LocalCluster of S x D single-threaded
worker processes (127.0.0.1), evaluated after every epoch.  A run stops once
every pipeline's held-out accuracy reached the target (``run.stop()``); its
time to accuracy is the time of that epoch's last evaluation, from the run's
first step (launching takes ~0.2 s more, recorded as ``launch``).  Each run's
samples/s gives the ratio to the ideal: the sum of the pipelines' speeds
with none waiting, i.e. policy ``none`` in the same scenario.
Policies alternate within each scenario and seed; an unrecorded
warm-up run comes first.  Scenarios: ``none``;
``straggler2x`` / ``straggler4x`` (the last pipeline persistently slower);
``first3x`` (pipeline 0 three times slower: it also hosts the ``ps`` servers);
``transient`` (every worker straggles with probability 0.1 per step for
0.07 s, about a step); ``slowlink`` (the last pipeline's synchronization
delayed 0.05 s).  Results: ``benchmarks/results/time_to_accuracy.md`` and
``.json`` (median and range over seeds).  Besides the policies,
``sdpipe-uniform`` is ``sdpipe`` averaging its groups uniformly (the
paper's mixing) instead of by progress (the default), ``sdpipe-prototype``
is ``sdpipe`` with the prototype's constant window (``window="prototype"``)
and ``sdpipe-overlap`` averages overlapped with compute (``overlap=True``).
A contender ``POLICY@SCHEDULE`` (``allreduce@async-2bw``) runs another schedule than 1F1B.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import VARIANTS, local_cluster, meta_lines, run_meta


def scenario(name: str, D: int):
    import sdpipe

    return {
        "none": None,
        "straggler2x": sdpipe.Heterogeneity(slowdown={D - 1: 2.0}),
        "straggler4x": sdpipe.Heterogeneity(slowdown={D - 1: 4.0}),
        "first3x": sdpipe.Heterogeneity(slowdown={0: 3.0}),
        "transient": sdpipe.Heterogeneity(straggle_prob=0.1, straggle_delay=0.07),
        "slowlink": sdpipe.Heterogeneity(link_delay={D - 1: 0.05}),
    }[name]


def time_to_target(run, D: int, target: float, timeout: float = 1800) -> tuple:
    """(seconds, epochs) when every pipeline's accuracy first reached ``target``; stops the run then."""
    deadline = time.monotonic() + timeout
    reports: dict = {}
    cursor = 0
    while time.monotonic() < deadline:
        events, cursor = run.events_since(cursor)
        for e in events:
            if e["kind"] == "epoch":
                reports.setdefault(e["metrics"]["epoch"], []).append((e["end"], e["metrics"].get("accuracy", 0.0)))
        for epoch in sorted(reports):
            rows = reports[epoch]
            if len(rows) == D and min(a for _, a in rows) >= target:
                run.stop()
                return max(t for t, _ in rows), epoch + 1
        if run.done():
            return None, None
        time.sleep(0.05)
    run.stop()
    return None, None


def _cell(vals: list, missed: int, base=None) -> str:
    if not vals:
        return "not reached"
    med = statistics.median(vals)
    speed = f", {base / med:.2f}x" if base else ""
    return f"{med:.1f} [{min(vals):.1f}-{max(vals):.1f}{speed}]" + (f" ({missed} missed)" if missed else "")


def summarize(rows: list, scenarios: list, policies: list) -> dict:
    """Per scenario and policy: median and range of the time to target and of samples/s, and the ratios."""
    out = {}
    for name in scenarios:
        for policy in policies:
            mine = [r for r in rows if r["scenario"] == name and r["policy"] == policy]
            secs = [r["seconds"] for r in mine if r["seconds"] is not None]
            rates = [r["samples_per_s"] for r in mine if r["samples_per_s"]]
            out[(name, policy)] = {
                "seconds": secs,
                "missed": sum(1 for r in mine if r["seconds"] is None),
                "median_seconds": statistics.median(secs) if secs else None,
                "samples_per_s": rates,
                "median_samples_per_s": statistics.median(rates) if rates else None,
                "epochs": [r["epochs"] for r in mine if r["epochs"]],
            }
        ideal = out.get((name, "none"), {}).get("median_samples_per_s")
        base = out.get((name, "allreduce"), {})
        for policy in policies:
            cell = out[(name, policy)]
            rate = cell["median_samples_per_s"]
            cell["to_ideal"] = rate / ideal if rate and ideal else None
            cell["to_allreduce_rate"] = (
                rate / base["median_samples_per_s"] if rate and base.get("median_samples_per_s") else None
            )
            cell["speedup"] = (
                base["median_seconds"] / cell["median_seconds"]
                if cell["median_seconds"] and base.get("median_seconds")
                else None
            )
    return out


def figure(summary: dict, scenarios: list, policies: list, target: float):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2,
        cols=1,
        vertical_spacing=0.14,
        subplot_titles=(
            f"seconds to {target:.2f} held-out accuracy on every pipeline (median, bars: min-max over seeds)",
            "samples/s / ideal (the sum of the pipelines' speeds with none waiting: policy none)",
        ),
    )
    palette = ["#636efa", "#00cc96", "#ffa15a", "#ef553b", "#ab63fa", "#19d3f3"]
    color = {p: palette[i % len(palette)] for i, p in enumerate(policies)}
    for policy in policies:
        if policy != "none":
            med = [summary[(n, policy)]["median_seconds"] for n in scenarios]
            lo = [min(summary[(n, policy)]["seconds"]) if summary[(n, policy)]["seconds"] else None for n in scenarios]
            hi = [max(summary[(n, policy)]["seconds"]) if summary[(n, policy)]["seconds"] else None for n in scenarios]
            fig.add_trace(
                go.Bar(
                    name=policy,
                    x=scenarios,
                    y=med,
                    legendgroup=policy,
                    offsetgroup=policy,
                    marker_color=color[policy],
                    error_y=dict(
                        type="data",
                        symmetric=False,
                        array=[h - m if m is not None else 0 for h, m in zip(hi, med, strict=True)],
                        arrayminus=[m - low if m is not None else 0 for low, m in zip(lo, med, strict=True)],
                    ),
                ),
                row=1,
                col=1,
            )
        fig.add_trace(
            go.Bar(
                name=policy,
                x=scenarios,
                y=[summary[(n, policy)]["to_ideal"] for n in scenarios],
                legendgroup=policy,
                offsetgroup=policy,
                marker_color=color[policy],
                showlegend=policy == "none",
            ),
            row=2,
            col=1,
        )
    fig.update_layout(barmode="group", template="plotly_white", height=720, width=900)
    fig.update_yaxes(title_text="seconds", row=1, col=1)
    fig.update_yaxes(title_text="ratio", row=2, col=1)
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="none,straggler2x,straggler4x,transient,slowlink")
    ap.add_argument("--policies", default="sdpipe,allreduce,adpsgd,ps,none")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--max-epochs", type=int, default=12)
    ap.add_argument("--pipelines", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--channels", type=int, default=64, help="width of the CNN")
    ap.add_argument("--lr", type=float, default=0.002, help="Adam's learning rate, for every policy")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "time_to_accuracy.md"))
    ap.add_argument(
        "--from-rows",
        nargs="+",
        metavar="FILE",
        help="summarize recorded rows instead of running: .json results files or JSON-lines of rows",
    )
    a = ap.parse_args(argv)
    policies = a.policies.split(",")
    scenarios = a.scenarios.split(",")
    if a.from_rows:
        rows = []
        for f in a.from_rows:
            text = Path(f).read_text()
            rows += (
                json.loads(text)["rows"]
                if f.endswith(".json")
                else [json.loads(x) for x in text.splitlines() if x.strip()]
            )
        meta = run_meta(
            "time_to_accuracy.py",
            argv,
            f"rows recorded by earlier runs ({', '.join(a.from_rows)}): "
            f"digits CNN ({a.channels} channels), {a.stages} stages x {a.pipelines} pipelines, batch 64, "
            f"target {a.target} held-out accuracy on every pipeline, at most {a.max_epochs} epochs",
        )
        write_results(meta, rows, scenarios, policies, a.target, Path(a.out))
        return 0

    from straggler import throughput

    import sdpipe
    from sdpipe.data import digits, digits_cnn

    S, D = a.stages, a.pipelines
    client, cluster = local_cluster(S * D)
    rows = []
    try:
        # warm-up: the worker processes' first run pays for imports and first-time allocations
        sdpipe.train(
            digits_cnn(a.channels),
            digits()[0],
            stages=S,
            pipelines=D,
            cuts=(6,) if S == 2 else None,
            policy="sdpipe",
            epochs=1,
            batch_size=64,
            cluster=client,
        ).result(timeout=600)
        for name in scenarios:
            for seed in range(a.seeds):
                train_data, eval_data = digits(seed=seed)
                order = policies if seed % 2 == 0 else policies[::-1]
                for policy in order:
                    variant, _, schedule = policy.partition("@")  # "allreduce@async-2bw": another schedule
                    mode, sched = VARIANTS.get(variant, (variant, None))
                    run = sdpipe.train(
                        digits_cnn(a.channels, seed=seed),
                        train_data,
                        eval_data=eval_data,
                        stages=S,
                        pipelines=D,
                        cuts=(6,) if S == 2 else None,
                        policy=mode,
                        scheduler=sched,
                        schedule=schedule or "1f1b",
                        epochs=a.max_epochs,
                        batch_size=64,
                        seed=seed,
                        lr=a.lr,
                        heterogeneity=scenario(name, D),
                        cluster=client,
                    )
                    at, epochs = time_to_target(run, D, a.target)
                    result = run.result(timeout=600)
                    first = min(e["start"] for e in result.events if e["kind"] == "forward")
                    rate = throughput(result) if len({h["epoch"] for h in result.history}) > 1 else None
                    row = {
                        "scenario": name,
                        "seed": seed,
                        "policy": policy,
                        "lr": a.lr,
                        "epochs": epochs,
                        "launch": first,
                        "seconds": None if at is None else at - first,
                        "samples_per_s": rate,
                    }
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    finally:
        client.close()
        cluster.close()

    meta = run_meta(
        "time_to_accuracy.py",
        argv,
        f"digits CNN ({a.channels} channels), {S} stages x {D} pipelines, batch 64, "
        f"target {a.target} held-out accuracy on every pipeline, at most {a.max_epochs} epochs, "
        f"{a.seeds} seeds, Adam lr {a.lr}",
    )
    write_results(meta, rows, scenarios, policies, a.target, Path(a.out))
    return 0


def write_results(meta: dict, rows: list, scenarios: list, policies: list, target: float, out: Path) -> None:
    """The results file (.md and .json) and the figure from the rows of every run."""
    from _common import save_figure

    summary = summarize(rows, scenarios, policies)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "summary": [{"scenario": n, "policy": p, **v} for (n, p), v in summary.items()],
            },
            indent=1,
        )
    )
    written = save_figure(figure(summary, scenarios, policies, target), out.with_suffix(""), width=900, height=720)
    lines = [
        "# Time to accuracy",
        "",
        *meta_lines(meta),
        "",
        "Seconds from the run's first step until every pipeline's held-out accuracy reached the target, "
        "evaluated after each epoch: median [min-max] over seeds, then x allreduce (medians). "
        "A run that never reached it within the epochs counts as missed.",
        "",
        "| scenario | " + " | ".join(policies) + " |",
        "|---|" + "---|" * len(policies),
    ]
    for name in scenarios:
        base = summary.get((name, "allreduce"), {}).get("median_seconds")
        lines.append(
            f"| {name} | "
            + " | ".join(_cell(summary[(name, p)]["seconds"], summary[(name, p)]["missed"], base) for p in policies)
            + " |"
        )
    lines += [
        "",
        "Samples/s of all pipelines (median over seeds of each run's median epoch after the first) "
        "and its ratio to the ideal: the sum of the pipelines' speeds with none waiting for another "
        "(policy `none` in the same scenario).",
        "",
        "| scenario | " + " | ".join(policies) + " |",
        "|---|" + "---|" * len(policies),
    ]
    for name in scenarios:
        cells = []
        for p in policies:
            c = summary[(name, p)]
            cells.append(
                f"{c['median_samples_per_s']:.0f} ({c['to_ideal']:.2f} of ideal)"
                if c["median_samples_per_s"] and c["to_ideal"]
                else (f"{c['median_samples_per_s']:.0f}" if c["median_samples_per_s"] else "-")
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Figure: " + ", ".join(f"[{w.name}]({w.name})" for w in written)]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    sys.exit(main())
