"""Can one group scheduler keep up with 16,384 x 4 workers?  Ready signals per second a cluster sends against
decisions per second the scheduler core takes.

    python benchmarks/scheduler_scale.py [--pipelines 16384] [--steps 20] [--profiles resnet50,bert-base]

Per profile (``sdpipe.profiles`` on V100 GPUs, micro-batches of 32 and 8 samples, 4 per step, 10 and 100 Gbit/s
links, every 8th pipeline 4x slower, transient straggles): one simulation of ``--pipelines`` x 4 under
``sdpipe`` on the real scheduler core, whose every call is timed (``time.perf_counter`` around it).  It gives

- the ready signals per second the cluster sends the scheduler (signals / simulated seconds);
- the core's cost per signal (its calls' seconds / signals: everything the core does, rounds, windows,
  connectivity, the cross-stage checks) and so the signals per second one core sustains on one core of this
  machine, for the whole run and per stage (each stage's own calls: what one scheduler per stage would take);
- the margin: sustained / needed.

The group service adds its own cost per signal around the core (a frame in and out of its socket, the
asyncio loop of the Dask scheduler's process): ``benchmarks/service_rate.py`` measures that.  Results:
``benchmarks/results/scheduler_scale.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import meta_lines, run_meta
from sim_scaling import scenario

HERE = Path(__file__).parent

#: what the table says, written under it
READING = """\
"us per signal" is the core's time per ready signal: for the whole run all its calls (ready signals, window
ends, deadlines, the cross-stage checks) over the ready signals; per stage the stage's ready calls alone, what a
scheduler per stage would spend (the stages' rounds are decided apart; only rounds of different stages that wait
on each other are broken across stages, which a scheduler per stage would have to ask the others about). The
margin is the signals per second one core takes over those the cluster sends; below 1, one scheduler per run
falls behind. The group service's own cost per signal (its socket, the scheduler process's event loop) comes
on top: `benchmarks/service_rate.py`, `service_rate.md`."""

#: what the shards' table says, written under it
SHARDED = """\
Each shard (`sdpipe.core.scheduler.StageShard`) decides one stage's rounds and learns the other stages' rounds
without a deadline by messages (`open`, `join`, `close`, `edges`), here delivered at once after each event. "us
per signal" is the shard's time (its stage's events and every message it receives) over its stage's ready
signals; the margin is the simulated seconds over the shard's seconds (1 core per shard). These are the core's
costs alone: the service's socket and event loop per signal come on top (`service_rate.md`)."""


class _Timed:
    """Wraps a GroupScheduler: every call timed, and each stage's ready signals apart."""

    def __init__(self, core):
        self.core, self.seconds, self.calls = core, 0.0, 0
        self.stage_seconds = [0.0] * len(core.stages)
        self.stage_calls = [0] * len(core.stages)

    def ready(self, stage, *args):
        t = time.perf_counter()
        out = self.core.ready(stage, *args)
        dt = time.perf_counter() - t
        self.seconds += dt
        self.calls += 1
        self.stage_seconds[stage] += dt
        self.stage_calls[stage] += 1
        return out

    def handle(self, event):
        t = time.perf_counter()
        out = self.core.handle(event)
        self.seconds += time.perf_counter() - t
        return out

    def next_deadline(self):
        t = time.perf_counter()
        out = self.core.next_deadline()
        self.seconds += time.perf_counter() - t
        return out

    def __getattr__(self, name):
        return getattr(self.core, name)


def _time_shards(core) -> list:
    """Each shard's calls timed (its stages' events and the messages it receives): [seconds, signals, messages]."""
    tally = []
    for sh in core.shards:
        t = [0.0, 0, 0]
        tally.append(t)
        for name, slot in (("ready", 1), ("handle", None), ("receive", 2)):
            setattr(sh, name, _timed_call(getattr(sh, name), t, slot))
    return tally


def _timed_call(fn, tally: list, slot):
    """``fn`` with its seconds added to ``tally[0]`` and its calls counted in ``tally[slot]`` (unless None)."""

    def timed(*args):
        t0 = time.perf_counter()
        out = fn(*args)
        tally[0] += time.perf_counter() - t0
        if slot is not None:
            tally[slot] += 1
        return out

    return timed


