"""What a press of the dashboard's controls does: which call of the run it makes with the panel's values, and the
one line the message bar says after it (applied, and when; or why not). Pure: no widgets; the dashboard makes
the call and shows the line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ACTIONS", "Call", "applied_text", "parse_cuts", "plan", "refused_text", "slowdowns_after"]

#: the presses the control panel sends
ACTIONS = ("policy", "slowdowns", "pause", "resume", "stop", "add pipeline", "remove pipeline", "re-cut")


@dataclass(frozen=True)
class Call:
    """A call of the run's: ``getattr(run, method)(*args, **kwargs)``."""

    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def slowdowns_after(slowdown: dict, shown: list, slowdown_of) -> dict:
    """The run's slowdowns after a "slowdowns" press: those of the pipelines whose slider now shows another value
    (``shown``, by pipeline) than the run has (``slowdown_of(p)``) replaced; the rest, a per-stage slowdown set
    from code included, stay as they are."""
    moved = {p: x for p, x in enumerate(shown) if x != slowdown_of(p)}
    out = {k: x for k, x in slowdown.items() if (k[0] if isinstance(k, tuple) else k) not in moved}
    out.update({p: x for p, x in moved.items() if x > 1.0})
    return out


def parse_cuts(text):
    """The re-cut a "cut at" entry asks for: ``"params"``, ``"time"`` or a tuple of cut points (``"3, 6"``); a
    one-line ``ValueError`` otherwise (the run checks the points against its layers)."""
    if not isinstance(text, str):
        raise ValueError(f"cut at: must be text, got {type(text).__name__}")
    words = text.strip().lower()
    if words in ("params", "time"):
        return words
    parts = [x.strip() for x in words.replace(";", ",").split(",") if x.strip()]
    if not parts or not all(x.isdigit() for x in parts):
        raise ValueError(f"cut at: must be cut points (the first layer of stages 1..S-1, e.g. 3, 6), params or time, "
                         f"got {text.strip()!r}")  # fmt: skip
    return tuple(int(x) for x in parts)


def plan(action: str, panel, heterogeneity) -> Call:
    """The run's call for a press of ``action`` with the panel's values now (``panel``: its ``policy``,
    ``staleness``, ``max_group``, ``slowdown``, ``straggle_prob``, ``straggle_delay``, ``remove``, ``cuts``)."""
    if action == "policy":
        return Call("set_policy", (panel.policy,), {"staleness": panel.staleness, "max_group": panel.max_group or None})
    if action == "slowdowns":
        h = heterogeneity
        slow = slowdowns_after(h.slowdown, list(panel.slowdown), lambda p: h.slowdown_of(p, 0))
        return Call(
            "set_heterogeneity",
            (),
            {
                "slowdown": slow,
                "straggle_prob": panel.straggle_prob,
                "straggle_delay": panel.straggle_delay,
                "link_delay": dict(h.link_delay),
                "compute_slowdown": dict(h.compute_slowdown),
            },
        )
    if action == "add pipeline":
        return Call("add_pipelines", (1,))
    if action == "remove pipeline":
        return Call("remove_pipeline", (panel.remove,))
    if action == "re-cut":
        return Call("recut", (parse_cuts(panel.cuts),))
    if action in ("pause", "resume", "stop"):
        return Call(action)
    raise ValueError(f"action: {action!r} is not one of {', '.join(ACTIONS)}")


def applied_text(what: str, answer, panel, t: float, clock: str) -> str:
    """The message bar's line after ``what`` was applied at run time ``t`` (seconds) and wall ``clock``."""
    if what == "stop":
        said = "the pipelines stop at their next step boundary"
    elif what == "pause":
        said = "every worker holds at its next step boundary"
    elif what == "resume":
        said = "the workers go on from where they held"
    elif what == "add pipeline":
        said = f"pipeline {answer[0]} joins once its workers started (a live replica gives it its state)"
    elif what == "remove pipeline":
        said = f"pipeline {panel.remove} leaves at its next step boundary"
    elif what == "re-cut":
        said = f"stages start at layers 0, {', '.join(map(str, answer))}; every worker took it"
    elif what == "policy":
        said = (
            f"{panel.policy} (P = {panel.staleness}, max group {panel.max_group or 'all'}); every worker takes it "
            "at its next step boundary"
        )
    else:
        slow = ", ".join(f"pipeline {i} x{x:g}" for i, x in enumerate(panel.slowdown) if x > 1.0) or "no slowdown"
        said = (
            f"{slow}, straggle p {panel.straggle_prob:g}, delay {panel.straggle_delay:g} s; every worker takes it "
            "at its next step boundary"
        )
    return f"{clock} {what} applied at t = {t:.1f} s: {said}"


def refused_text(what: str, error: BaseException, clock: str) -> str:
    """The message bar's line when ``what`` was not applied."""
    return f"{clock} {what} not applied: {type(error).__name__}: {error}"
