"""Typed, self-checking configuration of a training run.

Glossary used throughout sdpipe:

* **stage** -- one contiguous slice of the model (S of them);
* **pipeline** -- one replica of the whole model, made of S stages (D of them);
* **worker** -- one stage of one pipeline, one process; rank = pipeline * S + stage;
* **step** -- one optimizer update of a pipeline, over ``batch_size`` samples;
* **micro-batch** -- a slice of a step's batch that flows through the stages;
* **policy** -- how the D replicas of each stage synchronize.

Every check here runs on the driver before any worker starts, and raises a
one-line ``ValueError`` that names the field and what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import os
import re
import textwrap
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Union

from sdpipe.core.checks import integer, is_integer, number
from sdpipe.core.policies import DEFAULT, NAMES, names, record
from sdpipe.core.schedule import ASYNC_SCHEDULES, default_update_every
from sdpipe.core.scheduler import SchedulerPolicy

__all__ = [
    "DEVICES",
    "OPTIMIZERS",
    "POLICIES",
    "REJOIN_POLICIES",
    "SCHEDULE_NAMES",
    "Heterogeneity",
    "Rebalance",
    "TrainConfig",
    "config_keywords",
    "field_docs",
]

POLICIES = NAMES
#: policies a running run can switch between with Run.set_policy
LIVE_POLICIES = names(live=True)
#: Policies under which a lost pipeline can come back (rejoin=True): they go on without it meanwhile.
REJOIN_POLICIES = names(rejoin=True)
SCHEDULE_NAMES = ("1f1b", "gpipe", "async-1f1b", "async-2bw")
#: schedules that never flush between steps
ASYNC_SCHEDULE_NAMES = ASYNC_SCHEDULES
OPTIMIZERS = ("sgd", "adam", "adamw")
DEVICES = ("cpu", "cuda")
#: how an nn.Sequential is cut into stages when no cut points are given (TrainConfig.cuts)
CUT_RULES = ("params", "time")
BACKENDS = ("gloo", "nccl")


def _check_update_every(schedule: str, update_every: Any, stages: int) -> None:
    if update_every is None:
        return
    if schedule not in ASYNC_SCHEDULE_NAMES:
        raise ValueError(
            f"update_every: applies to the asynchronous schedules ({', '.join(ASYNC_SCHEDULE_NAMES)}); "
            f"{schedule!r} updates once per step, got {update_every!r}"
        )
    integer("update_every", update_every)
    if schedule == "async-2bw" and update_every < stages:
        raise ValueError(
            f"update_every: async-2bw keeps two weight versions, which needs update_every >= stages ({stages}), "
            f"got {update_every}; use async-1f1b for fewer backwards per update"
        )


WorkerKey = Union[int, tuple]


@dataclass(frozen=True, kw_only=True)
class Heterogeneity:
    """Emulated heterogeneity, applied by each worker inside its steps (:mod:`sdpipe.worker.pace`).

    ``Heterogeneity(slowdown={3: 4.0})`` makes pipeline 3's own step (measured without waiting for other
    pipelines) take 4x as long, whatever share of it is compute: its workers act as if everything they do
    themselves ran 4x slower; ``slowdown={(3, 1): 2.0}`` slows only stage 1 of pipeline 3 that way.
    ``compute_slowdown`` multiplies forward and backward compute alone (on a small model most of a step is
    communication and overhead, so the step grows far less).  A transient straggle: at each step, each worker
    with probability ``straggle_prob`` spends ``straggle_delay`` more seconds in it.  A slow link: each
    averaging (or gradient collective) the worker takes part in starts ``link_delay`` seconds later, so its group
    waits that long.
    """

    slowdown: Mapping[WorkerKey, float] = field(default_factory=dict)
    """Factor >= 1 per pipeline or per (pipeline, stage): that pipeline's (or worker's) own step takes this many
    times as long."""
    compute_slowdown: Mapping[WorkerKey, float] = field(default_factory=dict)
    """Factor >= 1 per pipeline or per (pipeline, stage): forward and backward compute alone take this many times
    as long."""
    straggle_prob: float = 0.0
    """Probability, per worker and step, of a transient straggle."""
    straggle_delay: float = 0.0
    """Seconds a transient straggle adds to the worker's step (slept after its first forward or backward)."""
    link_delay: Mapping[WorkerKey, float] = field(default_factory=dict)
    """Extra seconds per synchronization per pipeline or (pipeline, stage): a slow link."""

    TABLES = ("slowdown", "compute_slowdown", "link_delay")

    def __post_init__(self):
        for name in self.TABLES:
            object.__setattr__(self, name, dict(getattr(self, name) or {}))
        for name in self.TABLES:
            table, lo = getattr(self, name), 0.0 if name == "link_delay" else 1.0
            for key, value in table.items():
                if not is_integer(key) and not (
                    isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, int) for k in key)
                ):
                    raise ValueError(
                        f"heterogeneity.{name}: key {key!r} must be a pipeline id or a (pipeline, stage) pair"
                    )
                number(f"heterogeneity.{name}[{key!r}]", value, lo)
        number("heterogeneity.straggle_prob", self.straggle_prob, 0.0, 1.0)
        number("heterogeneity.straggle_delay", self.straggle_delay, 0.0)

    def check_workers(self, pipelines: int, stages: int) -> None:
        """Reject keys naming pipelines or stages the run does not have."""
        for name in self.TABLES:
            for key in getattr(self, name):
                p, s = key if isinstance(key, tuple) else (key, 0)
                if not 0 <= p < pipelines or not 0 <= s < stages:
                    raise ValueError(
                        f"heterogeneity.{name}: key {key!r} names no worker; "
                        f"pipelines are 0..{pipelines - 1}, stages 0..{stages - 1}"
                    )

    def _lookup(self, table: Mapping, pipeline: int, stage: int, default: float) -> float:
        if (pipeline, stage) in table:
            return float(table[(pipeline, stage)])
        return float(table.get(pipeline, default))

    def slowdown_of(self, pipeline: int, stage: int) -> float:
        return self._lookup(self.slowdown, pipeline, stage, 1.0)

    def stretch_of(self, pipeline: int, stage: int) -> float:
        """The factor worker (pipeline, stage) stretches its own step by (:mod:`sdpipe.worker.pace`): its own key's; a
        pipeline's key on the pipeline's stage 0 alone, which leads each of the pipeline's steps (its control
        message starts the step everywhere, and its step spans the pipeline's), so the pipeline's step stretches by
        it while the later stages wait for that message."""
        if (pipeline, stage) in self.slowdown:
            return float(self.slowdown[(pipeline, stage)])
        return float(self.slowdown.get(pipeline, 1.0)) if stage == 0 else 1.0

    def compute_slowdown_of(self, pipeline: int, stage: int) -> float:
        return self._lookup(self.compute_slowdown, pipeline, stage, 1.0)

    def link_delay_of(self, pipeline: int, stage: int) -> float:
        return self._lookup(self.link_delay, pipeline, stage, 0.0)

    def to_dict(self) -> dict:
        """A msgpack-friendly form (tuple keys written as "p,s")."""
        enc = lambda t: {(f"{k[0]},{k[1]}" if isinstance(k, tuple) else str(k)): float(v) for k, v in t.items()}
        return {
            "slowdown": enc(self.slowdown),
            "compute_slowdown": enc(self.compute_slowdown),
            "straggle_prob": self.straggle_prob,
            "straggle_delay": self.straggle_delay,
            "link_delay": enc(self.link_delay),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "Heterogeneity":
        dec = lambda t: {
            (tuple(int(x) for x in k.split(",")) if "," in str(k) else int(k)): v for k, v in (t or {}).items()
        }
        return cls(
            slowdown=dec(d.get("slowdown")),
            compute_slowdown=dec(d.get("compute_slowdown")),
            straggle_prob=d.get("straggle_prob", 0.0),
            straggle_delay=d.get("straggle_delay", 0.0),
            link_delay=dec(d.get("link_delay")),
        )


@dataclass(frozen=True)
class Rebalance:
    """Automatic re-cuts (``TrainConfig.rebalance``): the driver watches each stage's own time per step (its
    forwards, backwards and slowdown, the median over the pipelines) and re-cuts every pipeline
    (:meth:`sdpipe.Run.recut`) when one stage stays the bottleneck.

    The new cut weighs each layer's time measured on the driver (as ``cuts="time"``) by how much slower than
    that each stage's workers run now, and takes the cut whose slowest stage is fastest under those speeds.
    """

    margin: float = 0.25
    """A stage is the bottleneck when its time per step exceeds the mean of the others' by this share, and a
    re-cut is made only where it would make the slowest stage faster by this share too."""
    steps: int = 10
    """Steps each worker must have taken under the current cut (and heterogeneity) before the times decide, and
    over which they are averaged."""
    every: float = 10.0
    """Seconds at least between two automatic re-cuts."""

    def __post_init__(self):
        number("rebalance.margin", self.margin, 0.0, lo_open=True)
        integer("rebalance.steps", self.steps)
        number("rebalance.every", self.every, 0.0)

    def to_dict(self) -> dict:
        return {"margin": self.margin, "steps": self.steps, "every": self.every}

    @classmethod
    def of(cls, value) -> Optional["Rebalance"]:
        """``TrainConfig.rebalance`` as given: None or False (off), True (the defaults), a dict of fields, or a
        Rebalance; a one-line error otherwise."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"margin", "steps", "every"})
            if unknown:
                raise ValueError(f"rebalance: unknown field {unknown[0]!r}; the fields are margin, steps, every")
            return cls(**value)
        raise ValueError(
            f"rebalance: must be True, a sdpipe.Rebalance, a dict of its fields or None, got {type(value).__name__}"
        )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a run except the model and the data."""

    stages: int = 2
    """Number of stages S the model is cut into."""
    pipelines: int = 2
    """Number of pipelines D trained at once (replicas of the whole model)."""
    policy: str = DEFAULT
    """How the D replicas of a stage synchronize: one of POLICIES."""
    schedule: str = "1f1b"
    """Micro-batch schedule: "1f1b" or "gpipe" (a flush and one update per step), or without flush "async-1f1b"
    (PipeDream's weight stashing, the SDPipe prototype's) or "async-2bw" (PipeDream-2BW: two weight versions)."""
    microbatches: int = 4
    """Micro-batches per step; must divide batch_size."""
    update_every: Optional[int] = None
    """Asynchronous schedules: backwards per weight update; None: 1 for "async-1f1b", for "async-2bw" the
    micro-batches of a step (at least the number of stages, so that two weight versions suffice)."""
    batch_size: int = 32
    """Samples per step per pipeline."""
    drop_last: bool = True
    """Leave out an epoch's last samples that do not fill a batch; False trains them as a shorter last batch (it
    must hold at least one sample per micro-batch)."""
    epochs: int = 10
    """Passes over the training data."""
    sync_every: int = 1
    """Epochs between global syncs (every pipeline stops at one step and the replicas are averaged) under
    "sdpipe", "ps" and "adpsgd"; the last epoch always ends with one.  "allreduce" is always in sync."""
    optimizer: str = "adam"
    """Local optimizer of every worker: one of OPTIMIZERS."""
    lr: float = 0.002
    """Learning rate."""
    momentum: float = 0.9
    """Momentum of "sgd" (ignored by the Adam family)."""
    weight_decay: float = 0.0
    """Weight decay of the optimizer."""
    cuts: Optional[tuple] = None
    """Where an nn.Sequential is cut into stages: "params" (each stage about as many parameters; also None), "time"
    (the slowest stage as fast as it can be, from each layer's forward and backward time measured on the driver
    with a micro-batch before the workers start; the run's config then holds the cut chosen), or explicit cut
    points (start layer of stages 1..S-1)."""
    memory_limit: Optional[float] = None
    """With ``cuts="time"``: bytes a worker may hold (its layers' weights, gradients and two optimizer states, and
    one output per micro-batch of a step); only cuts whose every stage fits are taken."""
    rebalance: Optional[Any] = None
    """Re-cut the stages while the run trains when one stays the bottleneck: True (the defaults), a
    sdpipe.Rebalance (its margin, steps and seconds between re-cuts) or a dict of its fields; None: never."""
    device: str = "cpu"
    """"cpu" or "cuda" (one GPU per worker, NCCL by default)."""
    backend: Optional[str] = None
    """torch.distributed backend; None picks gloo on cpu and nccl on cuda."""
    seed: int = 0
    """Seed of the initial weights and of the data order."""
    heterogeneity: Optional[Heterogeneity] = None
    """Emulated stragglers and slow links, or None."""
    scheduler: Optional[Any] = None
    """Group-scheduler parameters: a sdpipe.core.scheduler.SchedulerPolicy, or a dict of the fields that change the
    policy's preset; None: the preset."""
    timeout: float = 120.0
    """Seconds any single wait (rendezvous, receive, collective) may take."""
    host: Optional[str] = None
    """Address the run's rendezvous store listens on and workers reach it by; None: the driver's address on
    the interface that routes to the Dask scheduler (127.0.0.1 for an embedded or loopback cluster)."""
    rejoin: bool = False
    """A pipeline lost during the run (a worker process died, its Dask worker left) comes back once the cluster
    has free workers again (a nanny restarts a dead worker process): its stages take a live replica's state
    and train on.  Under the policies that go on without a lost pipeline meanwhile, REJOIN_POLICIES."""
    checkpoint_every: int = 0
    """Epochs between checkpoints (0: none); a multiple of sync_every, so every checkpoint follows a global sync."""
    checkpoint_dir: Optional[str] = None
    """Folder the checkpoints go to (``epoch-NNNN`` folders and a ``latest`` file); workers must reach it."""

    def __post_init__(self):
        # in the order of the fields: a config with several bad fields is told about the first
        self._check_shape()
        self._check_training()
        self._check_parts()
        self._check_run()

    def _check_shape(self) -> None:
        """Stages, pipelines, policy, schedule and batches."""
        integer("stages", self.stages)
        integer("pipelines", self.pipelines)
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"schedule: {self.schedule!r} is not one of {', '.join(SCHEDULE_NAMES)}")
        integer("microbatches", self.microbatches)
        _check_update_every(self.schedule, self.update_every, self.stages)
        integer("batch_size", self.batch_size)
        if not isinstance(self.drop_last, bool):
            raise ValueError(f"drop_last: must be True or False, got {self.drop_last!r}")
        if not isinstance(self.rejoin, bool):
            raise ValueError(f"rejoin: must be True or False, got {self.rejoin!r}")
        if self.rejoin and self.policy not in REJOIN_POLICIES:
            raise ValueError(
                f"rejoin: policy {self.policy!r} stops the run when a pipeline is lost, so none can come back; "
                f"allowed under {', '.join(map(repr, REJOIN_POLICIES))}"
            )
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"batch_size: {self.batch_size} is not divisible into {self.microbatches} micro-batches; "
                f"use a multiple of microbatches"
            )

    def _check_training(self) -> None:
        """Epochs, the optimizer, the cut, the device and the seed."""
        integer("epochs", self.epochs)
        integer("sync_every", self.sync_every)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        number("lr", self.lr, 0.0, lo_open=True)
        number("momentum", self.momentum, 0.0, 1.0)
        number("weight_decay", self.weight_decay, 0.0)
        if isinstance(self.cuts, str):
            if self.cuts not in CUT_RULES:
                raise ValueError(
                    f"cuts: must be one of {', '.join(CUT_RULES)} or cut points (the start layer of stages "
                    f"1..S-1), got {self.cuts!r}"
                )
        elif self.cuts is not None:
            try:
                object.__setattr__(self, "cuts", tuple(self.cuts))
            except TypeError:
                raise ValueError(
                    f"cuts: must be one of {', '.join(CUT_RULES)} or cut points (the start layer of stages "
                    f"1..S-1), got {self.cuts!r}"
                ) from None
        object.__setattr__(self, "rebalance", Rebalance.of(self.rebalance))
        if self.rebalance is not None and not record(self.policy).recut:
            raise ValueError(
                f"rebalance: policy {self.policy!r} keeps a stage's weights in servers or peers for the whole run; "
                f"a run is re-cut under {', '.join(names(recut=True))}"
            )
        if self.memory_limit is not None:
            number("memory_limit", self.memory_limit, 0.0, lo_open=True)
            if self.cuts != "time":
                raise ValueError(f"memory_limit: applies to cuts='time' only, got cuts={self.cuts!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend: {self.backend!r} is not one of {', '.join(BACKENDS)} (or None)")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("backend: 'nccl' needs device='cuda'")
        integer("seed", self.seed, 0)

    def _check_parts(self) -> None:
        """The heterogeneity and the scheduler's parameters (a dict of them becomes a SchedulerPolicy)."""
        if self.heterogeneity is not None:
            if not isinstance(self.heterogeneity, Heterogeneity):
                raise ValueError(
                    f"heterogeneity: must be a sdpipe.Heterogeneity or None, got {type(self.heterogeneity).__name__}"
                )
            self.heterogeneity.check_workers(self.pipelines, self.stages)
        if self.scheduler is not None:
            if isinstance(self.scheduler, dict):  # the fields given, over the chosen policy's preset
                object.__setattr__(self, "scheduler", record(self.policy).scheduler.updated(**self.scheduler))
            elif not isinstance(self.scheduler, SchedulerPolicy):
                raise ValueError(
                    f"scheduler: must be a SchedulerPolicy, a dict of its fields or None, "
                    f"got {type(self.scheduler).__name__}"
                )

    def _check_run(self) -> None:
        """The timeout, the store's host and the checkpoints."""
        number("timeout", self.timeout, 0.0, lo_open=True)
        if self.host is not None and (not isinstance(self.host, str) or not self.host):
            raise ValueError(
                f"host: must be a non-empty address string or None (the address that routes to the "
                f"Dask scheduler), got {self.host!r}"
            )
        every = self.checkpoint_every
        integer("checkpoint_every", every, 0, why=" (epochs; 0 = none)")
        if self.checkpoint_every and self.checkpoint_every % self.sync_every:
            raise ValueError(
                f"checkpoint_every: {self.checkpoint_every} is not a multiple of "
                f"sync_every={self.sync_every}; "
                "checkpoints follow global syncs"
            )
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_dir: needed when checkpoint_every > 0 (a folder every worker can write)")
        if self.checkpoint_dir is not None:
            if not isinstance(self.checkpoint_dir, (str, os.PathLike)) or not str(self.checkpoint_dir):
                raise ValueError(f"checkpoint_dir: must be a folder path, got {self.checkpoint_dir!r}")
            object.__setattr__(self, "checkpoint_dir", os.path.abspath(os.fspath(self.checkpoint_dir)))

    @property
    def world_size(self) -> int:
        return self.stages * self.pipelines

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")

    @property
    def resolved_update_every(self) -> int:
        """Backwards per weight update: the micro-batches of a step under the flush schedules."""
        if self.schedule not in ASYNC_SCHEDULE_NAMES:
            return self.microbatches
        if self.update_every is not None:
            return self.update_every
        return default_update_every(self.schedule, self.stages, self.microbatches)

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["heterogeneity"] = self.heterogeneity.to_dict() if self.heterogeneity else None
        out["cuts"] = list(self.cuts) if isinstance(self.cuts, tuple) else self.cuts
        out["rebalance"] = self.rebalance.to_dict() if self.rebalance is not None else None
        out["scheduler"] = self.scheduler_policy().to_dict()
        return out

    def scheduler_policy(self):
        """The group scheduler's parameters for this run's policy."""
        if self.scheduler is not None:
            return self.scheduler
        return record(self.policy).scheduler


