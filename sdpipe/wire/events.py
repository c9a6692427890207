"""A run's event records: the schema, written once, and one constructor per kind of record.

Every producer builds its records here: the workers (spans of work, syncs, epochs), the group service on the
Dask scheduler (groups, policy changes), the driver (controls, checkpoints, lost workers) and the simulator
(the same kinds, in simulated seconds).  The notebook layer, the CLI and the benchmarks read them.

A record is a flat ``dict`` of plain values (numbers, strings, lists, dicts, None: it travels as msgpack
through Dask's event log) with seven common fields::

    kind        one of SCHEMA's keys
    pipeline    the pipeline it concerns, or None (the whole run, or a stage's group)
    stage       the stage, or None
    step        the pipeline's step counter (optimizer steps since the run's start), or None
    microbatch  the micro-batch of a forward/backward/send/recv, else None
    start, end  seconds on the run's clock: ``time.time() - Run.t0`` (the driver's wall clock at the launch);
                simulated seconds in a simulated run.  Instant records have start == end.

and the fields :data:`SCHEMA` lists for its kind.  For example, stage 1 of pipeline 0 averaging with pipeline 2
after its step 41 (``span("sync", ...)``)::

    {"kind": "sync", "pipeline": 0, "stage": 1, "step": 41, "microbatch": None, "start": 12.30, "end": 12.34,
     "group": [0, 2], "round": 17, "reason": "partial", "mass": 1.5, "weighting": "progress"}

:func:`validate` checks a record against the schema (tests run it on every producer's records).
"""

from __future__ import annotations

from typing import Optional

from sdpipe.core.checks import is_integer

__all__ = [
    "COMMON",
    "SCHEMA",
    "checkpoint",
    "control",
    "epoch",
    "group",
    "instant",
    "membership",
    "pack",
    "problems",
    "span",
    "stage_info",
    "unpack",
    "validate",
    "worker_lost",
]

#: the fields every record has
COMMON = ("kind", "pipeline", "stage", "step", "microbatch", "start", "end")

#: kind -> (required fields, optional fields) beyond :data:`COMMON`
SCHEMA: dict = {
    # spans of one worker's work
    # cpu: the span's CPU seconds on the worker's training thread (its work without waiting for a core or a
    # slowdown's sleep)
    "forward": ((), ("cpu", "version")),
    "backward": ((), ("cpu", "version")),
    "send": ((), ()),
    "recv": ((), ()),
    # what="slowdown": the sleep that stretches a slowed worker's step (sdpipe.worker.pace); else a transient straggle
    "straggle": ((), ("what",)),
    "eval": ((), ()),
    "pause": ((), ()),
    # what="sends": a step's end waiting for its sends to the neighbour stages to be received (gloo completes a
    # send once its receive was posted); none: a stage after the first waiting for the step's control message;
    # what="group": a step waiting for its group (the service's answer, or an overlapped averaging still running);
    # what="drain": an epoch's end, stop or switch waiting for an overlapped averaging to finish
    "wait": ((), ("what", "group", "round")),
    # loss: the step's mean loss, at the last stage only; cpu: as forward's; step_cpu, process_cpu, machine_cpu: CPU
    # seconds since the worker's previous update ended, of its training thread, of its whole process and of its
    # machine (every process on it); versions: under an asynchronous schedule, the older weight versions stashed
    "optimizer": (("epoch",), ("loss", "cpu", "step_cpu", "process_cpu", "machine_cpu", "versions")),
    # lane="background": an overlapped averaging, in the worker's background thread while its next step computes
    "sync": (("group",), ("round", "reason", "mass", "weighting", "failed", "served", "server", "lane")),
    "save": (("epoch",), ()),  # this worker's part of a checkpoint
    # instants
    "stage": (("weight_bytes", "activation_bytes"), ("address", "cores")),  # a worker describes its stage once
    "epoch": (("metrics",), ()),  # metrics: epoch, pipeline, loss, samples, share, samples_per_s, steps, complete, ...
    "group": (("round", "group", "reason", "wait", "connected", "policy"), ()),  # a decision of the group scheduler
    # what: pause, resume, stop, heterogeneity, policy, shaped; and the pipelines present: "add" (the driver was
    # asked for more), "donated" (a worker gave its stage's state to joiner "to"), "joined" (every stage of the
    # joiner took it: its "donor", "generation", whether a lost pipeline came back, "seconds" from its launch),
    # "join-failed", "leave" (asked), "left" (the pipeline's worker took it at a step boundary); "recut": the driver's
    # (its "cuts", the "previous" ones, "seconds" until every worker took it) and each worker's (the layers it
    # "sent" and "received", their "bytes", the "epoch" and the "batches" of it its pipeline trained before);
    # "checkpoint-skipped": a checkpoint whose parts were written on both sides of a re-cut ("epoch", "reason")
    "control": (
        ("what",),
        (
            "applied_by",
            "version",
            "heterogeneity",
            "policy",
            "params",
            "host",
            "address",
            "pipelines",
            "bandwidth",
            "cpu",
            "donor",
            "generation",
            "rejoin",
            "seconds",
            "workers",
            "to",
            "bytes",
            "reason",
            "cuts",
            "previous",
            "sent",
            "received",
            "epoch",
            "batches",
        ),
    ),
    "checkpoint": (("epoch", "path"), ()),
    "worker-lost": (("worker", "reason"), ()),
}


