"""One real-run benchmark at this tree and at an earlier revision, alternated in one invocation.

    python benchmarks/revisions.py --before REV [--repeats 3] [--metrics samples_per_s,accuracy,...]
                                   [--out benchmarks/results/revisions.md] -- SCRIPT [ARGS...]
    python benchmarks/revisions.py --render OUT     # rewrite OUT (.md) from its .json

``SCRIPT`` is one of this folder's benchmark scripts (``group_sizes.py``, ``straggler.py``, ``hosts.py``, ...)
with its own arguments, which should ask for one repeat per invocation.  Every round runs it once at this tree
and once at revision ``REV`` (checked out apart as a git worktree: its code and its copy of the script), the
order reversed every round so that drift of this noisy machine falls on both alike; each run is its own process
with ``PYTHONPATH`` set to its tree (Dask's worker processes inherit it; ``--script-here``: this tree's copy of
the script at both, for a script ``REV`` does not have) and writes its results to a temporary
file.  The rows of every run's ``.json`` (its lists ``rows`` or ``real``) are matched by their ``--keys``
fields (those a row has: scenario, policy, contender, pipelines, stages); per row and revision: the median of
each metric over the rounds, with min-max.
Metrics are the rows' numeric fields, a nested one by its dotted path (``groups.graph_syncs``); a field that
holds one number per stage (``groups.longest_unconnected_updates``) counts as its largest.
Results: ``--out`` (.md and .json).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import results_head, run_meta

HERE = Path(__file__).parent
ROOT = HERE.parent

DEFAULT_METRICS = (
    "samples_per_s,accuracy,time_to_target,wait_share,three_plus,groups.graph_syncs,"
    "groups.longest_unconnected_updates,groups.bound,signals_per_s,cpu_us_per_signal"
)


def flatten(row: dict, prefix: str = "") -> dict:
    """``row``'s numeric fields by dotted path; a dict of numbers only (one per stage or pipeline) as its max."""
    out = {}
    for k, v in row.items():
        name = f"{prefix}{k}"
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            out[name] = float(v)
        elif isinstance(v, dict) and v and all(isinstance(x, (int, float)) for x in v.values()):
            out[name] = float(max(v.values()))
        elif isinstance(v, dict):
            out.update(flatten(v, name + "."))
    return out


def rows_of(path: Path, keys: list) -> list:
    """The result rows of one run's .json: (its ``keys`` fields, its numeric fields)."""
    data = json.loads(path.read_text())
    rows = data.get("rows") or data.get("real") or []
    return [(tuple((k, str(r[k])) for k in keys if k in r), flatten(r)) for r in rows]


def run_once(tree: Path, script: Path, args: list, out: Path, timeout: float, keys: list) -> tuple:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    t = time.time()
    cmd = [sys.executable, str(script), *args, "--out", str(out)]
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{script} at {tree}: no result within --timeout {timeout:g} s") from None
    if p.returncode:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{script} at {tree} exited with {p.returncode}: {tail}")
    return rows_of(out.with_suffix(".json"), keys), time.time() - t


def summarize(runs: dict, metrics: list) -> list:
    """Per row key and revision, per metric: (median, min, max, n) over the rounds."""
    table: dict = {}
    for rev, per_round in runs.items():
        for rows in per_round:
            for key, vals in rows:
                for m in metrics:
                    if m in vals:
                        table.setdefault(key, {}).setdefault(rev, {}).setdefault(m, []).append(vals[m])
    out = []
    for key, revs in table.items():
        entry = {"row": dict(key), "revisions": {}}
        for rev, ms in revs.items():
            entry["revisions"][rev] = {
                m: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} for m, v in ms.items()
            }
        out.append(entry)
    return out


def fmt(s) -> str:
    if s is None:
        return "-"
    v = s["median"]
    whole = all(float(x).is_integer() for x in (v, s["min"], s["max"]))
    digits = (lambda x: f"{x:.3f}") if abs(v) < 10 and not whole else (lambda x: f"{x:,.0f}")
    if s["min"] == s["max"]:
        return digits(v)
    return f"{digits(v)} [{digits(s['min'])}-{digits(s['max'])}]"