def field_docs(cls) -> dict[str, str]:
    """Each field of the dataclass ``cls`` and the string literal written under it in the class body, on one line.

    A tuple of allowed values that a docstring names (``one of POLICIES``) is written out
    (``one of POLICIES (sdpipe, allreduce, ps, adpsgd, none)``); a field without a docstring, or a class
    whose source is not shipped, maps to "".
    """
    return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls) -> tuple[tuple[str, str], ...]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's docstring wins over its base's
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError, AttributeError):  # no source (a frozen or compiled-only install)
            continue
        names = vars(inspect.getmodule(klass) or object)
        for node, under in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(under, ast.Expr)
                and isinstance(under.value, ast.Constant)
                and isinstance(under.value.value, str)
            ):
                docs[node.target.id] = _written_out(" ".join(under.value.value.split()), names)
    return tuple((f.name, docs.get(f.name, "")) for f in fields(cls))


def _written_out(doc: str, names: Mapping[str, Any]) -> str:
    def expand(m):
        value = names.get(m.group(0))
        if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
            return f"{m.group(0)} ({', '.join(value)})"
        return m.group(0)

    return re.sub(r"\b[A-Z][A-Z0-9_]+\b", expand, doc)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def config_keywords(func=None, *, only: Optional[tuple] = None):
    """Give ``func(..., **options)`` every :class:`TrainConfig` field (or those named in ``only``) as a keyword-only
    parameter.

    ``options`` only ever holds those fields: an unknown keyword raises Python's own one-line ``TypeError`` with
    the allowed names (a TrainConfig field left out of ``only`` is named as one ``func`` does not take).
    ``inspect.signature(func)`` and ``help(func)`` list the fields with their defaults after ``func``'s own
    keyword-only parameters, and ``func.__doc__`` ends with each field's docstring.  A field may also be one of
    ``func``'s own positional parameters (``func`` passes it on itself): it is then listed there, once::

        @config_keywords
        def train(model, train_data, *, eval_data=None, **options):
            config = TrainConfig(**options)

        train(model, data, stages=4)    # options == {"stages": 4}
        train(model, data, stagez=4)    # TypeError: train() got an unexpected keyword argument 'stagez'; ...

        @config_keywords(only=("stages", "pipelines", "policy"))
        def simulate(stages, pipelines, *, costs, **options): ...
    """
    if func is None:
        return functools.partial(config_keywords, only=only)
    sig = inspect.signature(func)
    own, config_fields, left_out = _taken_fields(func, sig, only)
    hints = typing.get_type_hints(TrainConfig)
    added = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_default(f), annotation=hints[f.name])
        for f in config_fields
    ]
    own_keywords = [p.name for p in own if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    allowed = set(own_keywords) | {f.name for f in config_fields}
    listed = ", ".join([*(p.name for p in own if p.kind is p.KEYWORD_ONLY), *(f.name for f in config_fields)])

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        for name in kwargs:
            if name in left_out:
                raise TypeError(
                    f"{func.__qualname__}() does not take the TrainConfig field {name!r}; keywords are {listed}"
                )
            if name not in allowed:
                near = difflib.get_close_matches(name, sorted(allowed), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise TypeError(
                    f"{func.__qualname__}() got an unexpected keyword argument {name!r}{hint}; keywords are {listed}"
                )
        return func(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=[*own, *added])
    wrapper.__doc__ = (inspect.cleandoc(func.__doc__ or "") + "\n\n" + _options_section(config_fields, hints)).lstrip()
    return wrapper


def _taken_fields(func, sig: inspect.Signature, only: Optional[tuple]) -> tuple[list, list, set]:
    """``func``'s own parameters, the TrainConfig fields it takes as keywords and those it does not take; a
    ``TypeError`` for a ``func`` that cannot take them (no ``**options``, a keyword-only parameter named as a field)."""
    params = list(sig.parameters.values())
    if not [p for p in params if p.kind is p.VAR_KEYWORD]:
        raise TypeError(
            f"config_keywords: {func.__qualname__}() needs a **options parameter for the TrainConfig fields"
        )
    own = [p for p in params if p.kind is not p.VAR_KEYWORD]
    every = [f for f in fields(TrainConfig) if f.init]
    unknown = sorted(set(only or ()) - {f.name for f in every})
    if unknown:
        raise TypeError(f"config_keywords: only= names no TrainConfig field: {', '.join(unknown)}")
    positional = {p.name for p in own if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
    clash = sorted({p.name for p in own} & {f.name for f in every} - positional)
    if clash:
        raise TypeError(
            f"config_keywords: {func.__qualname__}() has parameters that are TrainConfig fields: {', '.join(clash)}"
        )
    taken = [f for f in every if (only is None or f.name in only) and f.name not in positional]
    return own, taken, {f.name for f in every} - {f.name for f in taken} - positional


def _options_section(config_fields: list, hints: Mapping[str, Any]) -> str:
    title = "Options (TrainConfig fields)"
    lines = [title, "-" * len(title)]
    docs = field_docs(TrainConfig)
    for f in config_fields:
        lines.append(f"{f.name} : {inspect.formatannotation(hints[f.name])} = {_default(f)!r}")
        lines.append(textwrap.fill(docs[f.name], width=100, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(lines)