def span(
    kind: str, pipeline: Optional[int], stage: Optional[int], step, microbatch, start: float, end: float, **fields
) -> dict:
    """A span of one worker's work (``forward``, ``backward``, ``send``, ``recv``, ``wait``, ``sync``, ...)."""
    # the one place a record is built; one dict display, no helper call: the simulator makes millions of these
    return {
        "kind": kind,
        "pipeline": pipeline,
        "stage": stage,
        "step": step,
        "microbatch": microbatch,
        "start": start,
        "end": end,
        **fields,
    }


def group_sync(
    pipeline: int, stage: int, step, start: float, end: float, members: list, round_: int, reason: str, lane=None
) -> dict:
    """``span("sync", ...)`` of a member of a decided group (``lane="background"`` for an overlapped averaging),
    spelled out: the simulator makes one per member of every group."""
    record = {
        "kind": "sync",
        "pipeline": pipeline,
        "stage": stage,
        "step": step,
        "microbatch": None,
        "start": start,
        "end": end,
        "group": members,
        "round": round_,
        "reason": reason,
    }
    if lane is not None:
        record["lane"] = lane
    return record


def instant(kind: str, at: float, *, pipeline=None, stage=None, step=None, **fields) -> dict:
    """A record of a moment (start == end)."""
    return span(kind, pipeline, stage, step, None, at, at, **fields)


def group(
    stage: int,
    round_: int,
    members,
    reason: str,
    opened: float,
    closed: float,
    wait: float,
    connected: bool,
    policy: str,
) -> dict:
    """A group the scheduler decided for ``stage``: its round, members, why it closed, its window."""
    return {  # span("group", None, stage, None, None, opened, closed, round=..., ...) spelled out: one per group
        "kind": "group",
        "pipeline": None,
        "stage": stage,
        "step": None,
        "microbatch": None,
        "start": opened,
        "end": closed,
        "round": round_,
        "group": list(members),
        "reason": reason,
        "wait": wait,
        "connected": connected,
        "policy": policy,
    }


def compute(kind: str, pipeline: int, stage: int, step, start: float, end: float) -> dict:
    """``span(kind, pipeline, stage, step, None, start, end)`` of a step's forward or backward, spelled out: the
    simulator makes two per worker and step."""
    return {
        "kind": kind,
        "pipeline": pipeline,
        "stage": stage,
        "step": step,
        "microbatch": None,
        "start": start,
        "end": end,
    }


def control(what: str, at: float, *, applied_by: str, pipeline=None, stage=None, step=None, **fields) -> dict:
    """A change of the run's control (pause, resume, stop, heterogeneity, policy, shaped), and who applied it:
    "driver" (asked), "scheduler" (the group service took it) or "worker" (a worker took it at ``step``)."""
    return instant("control", at, pipeline=pipeline, stage=stage, step=step, what=what, applied_by=applied_by, **fields)