def write(out: Path, meta: dict, summary: list, metrics: list, labels: list) -> None:
    out, lines = results_head(out, meta["title"], {k: v for k, v in meta.items() if k != "title"})
    lines += [
        "",
        f"Each round ran the script once at each revision, the order reversed every round; median over "
        f"{meta['repeats']} rounds [min-max]. `{labels[0]}` is this tree, `{labels[1]}` the revision before.",
        "",
    ]
    present = [m for m in metrics if any(m in e["revisions"].get(r, {}) for e in summary for r in labels)]
    keys = sorted({k for e in summary for k in e["row"]})
    lines.append("| " + " | ".join([*keys, "revision", *present]) + " |")
    lines.append("|" + "---|" * (len(keys) + 1 + len(present)))
    for e in summary:
        for rev in labels:
            got = e["revisions"].get(rev, {})
            cells = [e["row"].get(k, "") for k in keys] + [rev] + [fmt(got.get(m)) for m in present]
            lines.append("| " + " | ".join(cells) + " |")
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--render"]:  # only rewrite a results file from its .json
        out = Path(argv[1] if len(argv) > 1 else HERE / "results" / "revisions.md")
        data = json.loads(out.with_suffix(".json").read_text())
        meta, summary = data["meta"], data["summary"]
        labels = list(summary[0]["revisions"]) if summary else []
        write(out, meta, summary, meta.get("metrics", DEFAULT_METRICS).split(","), labels)
        return 0
    if "--" not in argv:
        raise SystemExit("usage: revisions.py --before REV [options] -- SCRIPT [ARGS...]")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the git revision to alternate with this tree")
    ap.add_argument("--repeats", type=int, default=3, help="rounds: runs of the script at each revision")
    ap.add_argument("--metrics", default=DEFAULT_METRICS)
    ap.add_argument("--keys", default="scenario,policy,contender,pipelines,stages", help="fields that name a row")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one run of the script may take")
    ap.add_argument(
        "--script-here",
        action="store_true",
        help="run this tree's copy of SCRIPT at both revisions (a script REV does not have); only sdpipe differs",
    )
    ap.add_argument("--title", default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "revisions.md"))
    args = ap.parse_args(argv[:cut])
    script, script_args = argv[cut + 1], argv[cut + 2 :]
    if not script or not (HERE / script).is_file():
        raise SystemExit(f"SCRIPT: {script!r} is not a script of {HERE}")
    if "--out" in script_args:
        raise SystemExit("ARGS: --out is set by revisions.py (each run writes its own file)")
    metrics, keys = args.metrics.split(","), args.keys.split(",")
    now = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    labels = [f"this tree ({now.stdout.strip()})", args.before]
    tmp = Path(tempfile.mkdtemp(prefix="sdpipe-revisions-"))
    before = tmp / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True)
    runs: dict = {label: [] for label in labels}
    walls: dict = {label: [] for label in labels}
    try:
        for r in range(args.repeats):
            order = [(labels[0], ROOT), (labels[1], before)]
            for label, tree in order if r % 2 == 0 else order[::-1]:
                path = (ROOT if args.script_here else tree) / "benchmarks" / script
                rows, wall = run_once(tree, path, script_args, tmp / f"run-{r}-{tree.name}.md", args.timeout, keys)
                runs[label].append(rows)
                walls[label].append(wall)
                print(f"round {r}: {label}: {len(rows)} rows in {wall:.0f} s", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
    summary = summarize(runs, metrics)
    meta = run_meta(
        "revisions.py",
        [shlex.quote(a) for a in argv],
        f"{script} {shlex.join(script_args)} at this tree and at {args.before}, {args.repeats} rounds alternated",
    )
    meta |= {"title": args.title or f"{script}: this tree against {args.before}", "repeats": args.repeats}
    meta["metrics"] = args.metrics
    meta["walls_s"] = walls
    write(Path(args.out), meta, summary, metrics, labels)
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
