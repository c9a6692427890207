"""``sdpipe`` on the command line.

``sdpipe train`` trains the built-in example (an MLP on scikit-learn's digits)
on an embedded Dask LocalCluster, or on an existing cluster with
``--cluster ADDRESS``, shows a progress bar per epoch and a final summary.
``sdpipe train --config run.toml`` takes the options from a file.
``sdpipe simulate`` runs the simulator (``sdpipe.simulate``) with uniform
per-stage costs and prints the throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
import typing
from dataclasses import fields
from typing import Optional

from sdpipe.config import Heterogeneity, TrainConfig, field_docs
from sdpipe.core.policies import NAMES, record
from sdpipe.core.scheduler import SchedulerPolicy
from sdpipe.simulation import SIMULATED_FIELDS, Network, Proxy

#: the field types that one command-line word gives, and how to read it
_SCALARS = {
    int: int,
    float: float,
    str: str,
    Optional[str]: str,
    Optional[int]: int,
    Optional[float]: float,
    bool: bool,
}


def _flag_fields(cls) -> dict[str, type]:
    """The fields of the dataclass ``cls`` that make sense as flags (numbers and strings), and their types."""
    hints = typing.get_type_hints(cls)
    return {f.name: _SCALARS[hints[f.name]] for f in fields(cls) if f.init and hints[f.name] in _SCALARS}


def _add_fields(group, cls, names=None, prefix: str = "") -> None:
    """``--[prefix-]field-name`` flags for ``cls``'s fields ``names`` (default: all that make sense), written from
    the dataclass: its type, its default, its docstring as the help (``args.[prefix_]field_name``)."""
    kinds, docs = _flag_fields(cls), {k: _plain(v) for k, v in field_docs(cls).items()}
    defaults = {f.name: f.default for f in fields(cls)}
    for name in names or kinds:
        # a yes/no field is a pair of flags: --drop-last / --no-drop-last
        kind = {"action": argparse.BooleanOptionalAction} if kinds[name] is bool else {"type": kinds[name]}
        choices = re.search(r"one of ([a-z0-9\-]+(?:, [a-z0-9\-]+)+)", docs[name])
        if choices:  # the usage line lists them (the values are still checked by TrainConfig, in its words)
            kind = dict(kind, metavar="{" + choices.group(1).replace(", ", ",") + "}")
        flag = f"{prefix}_{name}" if prefix else name
        group.add_argument(
            f"--{flag.replace('_', '-')}",
            dest=flag,
            default=defaults[name],
            help=docs[name].replace("%", "%%") or name.replace("_", " "),
            **kind,
        )


def _plain(doc: str) -> str:
    """A field's docstring as command-line help: a named tuple of values written out as the values alone
    ("one of POLICIES (sdpipe, ...)" reads "one of sdpipe, ..."), no reStructuredText markup, and "none" for
    None as the defaults read."""
    doc = re.sub(r"\b[A-Z][A-Z_]+ \(([^)]*)\)", r"\1", doc)
    doc = re.sub(r"``([^`]*)``", r"\1", doc)
    return re.sub(r"\bNone\b", "none", doc)


def _slowdown(text: str):
    try:
        who, factor = text.split("=")
        key = tuple(int(x) for x in who.split(",")) if "," in who else int(who)
        return key, float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--slowdown: {text!r} is not PIPELINE=FACTOR or PIPELINE,STAGE=FACTOR"
        ) from None


class _Help(argparse.HelpFormatter):
    """Every flag's help ends with its default (None and an empty list read "none")."""

    def _get_help_string(self, action):
        if action.default is argparse.SUPPRESS or not action.option_strings:
            return action.help
        default = "none" if action.default in (None, []) else action.default
        return f"{action.help} (default: {default})"


def _add_slowdowns(parser) -> None:
    group = parser.add_argument_group("heterogeneity", "emulated stragglers (the fields of sdpipe.Heterogeneity)")
    group.add_argument(
        "--slowdown",
        type=_slowdown,
        action="append",
        default=[],
        metavar="P=K",
        help="slow pipeline P (or P,S) by factor K; repeat for more",
    )
    _add_fields(group, Heterogeneity, ["straggle_prob", "straggle_delay"])


