"""``sdpipe.train``: check everything before any worker starts, then hand the run to a :class:`~sdpipe.Run`.

Every input is checked on the driver, in this order, each failure a one-line ``ValueError`` naming the
field: the configuration (:class:`~sdpipe.TrainConfig`), the script's main guard (the embedded cluster
imports it again), the device, the model's cut and one trial micro-batch through every stage, the data,
the loss, a checkpoint to resume from, the security settings.  Then the :class:`~sdpipe.wire.protocol.WorkerSpec`
every worker starts from is built once, and :class:`~sdpipe.Run` launches the workers in the background.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import uuid
from typing import Optional

from sdpipe.checkpoint import load_checkpoint
from sdpipe.config import TrainConfig, config_keywords
from sdpipe.core.partition import cut_points, partition
from sdpipe.core.policies import record
from sdpipe.core.schedule import build_plan
from sdpipe.data import StreamSource, as_source
from sdpipe.driver.run import Run
from sdpipe.wire.protocol import WorkerSpec, metric_name
from sdpipe.worker.tree import layout_of

__all__ = ["train"]


@config_keywords
def train(
    model,
    train_data,
    *,
    eval_data=None,
    loss_fn=None,
    metric=None,
    collate_fn=None,
    cluster=None,
    resume_from=None,
    security=None,
    **options,
) -> Run:
    """Train ``model`` with ``stages`` x ``pipelines`` workers; returns a :class:`Run` at once.

    ``model`` is an ``nn.Sequential`` (cut into ``stages`` contiguous stages,
    balanced by parameter count unless ``cuts`` is given) or a list of stage
    modules.  A stage returns a tensor or a tuple, list or dict of tensors
    (nested as you like, the micro-batch along dimension 0 of each); the next
    stage receives that structure as its one argument.

    ``train_data``/``eval_data`` are an ``(inputs, targets)`` pair (tensors,
    or structures of tensors with the samples along dimension 0) or a
    map-style torch ``Dataset`` whose items ``collate_fn`` (default: torch's
    ``default_collate``) turns into an ``(inputs, targets)`` pair per batch;
    a ``collate_fn`` that pads each batch to its own longest sequence gives
    batches of different shapes, which is fine.

    ``loss_fn(output, targets) -> loss`` (default: cross entropy) takes the
    last stage's output for one micro-batch; a step's loss is the
    micro-batches' losses weighted by their share of the batch's samples (for a
    mean-reducing loss, the batch's mean, as one process would compute it).
    ``metric``: what the evaluation reports next to the held-out loss, under
    its name: ``"accuracy"`` (the share of target elements whose class scores,
    on the output's last dimension, are highest), ``"perplexity"``
    (``exp`` of the held-out loss), a function ``(output, targets) -> number``
    (averaged over the evaluation's batches, weighted by their samples; named
    by its ``__name__``), or None: accuracy for integer targets of class
    scores, else the loss alone.

    ``cluster=None`` starts an embedded
    ``LocalCluster`` (one single-threaded process per worker, closed at the
    end); a scheduler address or a ``distributed.Client`` uses an existing one.

    ``checkpoint_every=N`` writes a checkpoint to ``checkpoint_dir`` after
    every N-th epoch (see :mod:`sdpipe.checkpoint`); ``resume_from`` (a
    checkpoint folder, or a checkpoint_dir for its latest) starts at that
    checkpoint's epoch with its weights, optimizer and random states.

    ``host``: the address the run's rendezvous store listens on, which every
    worker must reach.  By default it is this machine's address on the
    interface that routes to the Dask scheduler (127.0.0.1 for an embedded or
    loopback cluster).  Each worker binds its own tensors' sockets to its own
    host's address (the host part of its Dask worker address).

    ``security`` (a ``distributed.Security``) connects to a TLS-secured
    scheduler address (``tls://...``).  Dask's TLS covers the control plane;
    tensors and the rendezvous store go over torch.distributed (plain TCP), so
    the store and the workers should stay on a trusted network.

    Everything is checked before any worker starts; bad input raises a
    one-line ``ValueError`` naming the field.
    """
    config = TrainConfig(**options)  # options only ever holds TrainConfig fields (see config_keywords)
    data = (train_data, eval_data, collate_fn)
    return _start(config, model, data, loss_fn, metric, cluster, resume_from, security)


def _start(config: TrainConfig, model, data, loss_fn, metric, cluster, resume_from, security) -> Run:
    """The checks after the configuration's own, the worker spec, and the run."""
    from torch import nn

    if cluster is None:
        _check_main_guard()
    _check_device(config, cluster)
    if config.cuts == "time" and not isinstance(model, nn.Sequential):
        raise ValueError(f"cuts: 'time' cuts an nn.Sequential; the model is {type(model).__name__}")
    if config.rebalance is not None and not isinstance(model, nn.Sequential):
        raise ValueError(f"rebalance: re-cuts an nn.Sequential; the model is {type(model).__name__}")
    if resume_from is not None and config.cuts in (None, "params") and isinstance(model, nn.Sequential):
        config = _checkpoint_cut(config, resume_from)
    stage_modules = None  # cut here, or by time once a micro-batch of the data is at hand
    if config.cuts != "time":
        stage_modules = [copy.deepcopy(m) for m in partition(model, config.stages, config.cuts)]
    train_data, eval_data, collate_fn = data
    if collate_fn is not None and not callable(collate_fn):
        raise ValueError(
            f"collate_fn: must be callable (list of items) -> (inputs, targets), got {type(collate_fn).__name__}"
        )
    source = as_source(train_data, "train_data", collate_fn)
    eval_source = None if eval_data is None else as_source(eval_data, "eval_data", collate_fn)
    streamed = isinstance(source, StreamSource)
    steps, batches = _check_data(config, len(source), source.shard_sizes(config.pipelines) if streamed else None)
    if loss_fn is None:
        loss_fn = nn.CrossEntropyLoss()
    elif not callable(loss_fn):
        raise ValueError(f"loss_fn: must be callable (output, target) -> loss, got {type(loss_fn).__name__}")
    sample, targets = source.sample(config.microbatch_size)
    layer_costs = None
    if config.cuts == "time":
        cuts, layer_costs = _time_cut(model, config, sample, targets, loss_fn, resume_from)
        config = dataclasses.replace(config, cuts=tuple(cuts), memory_limit=None)
    if stage_modules is None:
        stage_modules = [copy.deepcopy(m) for m in partition(model, config.stages, config.cuts)]
    sequential = isinstance(model, nn.Sequential)
    cuts = tuple(cut_points(list(model), config.stages, config.cuts)) if sequential else None
    layouts, output = _probe_layouts(stage_modules, sample)
    metric = _check_loss_and_metric(loss_fn, metric, output, targets)
    resume, start = _resumed(resume_from, config, stage_modules)
    _check_security(security, cluster)
    spec = WorkerSpec(
        run_id=uuid.uuid4().hex[:10],
        config=config.to_dict(),
        backend=config.resolved_backend,
        stage_modules=stage_modules,
        loss_fn=loss_fn,
        layouts=layouts,
        plan=build_plan(config.schedule, config.stages, config.microbatches, update_every=config.resolved_update_every),
        train_size=len(source),
        eval_size=0 if eval_source is None else len(eval_source),
        steps_per_epoch=steps,
        batches_per_epoch=batches,
        metric=metric,
        streamed=streamed,
        target_layout=layout_of(targets, "targets") if streamed else None,
        t0=time.time(),
        cuts=cuts,
        **start,
    )
    run = Run(
        config,
        stage_modules,
        spec,
        (source, eval_source),
        cluster,
        from_sequential=sequential,
        resume=resume,
        security=security,
    )
    run.layer_costs = layer_costs
    run._probe = (sample, targets, loss_fn)  # what a re-cut probes its stages' outputs (and times layers) with
    if config.rebalance is not None:
        from sdpipe.driver.rebalance import Rebalancer

        run._rebalancer = Rebalancer(run, config.rebalance)
        run._rebalancer.start()
    return run


def _time_cut(model, config: TrainConfig, sample, targets, loss_fn, resume_from) -> tuple:
    """(cut points, each layer's :class:`~sdpipe.driver.layers.LayerCost`) of ``cuts="time"``: the slowest stage
    as fast as it can be on the times measured here (within ``memory_limit``); a resumed run keeps its
    checkpoint's cut (its stages' weights are cut that way)."""
    from sdpipe.driver.layers import measure, memory_of, time_cut

    layers = list(model)
    if config.stages > len(layers):
        raise ValueError(
            f"stages: {config.stages} exceeds the {len(layers)} layers of the model; allowed 1..{len(layers)}"
        )
    if resume_from is not None:
        saved = load_checkpoint(resume_from).config.get("cuts")
        if isinstance(saved, list) and len(saved) == config.stages - 1:
            return saved, None
    try:
        costs = measure(layers, sample, targets, loss_fn)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"cuts: timing the layers on a micro-batch failed: {type(e).__name__}: {first}") from None
    memory = [memory_of(c, config.microbatches) for c in costs]
    cuts = time_cut(costs, config.stages, memory, config.memory_limit)
    return cuts, costs


def _checkpoint_cut(config: TrainConfig, resume_from) -> TrainConfig:
    """A run resumed with the default cut takes its checkpoint's cut points, where it has some (a run re-cut
    while it trained, or cut by time, wrote its stages' weights cut that way)."""
    try:
        saved = load_checkpoint(resume_from).config.get("cuts")
    except Exception:  # no checkpoint there: _check_resume says so in one line
        return config
    if isinstance(saved, list) and len(saved) == config.stages - 1:
        return dataclasses.replace(config, cuts=tuple(saved))
    return config


def _resumed(resume_from, config: TrainConfig, stage_modules) -> tuple:
    """The checkpoint a run resumes from (checked against the run) and where each pipeline starts; (None, {})."""
    if resume_from is None:
        return None, {}
    resume = _check_resume(resume_from, config, stage_modules)
    most = max(resume.steps.values())
    start = {
        "start_epoch": resume.epoch,
        "start_steps": {str(p): resume.steps.get(p, most) for p in range(config.pipelines)},
    }
    return resume, start


def _check_device(config: TrainConfig, cluster) -> None:
    import torch

    if config.device != "cuda" or cluster is not None:
        return
    if not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but this machine has no GPU; use device='cpu'")
    if config.resolved_backend == "nccl" and torch.cuda.device_count() < config.world_size:
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), seen on a 1-GPU machine after 14 s
        raise ValueError(
            f"device: NCCL needs one GPU per worker: {config.world_size} workers (stages x pipelines), "
            f"{torch.cuda.device_count()} GPU(s) here; pass backend='gloo' to share GPUs"
        )


def _check_data(config: TrainConfig, n: int, shards: Optional[list] = None) -> tuple[int, int]:
    """Steps per pipeline in lock step and batches per epoch, or a one-line error when the data holds no full step.

    ``shards``: a stream's items per pipeline; its pipelines read their own shards only, so an epoch's batches
    are their shards' and lock-step pipelines take the full batches of the smallest shard."""
    bs, rest = config.batch_size, n % config.batch_size
    if n < bs:
        raise ValueError(f"batch_size: {bs} exceeds the {n} training samples")
    if not config.drop_last and rest and rest < config.microbatches and shards is None:
        raise ValueError(
            f"drop_last: the last batch would hold {rest} samples, fewer than the {config.microbatches} "
            f"micro-batches; keep drop_last=True or change batch_size"
        )
    if shards is not None:
        whole = lambda k: k // bs + (not config.drop_last and k % bs >= config.microbatches)
        return min(shards) // bs, sum(whole(k) for k in shards)
    batches = n // bs + (not config.drop_last and rest > 0)
    steps = batches // config.pipelines
    if steps < 1 and record(config.policy).coupled:
        raise ValueError(
            f"batch_size: {bs} x {config.pipelines} pipelines exceeds the {n} training samples; no full step per epoch"
        )
    return steps, batches


def _check_security(security, cluster) -> None:
    if security is None:
        return
    from distributed.security import Security

    if not isinstance(security, Security):
        raise ValueError(f"security: must be a distributed.Security or None, got {type(security).__name__}")
    if not isinstance(cluster, str) and not hasattr(cluster, "scheduler_address"):
        raise ValueError("security: applies to a scheduler address or a cluster object; a Client brings its own")


def _probe_layouts(stage_modules, sample):
    """The layout of each stage's output (:mod:`sdpipe.worker.tree`), from one micro-batch on the driver, and the last
    stage's output; one-line errors naming the stage that fails, or returns what cannot cross a boundary."""
    import torch

    from sdpipe.worker.tree import describe, layout_of

    layouts = []
    x = sample
    with torch.no_grad():
        for s, mod in enumerate(stage_modules):
            given = "a micro-batch of train_data" if s == 0 else f"stage {s - 1}'s output {describe(x)}"
            try:
                x = copy.deepcopy(mod)(x)
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise ValueError(f"model: stage {s} fails on {given}: {type(e).__name__}: {first}") from None
            try:
                layouts.append(layout_of(x, "output"))
            except ValueError as e:
                raise ValueError(
                    f"model: stage {s} must return a tensor or a tuple, list or dict of tensors with the micro-batch "
                    f"as dimension 0; its {e}"
                ) from None
    return layouts, x


def _check_loss_and_metric(loss_fn, metric, output, targets):
    """The metric to report (a name or a function), after one trial of the loss and the metric on the last
    stage's output for the trial micro-batch."""
    import torch

    from sdpipe.worker.tree import describe

    what = f"the last stage's output {describe(output)} and targets {describe(targets)}"
    try:
        with torch.no_grad():
            loss = loss_fn(output, targets)
    except Exception as e:
        raise ValueError(f"loss_fn: fails on {what}: {type(e).__name__}: {str(e).strip()[:200]}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(f"loss_fn: must return a one-element float tensor, got {describe(loss)} for {what}")
    classes = (
        isinstance(output, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and not targets.is_floating_point()
        and output.dim() == targets.dim() + 1
        and tuple(output.shape[:-1]) == tuple(targets.shape)
    )
    if metric is None:
        return "accuracy" if classes else None
    if metric == "accuracy":
        if not classes:
            raise ValueError(
                f"metric: 'accuracy' needs integer targets and class scores on the output's last dimension; got {what}"
            )
        return metric
    if metric == "perplexity":
        return metric
    if callable(metric):
        try:
            with torch.no_grad():
                float(metric(output, targets))
        except Exception as e:
            raise ValueError(f"metric: {metric_name(metric)} fails on {what}: {type(e).__name__}: {e}") from None
        return metric
    raise ValueError(
        f"metric: must be 'accuracy', 'perplexity', a function (output, targets) -> number or None, got {metric!r}"
    )


def _unguarded_main_line() -> Optional[tuple]:
    """(script, line) when this call comes from a script's top-level code outside ``if __name__ == "__main__":``.

    The embedded cluster's worker processes start by spawn, which imports the
    script again in each of them (as ``__mp_main__``): unguarded, that import
    trains again, and Dask only says "Nanny failed to start" after pages of
    tracebacks. Scripts run as files are checked (their source, parsed);
    notebooks, ``python -c`` and interactive sessions have nothing to re-import.
    """
    import ast
    import sys
    from pathlib import Path

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not str(path).endswith(".py"):
        return None
    frame, top = sys._getframe(1), None
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            top = frame
        frame = frame.f_back
    if top is None:
        return None
    line = top.f_lineno
    try:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None

    def is_guard(test) -> bool:
        if not isinstance(test, ast.Compare) or len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
            return False
        sides = [test.left, test.comparators[0]]
        return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
            isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_guard(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
                return None
    return str(path), line


def _check_main_guard() -> None:
    from pathlib import Path

    found = _unguarded_main_line()
    if found is not None:
        path, line = found
        # a plain message and exit status 1, no traceback: the fix is one line in the user's script
        raise SystemExit(
            f"sdpipe: {Path(path).name} line {line} trains at the top level of the script; put that code under "
            f"'if __name__ == \"__main__\":' (the embedded Dask cluster starts its workers by importing the script "
            f"again)"
        )


def _check_resume(path, config: TrainConfig, stage_modules):
    """The checkpoint at ``path``, after checking it fits this run (one-line ValueErrors naming the field)."""
    ck = load_checkpoint(path)
    saved = ck.config
    if saved["stages"] != config.stages:  # the number of pipelines may differ (see sdpipe.checkpoint)
        raise ValueError(f"stages: the checkpoint at {ck.path} has stages={saved['stages']}, this run {config.stages}")
    if ck.epoch >= config.epochs:
        raise ValueError(
            f"epochs: the checkpoint at {ck.path} is at epoch {ck.epoch}; ask for more than {ck.epoch} epochs to resume"
        )
    for s, module in enumerate(stage_modules):
        state = ck.stage_state(0, s)
        if state.get("optimizer_name") != config.optimizer:
            raise ValueError(
                f"optimizer: the checkpoint at {ck.path} used {state.get('optimizer_name')!r}, "
                f"this run {config.optimizer!r}"
            )
        mine = module.state_dict()
        theirs = state["model"]
        for key in sorted(set(mine) | set(theirs)):
            if key not in mine or key not in theirs or tuple(mine[key].shape) != tuple(theirs[key].shape):
                have = tuple(theirs[key].shape) if key in theirs else "missing"
                want = tuple(mine[key].shape) if key in mine else "missing"
                raise ValueError(
                    f"model: stage {s} parameter {key!r} is {have} in the checkpoint at {ck.path}, {want} in this model"
                )
    return ck
