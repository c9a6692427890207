"""Does the dashboard keep redrawing, and does the notebook stay responsive, during a 4x2 run?

    python benchmarks/dashboard.py [--seconds 20] [--model cnn|mlp]

A real IPython kernel (started with jupyter_client, as JupyterLab starts one)
builds a LocalCluster, starts a 4-pipeline x 2-stage ``sdpipe`` run with a 4x
straggler and displays ``Dashboard(run)``.  While it trains, this script
executes a small cell in that kernel every half second and times each one
from request to reply; at the end it reads the dashboard's own redraw times.
Results: ``benchmarks/results/dashboard.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import meta_lines, run_meta

SETUP = """
import sdpipe
from distributed import Client, LocalCluster
from sdpipe.data import digits, digits_cnn, digits_mlp
from sdpipe.widgets import Dashboard
from IPython.display import display
cluster = LocalCluster(n_workers=8, threads_per_worker=1, host="127.0.0.1", dashboard_address=None)
client = Client(cluster)
train_data, _ = digits()
model = {model}
run = sdpipe.train(model, train_data, stages=2, pipelines=4, policy="sdpipe", epochs=1000, batch_size=64, cuts={cuts},
                   heterogeneity=sdpipe.Heterogeneity(slowdown={{3: 4.0}}), cluster=client)
dash = Dashboard(run, interval=0.25)
display(dash)
"""
STATS = """
import json, time
rate = dash.redraw_rate({seconds})
gaps = [b - a for a, b in zip(dash.redraws[:-1], dash.redraws[1:]) if b > time.monotonic() - {seconds}]
print(json.dumps({{"rate": rate, "redraws": len(dash.redraws), "max_gap": max(gaps) if gaps else None,
                  "events": dash.view.count}}))
"""
TEARDOWN = """
run.stop(); run.result(timeout=120); dash.stop(); client.close(); cluster.close()
"""


def execute(kc, code: str, timeout: float = 300.0):
    """Run ``code`` in the kernel; returns (seconds to the reply, stdout text)."""
    t = time.monotonic()
    msg_id = kc.execute(code)
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    elapsed = time.monotonic() - t
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"kernel: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
    out = []
    while True:  # collect stdout of this request until the kernel is idle again
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    return elapsed, "".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long to probe during training")
    ap.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dashboard.md"))
    args = ap.parse_args(argv)

    from jupyter_client.manager import start_new_kernel

    model, cuts = ("digits_cnn(32)", "(6,)") if args.model == "cnn" else ("digits_mlp()", "None")
    km, kc = start_new_kernel(kernel_name="python3")
    latencies = []
    try:
        execute(kc, SETUP.format(model=model, cuts=cuts))
        time.sleep(5.0)  # the run warms up
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            elapsed, _ = execute(kc, "x = sum(range(1000))", timeout=60)
            latencies.append(elapsed)
            time.sleep(0.5)
        _, text = execute(kc, STATS.format(seconds=args.seconds))
        stats = json.loads(text.strip().splitlines()[-1])
        execute(kc, TEARDOWN)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    lat = sorted(latencies)
    summary = {
        "redraws_per_s": stats["rate"],
        "longest_gap_between_redraws_s": stats["max_gap"],
        "events_seen": stats["events"],
        "cell_latency_s": {
            "median": statistics.median(lat),
            "p95": lat[int(0.95 * (len(lat) - 1))],
            "max": lat[-1],
            "n": len(lat),
        },
    }
    meta = run_meta(
        "dashboard.py",
        argv,
        f"sdpipe run, digits {args.model.upper()}, S=2, D=4, batch 64, pipeline 3 slowed 4x; "
        f"Dashboard(run, interval=0.25) in a jupyter_client kernel; a cell every 0.5 s for {args.seconds:g} s",
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    c = summary["cell_latency_s"]
    L = [
        "# Dashboard redraw rate and notebook responsiveness during a 4x2 run",
        "",
        *meta_lines(meta),
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| dashboard redraws per second | {summary['redraws_per_s']:.2f} | >= 2 |",
        f"| longest gap between redraws | {summary['longest_gap_between_redraws_s']:.2f} s | |",
        f"| cell round trip, median | {c['median'] * 1000:.0f} ms | |",
        f"| cell round trip, 95th percentile | {c['p95'] * 1000:.0f} ms | |",
        f"| cell round trip, slowest of {c['n']} | {c['max'] * 1000:.0f} ms | < 1000 ms |",
        "",
        f"Events the dashboard had taken in: {summary['events_seen']}. The kernel had no browser attached, so this "
        "measures the kernel side (event intake, aggregation, figure updates sent as widget messages); the browser "
        "test (`tests/test_browser.py`) checks that JupyterLab draws them.",
    ]
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "summary": summary, "latencies_s": latencies}, indent=2) + "\n"
    )
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