def _add_scheduler(parser) -> None:
    """``--scheduler-field`` flags for the group scheduler's parameters (the fields of ``SchedulerPolicy``), written
    from the dataclass; a flag left out keeps the policy's preset."""
    group = parser.add_argument_group(
        "scheduler",
        "the group scheduler's parameters (the fields of sdpipe.core.scheduler.SchedulerPolicy); the flags given "
        "change the policy's preset",
    )
    kinds, docs = _flag_fields(SchedulerPolicy), {k: _plain(v) for k, v in field_docs(SchedulerPolicy).items()}
    metavars = {int: "N", float: "X", str: "TEXT"}
    for name, kind in kinds.items():
        flag = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind, "metavar": metavars[kind]}
        group.add_argument(
            f"--scheduler-{name.replace('_', '-')}",
            dest=f"scheduler_{name}",
            default=argparse.SUPPRESS,  # left out: the policy's preset
            help=(docs[name].replace("%", "%%") or name.replace("_", " ")) + " (default: the policy's preset)",
            **flag,
        )


def _scheduler(args, policy: str):
    """The group scheduler's parameters the flags set (``--scheduler-...``) over ``policy``'s preset, or None (none
    given, or a policy that is not one: TrainConfig says so in its words)."""
    if policy not in NAMES:
        return None
    given = {
        name: getattr(args, f"scheduler_{name}")
        for name in _flag_fields(SchedulerPolicy)
        if getattr(args, f"scheduler_{name}", None) is not None
    }
    return record(policy).scheduler.updated(**given) if given else None


def build_parser() -> argparse.ArgumentParser:
    fmt = _Help
    parser = argparse.ArgumentParser(prog="sdpipe", description="Heterogeneity-aware pipeline-parallel training.")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub, fmt)
    _simulate_parser(sub, fmt)
    return parser


def _train_parser(sub, fmt) -> None:
    """``sdpipe train``: the built-in examples, the run's fields, heterogeneity and the scheduler."""
    t = sub.add_parser(
        "train",
        help="train a built-in example (digits MLP or CNN, a GPT-style character model, a small ResNet)",
        formatter_class=fmt,
        description="Train the built-in example on an embedded Dask LocalCluster (or --cluster) and "
        "print a progress bar per epoch and a summary.",
    )
    t.add_argument(
        "--example",
        choices=["digits", "gpt", "resnet"],
        default="digits",
        help="built-in model and data: digits (scikit-learn's digits, --model mlp or cnn), gpt (a GPT-style character "
        "model on the standard library's source text, held-out perplexity), resnet (a small ResNet on upscaled digits)",
    )
    t.add_argument(
        "--model",
        choices=["mlp", "cnn"],
        default="mlp",
        help="with --example digits: the MLP or a small CNN (more compute per weight)",
    )
    t.add_argument("--hidden", type=int, default=128, help="width of the MLP's hidden layers")
    t.add_argument(
        "--cluster",
        default=None,
        help="address of an existing Dask scheduler; none starts an embedded LocalCluster on this machine",
    )
    t.add_argument("--resume-from", default=None, help="a checkpoint folder, or a checkpoint dir for its latest")
    t.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a .toml or .json file of these options (names with - or _); flags given here win",
    )
    _add_fields(
        t.add_argument_group(
            "run",
            "the fields of sdpipe.TrainConfig (--seed also seeds the example's "
            "initial weights and its train/held-out split)",
        ),
        TrainConfig,
    )
    _add_slowdowns(t)
    _add_scheduler(t)


#: the fields of TrainConfig that ``sdpipe simulate`` takes as flags (the heterogeneity and the scheduler have
#: their own groups of flags)
_SIMULATED_FLAGS = ("stages", "pipelines", *(f for f in SIMULATED_FIELDS if f not in ("heterogeneity", "scheduler")))


