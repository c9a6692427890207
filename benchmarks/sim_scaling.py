"""Simulated sdpipe against the ideal as the number of pipelines grows, from 8 to 16,384.

    python benchmarks/sim_scaling.py [--pipelines 8,16,...,16384] [--workloads cnn,resnet50,bert-base]
                                     [--gbit 10,100] [--steps 100] [--stages 4]
                                     [--costs-from benchmarks/results/sim_agreement.json]

One heterogeneity scenario at every size: every eighth pipeline is persistently 4x slower (its step stretched
4 times), and every stage of every pipeline straggles transiently (probability 0.05 per step, a delay of one
step).  Workloads: ``cnn``, the digits CNN's per-stage costs calibrated from the real 4 x 2 run recorded by
``benchmarks/sim_agreement.py`` (compute only; batch 64 in 4 micro-batches); ``resnet50`` and ``bert-base``,
the profiles of ``sdpipe.profiles`` on V100 GPUs (micro-batches of 32 and 8 samples, 4 per step); each on
links of ``--gbit`` Gbit/s (50 us latency, 0.5 ms round trip to the group scheduler).

Contenders, alternated at each size: the ideal (policy ``none``: the sum of the pipelines' own speeds, nobody
waits for anybody); ``sdpipe`` as it is now (pairs across the sync graph's components, a group's all-reduce
priced at the cheaper of ring and tree); ``sdpipe, neighbour pairs`` (the same with the prototype's pairing);
with ``--before REV``, ``sdpipe, before`` (simulated by revision REV's code, checked out apart: its design and
its cost model); ``allreduce`` (the ``cnn`` workload only).  Per run: samples/s, its ratio to
the ideal, the longest unconnected stretch of any stage's sync graph against its bound P x D
(``RunResult.bounds``), and the convergence proxy's loss at the end (the mean over the pipelines of their last
epoch's loss: lower is better mixed).  Results: ``benchmarks/results/sim_scaling.md`` and ``.json``, the plot
``sim_scaling.html`` / ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import meta_lines, run_meta, save_figure

HERE = Path(__file__).parent

#: the workloads' (micro-batch samples, micro-batches per step); the cnn's batch is 64 in 4
BATCH = {"cnn": (16, 4), "resnet50": (32, 4), "bert-base": (8, 4)}


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


def scenario(costs, stages: int, microbatches: int, pipelines: int):
    """The benchmark's heterogeneity: every eighth pipeline 4x slower (its step), every stage straggling with
    probability 0.05 per step for one step's compute (1F1B's, without communication)."""
    import sdpipe
    from sdpipe.core.schedule import build_plan, dry_run

    step = dry_run(
        build_plan("1f1b", stages, microbatches, communication=False),
        lambda a: (costs.forward if a.op == "F" else costs.backward)[a.stage],
    ).makespan
    return sdpipe.Heterogeneity(
        slowdown={p: 4.0 for p in range(7, pipelines, 8)}, straggle_prob=0.05, straggle_delay=step
    )


def rate(result) -> float:
    return sum(h["samples"] for h in result.history) / result.wall_time


def workload_costs(name: str, stages: int, costs_from: Path):
    from sdpipe.simulation import profiles

    if name == "cnn":
        return load_costs(costs_from, stages)
    return profiles.profile(name, stages, gpu="V100", microbatch=BATCH[name][0])


def contenders(workload: str) -> dict:
    """name -> (policy, scheduler changes, network's all-reduce model)."""
    out = {
        "ideal": ("none", None, "best"),
        "sdpipe": ("sdpipe", None, "best"),
        "sdpipe, neighbour pairs": ("sdpipe", {"pairing": "neighbours"}, "best"),
    }
    if workload == "cnn":
        out["allreduce"] = ("allreduce", None, "best")
    return out


#: one simulation by the simulator of an earlier revision (run in its checkout): samples/s and the proxy's loss
BEFORE = """
import json, sys
import sdpipe
a = json.loads(sys.argv[1])
c = a["costs"]
costs = sdpipe.Costs(**c)
net = sdpipe.Network(**a["network"])
h = sdpipe.Heterogeneity(slowdown={int(k): v for k, v in a["slowdown"].items()}, straggle_prob=0.05,
                         straggle_delay=a["delay"])
r = sdpipe.simulate(a["S"], a["D"], costs=costs, network=net, policy="sdpipe", steps=a["steps"],
                    batch_size=a["batch"], microbatches=a["M"], heterogeneity=h, record=False, seed=a["D"], epochs=1)
print(json.dumps({"samples_per_s": sum(x["samples"] for x in r.history) / r.wall_time,
                  "proxy_loss": sum(x["loss"] for x in r.history) / len(r.history)}))
"""


def before(path: Path, S: int, D: int, args, costs, net, hetero, micro: int, M: int) -> dict:
    """``sdpipe`` simulated by the revision checked out at ``path`` (its design and cost model)."""
    import dataclasses
    import subprocess

    c = {k: getattr(costs, k) for k in ("forward", "backward", "optimizer", "weight_bytes", "activation_bytes")}
    c |= {"step_overhead": costs.step_overhead, "jitter": list(costs.jitter)}
    a = {
        "costs": {k: list(v) if isinstance(v, tuple) else v for k, v in c.items()},
        "network": {k: v for k, v in dataclasses.asdict(net).items() if k != "allreduce"},
        "slowdown": {str(k): v for k, v in hetero.slowdown.items()},
        "delay": hetero.straggle_delay,
        "S": S,
        "D": D,
        "steps": args.steps,
        "batch": micro * M,
        "M": M,
    }
    t = time.time()
    out = subprocess.run(
        [sys.executable, "-c", BEFORE, json.dumps(a)],
        cwd=path,
        env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode:
        raise SystemExit(f"--before at {path}: {out.stderr.strip().splitlines()[-1]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {**got, "longest": None, "bound": None, "simulated_in_s": time.time() - t}


def one_size(workload: str, gbit: float, D: int, args, costs) -> dict:
    import dataclasses

    import sdpipe
    from sdpipe.simulation import profiles

    S = args.stages
    micro, M = BATCH[workload]
    hetero = scenario(costs, S, M, D)
    base = profiles.network(gbit)  # 50 us links, a 0.5 ms round trip to the scheduler and to a server
    row = {"workload": workload, "gbit": gbit, "pipelines": D}
    for name, (policy, scheduler, model) in contenders(workload).items():
        t = time.time()
        r = sdpipe.simulate(
            S,
            D,
            epochs=1,
            costs=costs,
            network=dataclasses.replace(base, allreduce=model),
            policy=policy,
            scheduler=scheduler,
            steps=args.steps,
            batch_size=micro * M,
            microbatches=M,
            heterogeneity=hetero,
            record=False,
            seed=D,
        )
        row[name] = {
            "samples_per_s": rate(r),
            "longest": max((b["longest"] for b in r.bounds), default=None),
            "bound": max((b["bound"] for b in r.bounds), default=None),
            "proxy_loss": statistics.mean(h["loss"] for h in r.history),
            "simulated_in_s": time.time() - t,
        }
    if args.before_path is not None:
        row["sdpipe, before"] = before(args.before_path, S, D, args, costs, base, hetero, micro, M)
    ideal = row["ideal"]["samples_per_s"]
    for name in row:
        if isinstance(row[name], dict):
            row[name]["to_ideal"] = row[name]["samples_per_s"] / ideal
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", default=",".join(str(2**k) for k in range(3, 15)))
    ap.add_argument("--workloads", default="cnn,resnet50,bert-base")
    ap.add_argument("--gbit", default="10,100")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100, help="steps' worth of batches per pipeline")
    ap.add_argument("--costs-from", default=str(HERE / "results" / "sim_agreement.json"))
    ap.add_argument(
        "--before", default=None, help="a git revision whose simulator runs sdpipe at every size too (its checkout)"
    )
    ap.add_argument("--out", default=str(HERE / "results" / "sim_scaling.md"))
    ap.add_argument("--render", action="store_true", help="only write the results file and plot from its .json")
    args = ap.parse_args(argv)
    if args.render:
        render(Path(args.out))
        return 0
    args.before_path = None
    if args.before:
        import subprocess
        import tempfile

        args.before_path = Path(tempfile.mkdtemp(prefix="sdpipe-before-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(args.before_path), args.before], check=True)

    sizes = [int(v) for v in args.pipelines.split(",")]
    rows = []
    for workload in args.workloads.split(","):
        costs = workload_costs(workload, args.stages, Path(args.costs_from))
        for gbit in (float(g) for g in args.gbit.split(",")):
            for D in sizes:
                row = one_size(workload, gbit, D, args, costs)
                rows.append(row)
                print(
                    f"{workload} {gbit:g} Gbit/s D={D}: "
                    + ", ".join(
                        f"{k} {v['to_ideal']:.3f} (stretch {v['longest']}/{v['bound']}, proxy {v['proxy_loss']:.3g})"
                        for k, v in row.items()
                        if isinstance(v, dict)
                    ),
                    file=sys.stderr,
                    flush=True,
                )

    if args.before_path is not None:
        import subprocess

        subprocess.run(["git", "worktree", "remove", "--force", str(args.before_path)], check=False)
    meta = run_meta(
        "sim_scaling.py",
        argv,
        f"{args.stages} stages, 1F1B, 4 micro-batches, {args.steps} steps of batches per pipeline; every 8th "
        "pipeline 4x slower (its step), transient straggles p=0.05 of one step; links 50 us, scheduler round "
        "trip 0.5 ms",
    )
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    render(out)
    print(out.read_text())
    return 0


def render(out: Path) -> None:
    """The results file and the plot from the ``.json`` beside ``out`` (``python sim_scaling.py --render``)."""
    data = json.loads(out.with_suffix(".json").read_text())
    rows = data["rows"]
    written = _plot(rows, out)
    lines = ["# Simulated scaling: sdpipe against the ideal from 8 to 16,384 pipelines", ""]
    lines += [*meta_lines(data["meta"]), ""]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for gbit in dict.fromkeys(r["gbit"] for r in rows):
            lines += _table(workload, gbit, [r for r in rows if r["workload"] == workload and r["gbit"] == gbit])
    lines += ["Plot: " + ", ".join(f"[{p.name}]({p.name})" for p in written)]
    out.write_text("\n".join(lines) + "\n")


def _table(workload: str, gbit: float, rows: list) -> list:
    names = [k for k in rows[0] if isinstance(rows[0][k], dict) and k != "ideal"]
    head = ["pipelines", "ideal samples/s"]
    for n in names:
        head += [f"{n} / ideal"]
        if n.startswith("sdpipe"):
            head += [f"{n}: longest stretch / bound", f"{n}: proxy loss"]
    lines = [f"## {workload}, {gbit:g} Gbit/s", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["pipelines"]), f"{r['ideal']['samples_per_s']:.0f}"]
        for n in names:
            v = r[n]
            cells.append(f"{v['to_ideal']:.3f}")
            if n.startswith("sdpipe"):
                stretch = "-" if v["longest"] is None else f"{v['longest']} / {v['bound']}"
                cells += [stretch, f"{v['proxy_loss']:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _plot(rows: list, out: Path) -> list:
    import plotly.graph_objects as go

    fig = go.Figure()
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for gbit in dict.fromkeys(r["gbit"] for r in rows):
            mine = [r for r in rows if r["workload"] == workload and r["gbit"] == gbit]
            xs = [r["pipelines"] for r in mine]
            for name, dash in (("sdpipe", "solid"), ("sdpipe, before", "dot")):
                if name not in mine[0]:
                    continue
                fig.add_scatter(
                    x=xs,
                    y=[r[name]["to_ideal"] for r in mine],
                    mode="lines+markers",
                    line_dash=dash,
                    name=f"{name}: {workload}, {gbit:g} Gbit/s",
                )
    fig.add_hline(y=0.9, line_dash="dot", line_color="grey")
    fig.update_layout(
        title="Simulated sdpipe / ideal (every 8th pipeline 4x slower, transient straggles)",
        xaxis_title="pipelines",
        yaxis_title="samples/s against the ideal",
        template="plotly_white",
    )
    fig.update_xaxes(type="log")
    return save_figure(fig, out.with_suffix(""))


if __name__ == "__main__":
    sys.exit(main())
