"""The side-by-side suite in one command: engine efficiency, then time to accuracy under heterogeneity.

    python benchmarks/suite.py [--quick]

1. ``engine.py``: sdpipe's ``allreduce`` engine (1F1B, GPipe) against
   ``torch.distributed.pipelining`` on the same model, micro-batching and
   data, contenders alternated over 4 repeats -> ``results/engine_suite.md``,
   ``engine_suite.html``/``.png`` (the digits CNN at 2 x 2; ``engine.md`` holds the matrix of models and
   shapes).
2. ``time_to_accuracy.py``: every policy under none / 2x and 4x persistent
   straggler / transient straggles / a slow link, 3 seeds, policies
   alternated -> ``results/time_to_accuracy.md``, ``.html``/``.png``
   (median and spread; samples/s over the ideal).

Then ``results/suite.md``: the headline numbers, the exact command and the
time each part took.  ``--quick`` runs a small version (1 repeat, 1 seed,
two scenarios) into ``results/quick/`` for a check that everything works.
The full suite takes about 40 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import engine
import time_to_accuracy
from _common import meta_lines, run_meta

HERE = Path(__file__).parent


def minutes(took: dict, part: str) -> str:
    return f"{took[part] / 60:.1f}" if part in took else "- (recorded earlier: see the part's own command)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, 1 seed, two scenarios, into results/quick/")
    ap.add_argument(
        "--summary-only", action="store_true", help="write suite.md from the recorded results without running"
    )
    a = ap.parse_args(argv)
    out = Path(os.path.relpath(HERE / "results" / ("quick" if a.quick else "")))
    out.mkdir(parents=True, exist_ok=True)
    parts = [
        ("engine", engine.main, ["--repeats", "1" if a.quick else "4", "--out", str(out / "engine_suite.md")]),
        (
            "time to accuracy",
            time_to_accuracy.main,
            (["--seeds", "1", "--scenarios", "none,straggler4x", "--max-epochs", "6"] if a.quick else ["--seeds", "3"])
            + ["--out", str(out / "time_to_accuracy.md")],
        ),
    ]
    took = {}
    for name, fn, args in [] if a.summary_only else parts:
        t = time.time()
        print(f"== {name}: {' '.join(args)}", file=sys.stderr)
        fn(args)
        took[name] = time.time() - t

    eng = json.loads((out / "engine_suite.json").read_text())["cells"]
    tta = json.loads((out / "time_to_accuracy.json").read_text())["summary"]
    meta = run_meta("suite.py", argv, "engine.py then time_to_accuracy.py, as listed below")
    lines = [
        "# Side by side: the suite",
        "",
        *meta_lines(meta),
        "",
        "| part | results | minutes |",
        "|---|---|---|",
        f"| engine efficiency | [engine_suite.md](engine_suite.md), [figure](engine_suite.html) | "
        f"{minutes(took, 'engine')} |",
        f"| time to accuracy | [time_to_accuracy.md](time_to_accuracy.md), [figure](time_to_accuracy.html) | "
        f"{minutes(took, 'time to accuracy')} |",
        "",
        "Headlines:",
        "",
    ]
    for cell, table in eng.items():
        for schedule in ("1f1b", "gpipe"):
            ratio = table[f"sdpipe-{schedule}"]["samples_per_s"] / table[f"torch-{schedule}"]["samples_per_s"]
            lines.append(
                f"- {cell}, {schedule}: sdpipe's allreduce engine / torch.distributed.pipelining = {ratio:.2f}x "
                "samples/s (median)"
            )
    cells = {(c["scenario"], c["policy"]): c for c in tta}
    for scen in sorted({c["scenario"] for c in tta}):
        sd = cells.get((scen, "sdpipe"))
        if not sd or not sd["median_seconds"]:
            continue
        others = ", ".join(
            f"{p} {cells[(scen, p)]['median_seconds']:.1f} s"
            for p in ("allreduce", "adpsgd", "ps")
            if (scen, p) in cells and cells[(scen, p)]["median_seconds"]
        )
        speed = f" ({sd['speedup']:.2f}x sooner than allreduce)" if sd.get("speedup") else ""
        lines.append(f"- {scen}: sdpipe reaches the target in {sd['median_seconds']:.1f} s{speed}; {others}")
    (out / "suite.md").write_text("\n".join(lines) + "\n")
    print((out / "suite.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