def epoch(pipeline: int, stage: int, step: int, at: float, metrics: dict) -> dict:
    """A pipeline's epoch ended; ``metrics`` is its row of ``RunResult.history``."""
    return instant("epoch", at, pipeline=pipeline, stage=stage, step=step, metrics=metrics)


def stage_info(
    pipeline: int,
    stage: int,
    at: float,
    weight_bytes: int,
    activation_bytes: int,
    address: Optional[str] = None,
    cores: Optional[int] = None,
) -> dict:
    """A worker's stage: bytes of its synchronized state and of one micro-batch's output; the address it is
    reached at and the cores its process may run on."""
    extra = {k: v for k, v in (("address", address), ("cores", cores)) if v is not None}
    return instant(
        "stage",
        at,
        pipeline=pipeline,
        stage=stage,
        weight_bytes=int(weight_bytes),
        activation_bytes=int(activation_bytes),
        **extra,
    )


def checkpoint(epoch_: int, path: str, at: float) -> dict:
    """The checkpoint after ``epoch_`` epochs is in place at ``path``."""
    return instant("checkpoint", at, epoch=epoch_, path=path)


def worker_lost(pipeline: int, stage: int, at: float, worker: str, reason: str) -> dict:
    """A worker was lost (its process died, its Dask worker left, or it stalled); its pipeline drops out."""
    return instant("worker-lost", at, pipeline=pipeline, stage=stage, worker=worker, reason=reason)


def membership(rec: dict) -> Optional[tuple]:
    """``(pipeline, present)`` where ``rec`` says a pipeline joined the run (True) or left it or was lost (False);
    None for any other record."""
    p, kind = rec.get("pipeline"), rec.get("kind")
    if p is None:
        return None
    if kind == "worker-lost" or (kind == "control" and rec.get("what") == "left"):
        return p, False
    if kind == "control" and rec.get("what") == "joined":
        return p, True
    return None


def problems(rec) -> list:
    """What is wrong with ``rec`` against :data:`SCHEMA` (an empty list for a valid record)."""
    if not isinstance(rec, dict):
        return [f"not a dict: {type(rec).__name__}"]
    kind = rec.get("kind")
    if kind not in SCHEMA:
        return [f"kind {kind!r} is not one of {', '.join(SCHEMA)}"]
    out = [f"{kind}: no field {f!r}" for f in COMMON if f not in rec]
    required, optional = SCHEMA[kind]
    out += [f"{kind}: no field {f!r}" for f in required if f not in rec]
    extra = set(rec) - set(COMMON) - set(required) - set(optional)
    out += [f"{kind}: unknown field {f!r}" for f in sorted(extra)]
    for f in ("start", "end"):
        if f in rec and not isinstance(rec[f], (int, float)):
            out.append(f"{kind}: {f} must be a number of seconds, got {rec[f]!r}")
    if isinstance(rec.get("start"), (int, float)) and isinstance(rec.get("end"), (int, float)):
        if rec["end"] < rec["start"] - 1e-9:
            out.append(f"{kind}: ends before it starts ({rec['start']} > {rec['end']})")
    for f in ("pipeline", "stage", "step", "microbatch"):
        v = rec.get(f)
        if v is not None and not is_integer(v):
            out.append(f"{kind}: {f} must be an integer or None, got {v!r}")
    return out


def validate(rec) -> dict:
    """``rec`` itself, or a ValueError naming what does not fit :data:`SCHEMA`."""
    found = problems(rec)
    if found:
        raise ValueError(f"event record: {'; '.join(found)} in {rec!r}"[:500])
    return rec


def pack(records: list) -> bytes:
    """A batch of records as one msgpack blob, as a worker ships it through the Dask event log (:func:`unpack`)."""
    import msgpack

    return msgpack.packb(records, use_bin_type=True)


def unpack(batch) -> list:
    """A shipped batch's records: a blob from :func:`pack`, or a list as it is (the group service's)."""
    if isinstance(batch, bytes):
        import msgpack

        return msgpack.unpackb(batch, raw=False)
    return batch
