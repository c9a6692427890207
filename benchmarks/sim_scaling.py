"""Simulated sdpipe against the ideal and against allreduce as the number of pipelines grows.

    python benchmarks/sim_scaling.py [--pipelines 8,16,32,64,128,256,512,1024] [--stages 4] [--steps 200]
                                     [--costs-from benchmarks/results/sim_agreement.json]

One fixed heterogeneity scenario at every size: every eighth pipeline is
persistently 4x slower, and every stage of every pipeline straggles
transiently (probability 0.05 per step, a delay of one step).  Per-stage costs
are the digits CNN's, calibrated from the real 4 x 2 run recorded by
``benchmarks/sim_agreement.py`` (compute only: their jitter is kept, the
loopback network of that machine is replaced by a fixed cluster network, 10
Gbit/s links, 50 us latency, 0.5 ms scheduler round trip).  The ideal is the
sum of the pipelines' own speeds, simulated with policy ``none`` (nobody waits
for anybody).  Results: ``benchmarks/results/sim_scaling.md``, ``.json`` and the
plot ``sim_scaling.html`` / ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _common import meta_lines, run_meta, save_figure

HERE = Path(__file__).parent


def load_costs(path: Path, stages: int):
    """The compute costs of the real S x D sdpipe homogeneous run in the agreement results (largest D)."""
    import sdpipe

    rows = json.loads(path.read_text())["rows"]
    rows = [r for r in rows if r["stages"] == stages and r["policy"] == "sdpipe" and r["scenario"] == "homogeneous"]
    if not rows:
        raise SystemExit(
            f"--costs-from: {path} has no {stages}-stage sdpipe homogeneous row; run benchmarks/sim_agreement.py"
        )
    c = max(rows, key=lambda r: r["pipelines"])["self_costs"][0]  # one per repeat: the first run's
    return sdpipe.Costs(
        forward=c["forward"],
        backward=c["backward"],
        optimizer=c["optimizer"],
        weight_bytes=c["weight_bytes"],
        activation_bytes=c.get("activation_bytes", ()),
        step_overhead=c["step_overhead"],
        jitter=c.get("jitter", 0.0),
    )


def rate(result) -> float:
    return sum(h["samples"] for h in result.history) / result.wall_time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200, help="steps' worth of batches per pipeline")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--costs-from", default=str(HERE / "results" / "sim_agreement.json"))
    ap.add_argument("--out", default=str(HERE / "results" / "sim_scaling.md"))
    args = ap.parse_args(argv)

    import sdpipe
    from sdpipe.core.schedule import build_plan, dry_run

    S = args.stages
    costs = load_costs(Path(args.costs_from), S)
    net = sdpipe.Network(bandwidth=1.25e9, latency=50e-6, scheduler_rtt=0.5e-3)
    step = dry_run(
        build_plan("1f1b", S, args.microbatches, communication=False),
        lambda a: (costs.forward if a.op == "F" else costs.backward)[a.stage],
    ).makespan
    rows = []
    for D in [int(v) for v in args.pipelines.split(",")]:
        hetero = sdpipe.Heterogeneity(
            slowdown={p: 4.0 for p in range(7, D, 8)}, straggle_prob=0.05, straggle_delay=step
        )
        row = {"pipelines": D}
        for policy in ("none", "sdpipe", "allreduce"):
            t = time.time()
            r = sdpipe.simulate(
                S,
                D,
                epochs=1,
                costs=costs,
                network=net,
                policy=policy,
                steps=args.steps,
                batch_size=args.batch_size,
                microbatches=args.microbatches,
                heterogeneity=hetero,
                record=False,
                seed=D,
            )
            row[policy] = rate(r)
            row[f"{policy}_seconds"] = time.time() - t
        row["sdpipe_to_ideal"] = row["sdpipe"] / row["none"]
        row["sdpipe_to_allreduce"] = row["sdpipe"] / row["allreduce"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    meta = run_meta(
        "sim_scaling.py",
        argv,
        f"{S} stages, 1F1B, {args.microbatches} micro-batches, batch {args.batch_size}, {args.steps} steps of batches "
        f"per pipeline; every 8th pipeline 4x slower, transient straggles p=0.05 of {step * 1e3:.1f} ms (one step); "
        f"network 10 Gbit/s, 50 us, scheduler round trip 0.5 ms",
    )
    out = Path(args.out)
    costs_txt = {
        k: getattr(costs, k)
        for k in ("forward", "backward", "optimizer", "weight_bytes", "activation_bytes", "step_overhead", "jitter")
    }
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "costs": costs_txt, "rows": rows}, indent=1))

    import plotly.graph_objects as go

    xs = [r["pipelines"] for r in rows]
    fig = go.Figure()
    fig.add_scatter(x=xs, y=[r["sdpipe_to_ideal"] for r in rows], mode="lines+markers", name="sdpipe / ideal")
    fig.add_scatter(x=xs, y=[r["sdpipe_to_allreduce"] for r in rows], mode="lines+markers", name="sdpipe / allreduce")
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    fig.update_layout(
        title=f"Simulated throughput ratios, {S} stages, every 8th pipeline 4x slower + transient straggles",
        xaxis_title="pipelines",
        yaxis_title="ratio of samples/s",
        template="plotly_white",
        legend=dict(x=0.01, y=0.99),
    )
    fig.update_xaxes(type="log", tickvals=xs, ticktext=[str(x) for x in xs])
    written = save_figure(fig, out.with_suffix(""))

    lines = [
        "# Simulated scaling: sdpipe against the ideal and allreduce",
        "",
        *meta_lines(meta),
        f"- costs (from {Path(args.costs_from).name}): "
        + ", ".join(
            f"{k} {tuple(round(x, 5) for x in v) if isinstance(v, tuple) else round(v, 5)}"
            for k, v in costs_txt.items()
        ),
        "",
        "| pipelines | ideal samples/s | sdpipe | allreduce | sdpipe / ideal | sdpipe / allreduce "
        "| sdpipe run simulated in |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        secs = r["sdpipe_seconds"]
        lines.append(
            f"| {r['pipelines']} | {r['none']:.0f} | {r['sdpipe']:.0f} | {r['allreduce']:.0f} | "
            f"{r['sdpipe_to_ideal']:.2f} | {r['sdpipe_to_allreduce']:.2f} | {secs:.1f} s |"
        )
    lines += ["", "Plot: " + ", ".join(f"[{p.name}]({p.name})" for p in written)]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