def _simulate_parser(sub, fmt) -> None:
    """``sdpipe simulate``: the run's fields (train's, with its defaults), the costs, the network, the proxy,
    heterogeneity and the scheduler."""
    m = sub.add_parser(
        "simulate",
        help="simulate a run in simulated time on the scheduler core",
        formatter_class=fmt,
        description="Simulate a run with uniform per-stage costs (or a workload profile) and print its throughput.",
    )
    _add_fields(
        m.add_argument_group("run", "the fields of sdpipe.TrainConfig the simulator models (train's defaults)"),
        TrainConfig,
        list(_SIMULATED_FLAGS),
    )
    m.add_argument("--steps", type=int, default=200, help="steps' worth of batches per pipeline and epoch")
    costs = m.add_argument_group("costs", "every stage's costs (sdpipe.Costs, the same for every stage)")
    costs.add_argument("--forward", type=float, default=0.002, help="seconds of forward per micro-batch and stage")
    costs.add_argument("--backward", type=float, default=0.004, help="seconds of backward per micro-batch and stage")
    costs.add_argument("--weight-bytes", type=float, default=4e5, help="bytes of a stage's weights")
    costs.add_argument("--activation-bytes", type=float, default=4e4, help="bytes of a micro-batch's activation")
    costs.add_argument(
        "--profile",
        default=None,
        help="a workload profile instead of the uniform costs: resnet50 or bert-base (sdpipe.profiles), on --gpu, "
        "priced for micro-batches of --batch-size / --microbatches samples",
    )
    costs.add_argument("--gpu", default="V100", help="the GPU type of --profile: V100 or A100")
    net = m.add_argument_group("network", "the links and the services' round trips (the fields of sdpipe.Network)")
    _add_fields(net, Network)
    net.add_argument(
        "--gbit",
        type=float,
        default=None,
        help="a cluster network of links of this many Gbit/s (sdpipe.profiles.network, 0.5 ms round trips) instead "
        "of the flags above but --allreduce",
    )
    _add_fields(
        m.add_argument_group("proxy", "the convergence proxy (the fields of sdpipe.Proxy)"), Proxy, prefix="proxy"
    )
    _add_slowdowns(m)
    _add_scheduler(m)


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """Options from a TOML or JSON file, checked against ``parser``'s options: one-line errors name the field."""
    import json
    from pathlib import Path

    import tomllib

    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as e:
        raise ValueError(f"config: cannot read {path!r} ({e.strerror or type(e).__name__})") from None
    try:
        data = tomllib.loads(text.decode()) if p.suffix == ".toml" else json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        kind = "TOML" if p.suffix == ".toml" else "JSON"
        raise ValueError(f"config: {path} is not valid {kind} ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"config: {path} must hold a table of options, got {type(data).__name__}")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            raise ValueError(f"config: {path}: unknown field {key!r}; allowed: {', '.join(sorted(actions))}")
        action = actions[dest]
        if action.choices is not None and value not in action.choices:
            raise ValueError(
                f"config: {path}: field {key!r} is {value!r}; allowed: {', '.join(map(str, action.choices))}"
            )
        if dest == "slowdown":
            if not isinstance(value, dict):
                raise ValueError(
                    f"config: {path}: field 'slowdown' must be a table pipeline -> factor, got {type(value).__name__}"
                )
            try:
                value = [_slowdown(f"{k}={v}") for k, v in value.items()]
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"config: {path}: field 'slowdown': {e}") from None
        elif isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ValueError(f"config: {path}: field {key!r} must be true or false, got {value!r}")
        elif action.type in (int, float):
            ok = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and (action.type is float or isinstance(value, int))
            )
            if not ok:
                kind = "an integer" if action.type is int else "a number"
                raise ValueError(f"config: {path}: field {key!r} must be {kind}, got {value!r}")
            value = action.type(value)
        elif value is not None and not isinstance(value, str):
            raise ValueError(f"config: {path}: field {key!r} must be a string, got {value!r}")
        out[dest] = value
    return out


