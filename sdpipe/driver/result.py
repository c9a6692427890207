"""What a finished run returns, and how the driver assembles it from the workers' results and the events."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Optional

from sdpipe.config import TrainConfig

__all__ = ["RunError", "RunResult", "assemble", "history", "plain_config"]


class RunError(RuntimeError):
    """A run ended because a worker failed or was lost."""


@dataclass
class RunResult:
    """What a finished run returns."""

    models: list
    """One full ``nn.Sequential`` per pipeline, on the CPU."""
    history: list
    """One dict per epoch and pipeline: epoch, pipeline, loss, samples_per_s, ...; with eval data eval_loss and
    the run's metric under its name (``metric`` says which: "accuracy", "perplexity", a function's name)."""
    events: list
    """Every event record of the run, in arrival order."""
    config: TrainConfig
    wall_time: float
    """Seconds from launch to the last worker's end."""
    stopped: bool = False
    """True when the run ended early through ``Run.stop``."""
    steps: dict = field(default_factory=dict)
    """Steps each pipeline completed."""
    lost: dict = field(default_factory=dict)
    """Pipelines lost during the run (a worker process or its Dask worker died) and not taken back: pipeline ->
    what was lost.  Their entry in ``models`` is None."""
    left: dict = field(default_factory=dict)
    """Pipelines that left the run (``Run.remove_pipeline``, or added too late to join): pipeline -> when.
    Their entry in ``models`` is None."""
    pipelines: int = 0
    """Pipeline ids the run handed out: the first ``config.pipelines``, then one per pipeline added."""
    bounds: list = field(default_factory=list)
    """Under a policy whose groups the group scheduler forms, per stage at the end: the longest unconnected
    stretch of its sync graph in updates against the bound P x D (:func:`sdpipe.core.scheduler.bounds_of`);
    else empty."""
    simulated: bool = False
    """True for a simulated run's (:func:`sdpipe.simulate`): its times are simulated seconds."""
    stretch: float = 1.0
    """A run simulated on shared cores (``simulate(cores=...)``): how many times longer each compute took than
    its costs say, the workers taking turns on the cores (1.0: no turns; a real run's, whose spans hold them)."""

    @property
    def metric(self):
        """The name of the metric the evaluation reported (its key in ``history``), or None."""
        return next((h["metric"] for h in self.history if "metric" in h), None)

    @property
    def finished_pipelines(self) -> list:
        """The pipelines that ran to the end."""
        return [p for p in range(len(self.models)) if self.models[p] is not None]

    def attribution(self, since: Optional[float] = None, until: Optional[float] = None):
        """Where each worker's time went (:func:`sdpipe.attribution.attribute`), between ``since`` and ``until``
        seconds of the run's clock if given."""
        from sdpipe.attribution import attribute

        return attribute(self.events, since=since, until=until)

    def export_trace(self, path) -> str:
        """The run's records as a Chrome trace at ``path`` (:func:`sdpipe.trace_export.export_trace`: a track per
        worker, its rounds linked, its controls and epochs marked); open it in ui.perfetto.dev or chrome://tracing.
        Returns the path written."""
        from sdpipe.trace_export import export_trace

        return export_trace(self, path)

    def max_param_diff(self) -> float:
        """Largest absolute difference of any parameter between the first finished pipeline and the others."""
        models = [m for m in self.models if m is not None]
        ref = models[0].state_dict()
        worst = 0.0
        for m in models[1:]:
            for k, v in m.state_dict().items():
                worst = max(worst, float((v.float() - ref[k].float()).abs().max()))
        return worst


def history(events: list) -> list:
    """The ``epoch`` records' metrics, by epoch and pipeline."""
    rows = [e["metrics"] for e in events if e.get("kind") == "epoch"]
    return sorted(rows, key=lambda r: (r["epoch"], r["pipeline"]))


def plain_config(config: TrainConfig) -> dict:
    """The configuration as JSON data (a checkpoint's manifest)."""
    return json.loads(json.dumps(config.to_dict(), default=str))


def assemble(
    config: TrainConfig,
    stage_modules: list,
    results: dict,
    lost: dict,
    events: list,
    from_sequential: bool,
    left: Optional[dict] = None,
    pipelines: Optional[int] = None,
    bounds: Optional[list] = None,
) -> RunResult:
    """The run's :class:`RunResult` from each finished rank's result (its weights, steps, whether it stopped).

    A lost pipeline's model is None, as is that of a pipeline that left.  An ``nn.Sequential`` comes back
    with its original layer names; a list of stages as one module per stage.
    """
    from torch import nn

    from sdpipe.core.partition import partition

    left = left or {}
    pipelines = config.pipelines if pipelines is None else pipelines
    models = []
    for p in range(pipelines):
        if p in lost or p in left:
            models.append(None)
            continue
        parts = []
        cut = results[p * config.stages].cuts
        if from_sequential and cut is not None:  # the pipeline's own cut as it ended (a late re-cut: not taken)
            whole = nn.Sequential(*[layer for m in stage_modules for layer in m])
            modules = partition(whole, config.stages, list(cut))
        else:
            modules = stage_modules
        for s in range(config.stages):
            mod = copy.deepcopy(modules[s])
            mod.load_state_dict(results[p * config.stages + s].state)
            parts.append(mod)
        layers = [layer for part in parts for layer in part] if from_sequential else parts
        models.append(nn.Sequential(*layers))
    return RunResult(
        models=models,
        history=history(events),
        events=events,
        config=config,
        wall_time=max([e["end"] for e in events] + [0.0]),
        stopped=any(r.stopped for r in results.values()),
        steps={p: results[p * config.stages].steps for p in range(pipelines) if p not in lost and p not in left},
        lost=dict(lost),
        left=dict(left),
        pipelines=pipelines,
        bounds=list(bounds or []),
    )
