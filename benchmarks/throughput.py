"""Samples/s of the digits MLP for D in {1, 2, 4} pipelines and S in {1, 2} stages.

    python benchmarks/throughput.py [--epochs 4] [--policy allreduce] [--out benchmarks/results/throughput.md]

All configurations share one embedded LocalCluster of 8 single-threaded
worker processes (bound to 127.0.0.1) so that cluster start-up is not timed.
Throughput is the sum over pipelines of samples/s, the median over the epochs
after the first (which includes process-group set-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--policy", default="allreduce")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "throughput.md"))
    args = ap.parse_args(argv)

    import sdpipe
    from sdpipe.data import digits, digits_mlp

    train_data, _ = digits()
    client, cluster = local_cluster(8)
    rows = []
    try:
        for S in (1, 2):
            for D in (1, 2, 4):
                t = time.time()
                r = sdpipe.train(
                    digits_mlp(),
                    train_data,
                    stages=S,
                    pipelines=D,
                    policy=args.policy,
                    schedule=args.schedule,
                    epochs=args.epochs,
                    cluster=client,
                ).result(timeout=900)
                per_epoch = [
                    sum(h["samples_per_s"] for h in r.history if h["epoch"] == e) for e in range(1, args.epochs)
                ]
                rows.append(
                    {
                        "stages": S,
                        "pipelines": D,
                        "samples_per_s": statistics.median(per_epoch),
                        "min": min(per_epoch),
                        "max": max(per_epoch),
                        "wall_s": time.time() - t,
                    }
                )
                print(
                    f"S={S} D={D}: {rows[-1]['samples_per_s']:.0f} samples/s "
                    f"(epochs 2..{args.epochs}: {min(per_epoch):.0f}-{max(per_epoch):.0f})",
                    flush=True,
                )
    finally:
        client.close()
        cluster.close()

    meta = run_meta(
        "throughput.py",
        argv,
        "digits MLP 64-128-128-10, batch 32 per pipeline, 4 micro-batches, "
        f"policy {args.policy}, schedule {args.schedule}, gloo on CPU",
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Throughput of the digits MLP", ""]
    lines += meta_lines(meta)
    lines += [
        "",
        "| stages S | pipelines D | samples/s (median) | range over epochs | run wall s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stages']} | {r['pipelines']} | {r['samples_per_s']:.0f} | "
            f"{r['min']:.0f}-{r['max']:.0f} | {r['wall_s']:.1f} |"
        )
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