def _simulate(args) -> int:
    from sdpipe.simulation import Costs, profiles, simulate

    S = args.stages
    if args.profile is not None:
        if args.profile not in profiles.PROFILES:
            raise ValueError(f"profile: {args.profile!r} is not one of {', '.join(profiles.PROFILES)}")
        # priced at the run's micro-batch, so the samples counted are the samples the costs are for
        micro = max(1, args.batch_size // args.microbatches)
        costs = profiles.profile(args.profile, S, gpu=args.gpu, microbatch=micro)
    else:
        costs = Costs(
            forward=[args.forward] * S,
            backward=[args.backward] * S,
            weight_bytes=[args.weight_bytes] * S,
            activation_bytes=[args.activation_bytes] * (S - 1),
        )
    if args.gbit is not None:  # the cluster network of --gbit, priced as --allreduce says
        network = dataclasses.replace(profiles.network(args.gbit), allreduce=args.allreduce)
    else:
        network = Network(**{f.name: getattr(args, f.name) for f in fields(Network)})
    options = {name: getattr(args, name) for name in _SIMULATED_FLAGS}
    options["scheduler"] = _scheduler(args, args.policy)
    options["heterogeneity"] = Heterogeneity(
        slowdown=dict(args.slowdown), straggle_prob=args.straggle_prob, straggle_delay=args.straggle_delay
    )
    proxy = Proxy(**{f.name: getattr(args, f"proxy_{f.name}") for f in fields(Proxy)})
    t = time.time()
    result = simulate(costs=costs, steps=args.steps, network=network, proxy=proxy, record=False, **options)
    samples = sum(h["samples"] for h in result.history)
    shares = sorted(h["share"] for h in result.history)
    print(
        f"simulated {S} stages x {args.pipelines} pipelines, policy={args.policy}: "
        f"{result.wall_time:.3f} simulated s, "
        f"{samples / result.wall_time:.0f} samples/s, pipeline shares {shares[0]:.3f}..{shares[-1]:.3f}, "
        f"worst proxy loss {max(h['loss'] for h in result.history):.4f} ({time.time() - t:.1f} s to simulate)"
    )
    return 0


def _progress(run, epochs: int, pipelines: int, stages: int, per_epoch: int, first: int = 0) -> None:
    """One progress bar per epoch, fed by the run's events (steps of every pipeline's last stage)."""
    from collections import Counter

    from tqdm import tqdm

    steps, reports = Counter(), {}
    cursor, current, bar = 0, first, None
    while True:
        finished = run.done()
        events, cursor = run.events_since(cursor)
        for e in events:
            if e["kind"] == "optimizer" and e["stage"] == stages - 1:
                steps[e["epoch"]] += 1
            elif e["kind"] == "epoch":
                reports.setdefault(e["metrics"]["epoch"], []).append(e["metrics"])
        while current < epochs:
            if bar is None:
                bar = tqdm(total=per_epoch, desc=f"epoch {current + 1}/{epochs}", unit="step")
            bar.update(min(steps[current], per_epoch) - bar.n)
            done = reports.get(current, [])
            if len(done) < pipelines:
                break
            loss = sum(m["loss"] for m in done) / len(done)
            name = next((m["metric"] for m in done if "metric" in m), None)
            held = [m[name] for m in done if name in m]
            shown = {name: f"{(min if name == 'accuracy' else max)(held):.3f}"} if held else {}
            bar.set_postfix(loss=f"{loss:.3f}", **shown)
            bar.close()
            bar, current = None, current + 1
        if finished:
            break
        time.sleep(0.1)
    if bar is not None:
        bar.close()


def _check(args) -> tuple[TrainConfig, dict]:
    """The run's options from the flags and their one-line errors, before torch, the data or any worker load
    (well under a second)."""
    options = {name: getattr(args, name) for name in _flag_fields(TrainConfig)}
    scheduler = _scheduler(args, args.policy)
    if scheduler is not None:
        options["scheduler"] = scheduler
    if args.slowdown or args.straggle_prob:
        options["heterogeneity"] = Heterogeneity(
            slowdown=dict(args.slowdown), straggle_prob=args.straggle_prob, straggle_delay=args.straggle_delay
        )
    if args.example == "digits" and args.model == "cnn" and args.stages == 2:
        options["cuts"] = (6,)  # balanced by compute, not by weights
    return TrainConfig(**options), options


def _example(args) -> tuple:
    """The built-in example's model, training and held-out data, and its loss and metric (if not the defaults)."""
    from sdpipe.data import digits, digits_cnn, digits_mlp

    if args.example == "gpt":
        from sdpipe.examples import char_data, char_gpt, lm_loss

        train_data, eval_data = char_data()
        return char_gpt(seed=args.seed), train_data, eval_data, {"loss_fn": lm_loss, "metric": "perplexity"}
    train_data, eval_data = digits(seed=args.seed)
    if args.example == "resnet":
        from sdpipe.examples import digits_resnet

        return digits_resnet(seed=args.seed), train_data, eval_data, {}
    model = digits_cnn(seed=args.seed) if args.model == "cnn" else digits_mlp(hidden=args.hidden, seed=args.seed)
    return model, train_data, eval_data, {}


def _train(args) -> int:
    config, options = _check(args)
    where = f"the Dask cluster at {args.cluster}" if args.cluster else "an embedded Dask cluster on this machine"
    print(
        f"sdpipe: starting {config.world_size} workers ({args.stages} stages x {args.pipelines} pipelines, "
        f"policy {args.policy}) on {where} ...",
        flush=True,
    )

    from sdpipe import train

    model, train_data, eval_data, extra = _example(args)
    run = train(
        model, train_data, eval_data=eval_data, cluster=args.cluster, resume_from=args.resume_from, **extra, **options
    )
    per_epoch = run.updates_per_epoch
    try:
        shown = None
        while run.status == "starting":  # the start-up, one line per step of it
            line = run.startup
            if line and line != shown:
                print(f"sdpipe: {line}", flush=True)
                shown = line
            time.sleep(0.1)
        if run.status != "error":
            print(f"sdpipe: run {run.run_id} training on {len(run.workers)} Dask workers", flush=True)
            _progress(run, args.epochs, args.pipelines, args.stages, per_epoch, run.start_epoch)
    except KeyboardInterrupt:
        print("\nsdpipe: stopping at the next step boundary ...", file=sys.stderr)
        run.stop()
    try:
        result = run.result()
    except Exception as e:  # the run's error in one line (its workers' tracebacks are in the Dask logs)
        print(f"sdpipe: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    _summary(args, run, result)
    return 0


def _summary(args, run, result) -> None:
    """The run's summary: samples/s from the first step, the last epoch per pipeline, the held-out metric."""
    last = max(h["epoch"] for h in result.history)
    rows = [h for h in result.history if h["epoch"] == last]
    samples = sum(h["samples"] for h in result.history)
    epochs = len({h["epoch"] for h in result.history})
    print(
        f"\nsummary: {args.stages} stages x {args.pipelines} pipelines, policy={args.policy}, schedule={args.schedule}"
    )
    began = min((e["start"] for e in result.events if e["kind"] == "forward"), default=0.0)
    trained = max(result.wall_time - began, 1e-9)
    print(
        f"  trained {epochs} epoch(s): {samples} samples over all pipelines in {trained:.1f} s from the first step "
        f"({samples / trained:.0f} samples/s, evaluation included); the workers took {began:.1f} s to start"
    )
    print(f"  last epoch ({last + 1}), per pipeline:")
    name = result.metric
    for h in rows:
        held = f"  held-out loss {h['eval_loss']:.4f}" if "eval_loss" in h else ""
        held += f"  held-out {name} {h[name]:.4f}" if name in h else ""
        print(f"  pipeline {h['pipeline']}: loss {h['loss']:.4f}{held}  {h['samples_per_s']:.0f} samples/s")
    print(f"  max parameter difference between pipelines: {result.max_param_diff():.3g}")
    values = [h[name] for h in rows if name in h]
    if values:  # the worst pipeline's
        worst, word = (min, "min") if name == "accuracy" else (max, "max")
        print(f"  held-out {name}: {word} {worst(values):.4f} over {len(values)} pipelines")
    if run.contention:
        print(f"  note: {run.contention}")
    for p, what in sorted(result.lost.items()):
        print(f"  pipeline {p} did not finish: {what}")
    for folder in run.checkpoints:
        print(f"  checkpoint: {folder}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train" and args.config:
            train_parser = parser._subparsers._group_actions[0].choices["train"]
            train_parser.set_defaults(**load_config_file(args.config, train_parser))
            args = parser.parse_args(argv)  # the file's values as defaults; flags on the command line win
        if args.command == "train":
            return _train(args)
        if args.command == "simulate":
            return _simulate(args)
    except (ValueError, ConnectionError) as e:
        print(f"sdpipe: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