def measure(profile: str, gbit: float, D: int, steps: int, shards: bool = False) -> dict:
    import sdpipe
    import sdpipe.simulation.exchange as exchange
    from sdpipe.core.scheduler import GroupScheduler, ShardedScheduler
    from sdpipe.simulation import profiles

    micro = {"resnet50": 32, "bert-base": 8}[profile]
    costs = profiles.profile(profile, 4, gpu="V100", microbatch=micro)
    hetero = scenario(costs, 4, 4, D)
    timed: list = []
    tally: list = []

    def make(*args, **kwargs):
        core = ShardedScheduler(*args, **kwargs) if shards else GroupScheduler(*args, **kwargs)
        if shards:
            tally.extend(_time_shards(core))
        t = _Timed(core)
        timed.append(t)
        return t

    exchange.GroupScheduler = make
    try:
        t = time.time()
        r = sdpipe.simulate(
            4,
            D,
            policy="sdpipe",
            epochs=1,
            steps=steps,
            costs=costs,
            network=profiles.network(gbit),
            batch_size=micro * 4,
            microbatches=4,
            heterogeneity=hetero,
            record=False,
            seed=1,
        )
        took = time.time() - t
    finally:
        exchange.GroupScheduler = GroupScheduler
    (core,) = timed
    signals = core.calls
    per_signal = core.seconds / signals
    per_stage = [s / max(c, 1) for s, c in zip(core.stage_seconds, core.stage_calls, strict=True)]
    need = signals / r.wall_time
    sharded = {}
    if shards:  # per shard: its own time per signal of its stage and the margin of one core
        sharded = {
            "shard_us_per_signal": [sec / max(n, 1) * 1e6 for sec, n, _ in tally],
            "shard_messages_per_signal": [m / max(n, 1) for _, n, m in tally],
            "shard_margin": [r.wall_time / sec for sec, _, _ in tally],
            "messages": (timed[0].core.sent),
        }
    return {
        **sharded,
        "shards": bool(shards),
        "profile": profile,
        "gbit": gbit,
        "pipelines": D,
        "signals": signals,
        "simulated_s": r.wall_time,
        "needed_per_s": need,
        "core_us_per_signal": per_signal * 1e6,
        "core_per_s": 1 / per_signal,
        "margin": 1 / per_signal / need,
        "stage_us_per_signal": [x * 1e6 for x in per_stage],
        "stage_needed_per_s": [c / r.wall_time for c in core.stage_calls],
        "stage_margin": [1 / x / (c / r.wall_time) for x, c in zip(per_stage, core.stage_calls, strict=True)],
        "wall_s": took,
        "sdpipe_step_s_median": statistics.median(r.wall_time / max(n, 1) for n in r.steps.values()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profiles", default="resnet50,bert-base")
    ap.add_argument("--gbit", default="10,100")
    ap.add_argument(
        "--shards",
        action="store_true",
        help="also the scheduler in shards, one per stage (sdpipe.core.scheduler.ShardedScheduler), each case "
        "right after one scheduler",
    )
    ap.add_argument("--out", default=str(HERE / "results" / "scheduler_scale.md"))
    args = ap.parse_args(argv)
    rows, sharded = [], []
    for profile in args.profiles.split(","):
        for gbit in (float(g) for g in args.gbit.split(",")):
            row = measure(profile, gbit, args.pipelines, args.steps)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.shards:
                sharded.append(measure(profile, gbit, args.pipelines, args.steps, shards=True))
                print(json.dumps(sharded[-1]), file=sys.stderr, flush=True)
    meta = run_meta(
        "scheduler_scale.py",
        argv,
        f"{args.pipelines} pipelines x 4 stages, sdpipe, {args.steps} steps of batches per pipeline, V100 profiles, "
        "every 8th pipeline 4x slower, transient straggles p=0.05 of one step",
    )
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "sharded": sharded}, indent=1))
    lines = [
        "# One group scheduler against a 16,384 x 4 cluster's ready signals",
        "",
        *meta_lines(meta),
        "",
        "| profile | Gbit/s | ready signals/s the cluster sends | core us per signal | signals/s one core takes "
        "| margin | per stage: signals/s sent, us per signal, margin |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stages = "; ".join(
            f"{n:,.0f}, {u:.1f}, {m:.1f}x"
            for n, u, m in zip(r["stage_needed_per_s"], r["stage_us_per_signal"], r["stage_margin"], strict=True)
        )
        lines.append(
            f"| {r['profile']} | {r['gbit']:g} | {r['needed_per_s']:,.0f} | {r['core_us_per_signal']:.1f} | "
            f"{r['core_per_s']:,.0f} | {r['margin']:.2f}x | {stages} |"
        )
    lines += ["", READING]
    if sharded:
        lines += [
            "",
            "## In shards, one per stage",
            "",
            "| profile | Gbit/s | per stage: signals/s sent | shard us per signal (its signals and the messages it "
            "receives) | messages received per signal | margin per shard | simulated seconds: shards / one scheduler |",
            "|---|---|---|---|---|---|---|",
        ]
        for r, one in zip(sharded, rows, strict=True):
            lo = lambda xs, f=".1f": f"{min(xs):{f}}-{max(xs):{f}}"
            lines.append(
                f"| {r['profile']} | {r['gbit']:g} | {lo(r['stage_needed_per_s'], ',.0f')} "
                f"| {lo(r['shard_us_per_signal'])} | {lo(r['shard_messages_per_signal'], '.3f')} "
                f"| {lo(r['shard_margin'])}x "
                f"| {r['simulated_s']:.6g} / {one['simulated_s']:.6g} |"
            )
        lines += ["", SHARDED]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
