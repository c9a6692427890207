"""How fast the simulator runs at scale: the two sizes it is held to, seconds on this machine.

    python benchmarks/sim_speed.py [--repeats 3] [--large-repeats 1] [--before REV] [--before-large N]
                                   [--sweep 1024,4096,16384]

- *events*: 1,024 pipelines x 4 stages x 200 steps under ``sdpipe``, every event recorded;
- *large*: 16,384 pipelines x 4 stages x 100 steps under ``sdpipe``, no events (``record=False``).

Both on the ResNet-50 profile (V100, ``sdpipe.profiles.resnet50``) on 10 Gbit/s links, with the
prototype's transient straggles (p = 0.1, 50 ms).  Each measurement is a fresh Python process (an
import and the run; the seconds are the ``simulate`` call's own), the cases alternating, so a
noisy moment of the machine spreads over both.  ``--before REV`` adds the same *events* case run by
the simulator of git revision REV (checked out into a temporary folder), alternating with ours, and with
``--before-large N`` N runs of its *large* case too.
``--sweep`` adds, once each, runs of 30 steps without events at those numbers of pipelines: the
microseconds per worker step as the simulation grows.
Results: ``benchmarks/results/sim_speed.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import meta_lines, run_meta

HERE = Path(__file__).parent
ROOT = HERE.parent

#: the measurement, run in a fresh interpreter: prints the simulate call's seconds and what it made
PROBE = """
import json, sys, time
import sdpipe
D, steps, record = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
if hasattr(sdpipe, "profiles"):  # not an import: an editable install would lend an older revision its module
    costs, net = sdpipe.profiles.resnet50(4, gpu="V100"), sdpipe.profiles.network(10)
else:  # a revision from before the profiles: the same numbers, spelled out
    fields = sdpipe.Costs.__dataclass_fields__
    costs = sdpipe.Costs(**{k: v for k, v in json.loads(sys.argv[4]).items() if k in fields})
    net = sdpipe.Network(bandwidth=1.25e9, latency=50e-6, scheduler_rtt=0.5e-3)
hetero = sdpipe.Heterogeneity(straggle_prob=0.1, straggle_delay=0.05)
t = time.perf_counter()
r = sdpipe.simulate(4, D, costs=costs, network=net, policy="sdpipe", steps=steps, heterogeneity=hetero,
                    batch_size=128, record=record, epochs=1)
took = time.perf_counter() - t
print(json.dumps({"seconds": took, "events": len(r.events), "simulated_s": r.wall_time,
                  "samples": sum(h["samples"] for h in r.history)}))
"""

CASES = {"events": (1024, 200, True), "large": (16384, 100, False)}


def measure(case: str, path: Path, costs_json: str) -> dict:
    D, steps, record = CASES[case]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(D), str(steps), "1" if record else "0", costs_json],
        cwd=path,
        env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode:
        raise SystemExit(f"{case} at {path}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="measurements of the events case")
    ap.add_argument("--large-repeats", type=int, default=1, help="measurements of the large case")
    ap.add_argument("--before", default=None, help="a git revision whose simulator runs the events case too")
    ap.add_argument("--before-large", type=int, default=0, help="measurements of the large case by --before")
    ap.add_argument("--sweep", default="", help="pipelines of the per-step sweep (30 steps each, no events)")
    ap.add_argument("--out", default=str(HERE / "results" / "sim_speed.md"))
    args = ap.parse_args(argv)

    import dataclasses

    from sdpipe.simulation.profiles import resnet50

    costs_json = json.dumps(dataclasses.asdict(resnet50(4, gpu="V100")))
    contenders = {"now": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            before = Path(tmp) / "before"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True
            )
            contenders[f"before ({args.before})"] = before
        runs: dict = {}
        try:
            for i in range(max(args.repeats, args.large_repeats, args.before_large)):
                for name, path in contenders.items():
                    for case in CASES:
                        if case == "large":
                            want = args.large_repeats if name == "now" else args.before_large
                        else:
                            want = args.repeats
                        if i >= want:
                            continue
                        m = measure(case, path, costs_json)
                        runs.setdefault((name, case), []).append(m)
                        print(f"{name} {case}: {m['seconds']:.1f} s", file=sys.stderr)
        finally:
            if args.before:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)

        sweep = []
        for D in [int(v) for v in args.sweep.split(",") if v]:
            CASES[f"sweep{D}"] = (D, 30, False)
            m = measure(f"sweep{D}", ROOT, costs_json)
            sweep.append(
                {"pipelines": D, "seconds": m["seconds"], "us_per_worker_step": 1e6 * m["seconds"] / (D * 4 * 30)}
            )
            print(f"sweep {D}: {m['seconds']:.1f} s", file=sys.stderr)

    targets = {"events": 15.0, "large": 60.0}
    rows = []
    for (name, case), ms in runs.items():
        secs = [m["seconds"] for m in ms]
        D, steps, record = CASES[case]
        rows.append(
            {
                "contender": name,
                "case": case,
                "pipelines": D,
                "steps": steps,
                "record": record,
                "seconds": secs,
                "median": statistics.median(secs),
                "events": ms[0]["events"],
                "simulated_s": ms[0]["simulated_s"],
                "target": targets[case],
            }
        )
    meta = run_meta(
        "sim_speed.py",
        argv,
        "4 stages, sdpipe, ResNet-50 on V100 (sdpipe.profiles), 10 Gbit/s, transient straggles p=0.1 of 50 ms",
    )
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "sweep": sweep}, indent=1))
    lines = [
        "# Simulator speed at scale",
        "",
        *meta_lines(meta),
        "",
        "| contender | case | pipelines x stages x steps | events recorded | median s (each) | target |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{s:.1f}" for s in r["seconds"])
        met = "met" if r["median"] <= r["target"] else "missed"
        lines.append(
            f"| {r['contender']} | {r['case']} | {r['pipelines']} x 4 x {r['steps']} | {r['events']:,} | "
            f"{r['median']:.1f} ({each}) | {r['target']:.0f} s ({met}) |"
        )
    if sweep:
        lines += [
            "",
            "Without events, 30 steps, once each: seconds per worker step as the simulation grows.",
            "",
            "| pipelines | seconds | us per worker step |",
            "|---|---|---|",
        ]
        lines += [f"| {r['pipelines']} | {r['seconds']:.1f} | {r['us_per_worker_step']:.1f} |" for r in sweep]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
