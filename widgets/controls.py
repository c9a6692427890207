"""The live dashboard's control panel: one widget whose buttons carry the values they apply.

A press sends the values of the inputs the user touched since the last press, as one custom message; the
others keep what the kernel shows (the run's own values, which the dashboard keeps the panel following).
ipywidgets' inputs would sync each value as a state update instead, and the
front end sends those one at a time, each after the kernel reported itself
idle for the last one; a kernel that handles widget messages while a cell
awaits (``await run``) reports no such idle, so a slider moved during the
await would stay in the page and "apply" would apply its old value.
Custom messages are not held back like that.

Values the kernel sets (``panel.slowdown = [...]``) are shown in the page; the
page's values reach the kernel with the next press.
"""

from __future__ import annotations

import anywidget
import traitlets

from sdpipe.core.checks import number
from sdpipe.widgets.actions import ACTIONS, parse_cuts

__all__ = ["ACTIONS", "ControlPanel"]

#: (lowest, highest, step) of each slider
SLOWDOWN = (1.0, 8.0, 0.5)
STRAGGLE_PROB = (0.0, 0.5, 0.05)
STRAGGLE_DELAY = (0.0, 0.5, 0.01)
MAX_STALENESS = 1000


class ControlPanel(anywidget.AnyWidget):
    """Policy, heterogeneity and run controls of one run.

    ``on_press(action)`` is called in the kernel when a button is pressed in a
    page (after the values sent with it were taken) or by :meth:`press`.
    """

    _esm = r"""
    const el_ = (tag, props = {}, ...kids) => {
      const e = Object.assign(document.createElement(tag), props);
      for (const k of kids) e.append(k);
      return e;
    };
    export default {
      render({ model, el }) {
        el.classList.add("sdpipe-controls");
        const inputs = {};
        const slider = (key, label, lo, hi, step, get) => {
          const input = el_("input", { type: "range", min: lo, max: hi, step: step });
          const out = el_("output");
          const show = () => { out.textContent = Number(input.value).toFixed(step < 0.1 ? 2 : 1); };
          input.addEventListener("input", show);
          inputs[key] = { input, set: (v) => { input.value = v; show(); } };
          return el_("label", { className: "sdpipe-row" }, el_("span", { textContent: label }), input, out);
        };
        const button = (action, style = "") =>
          el_("button", { textContent: action, className: `sdpipe-button ${style}`, onclick: () => press(action) });

        // what the user changed in the page since the last press: a press sends only those (the kernel keeps
        // the run's own values for the others), and the run's values never overwrite an input being edited
        const touched = new Set();
        const touch = (key, e) => e.addEventListener("input", () => touched.add(key));

        // policy
        const select = el_("select");
        for (const name of model.get("policies")) select.append(el_("option", { value: name, textContent: name }));
        touch("policy", select);
        const staleness = el_("input", { type: "number", min: 1, max: 1000, step: 1,
          title: "staleness bound P: every P x D updates, a graph sync mixes every pipeline with every other" });
        touch("staleness", staleness);
        const maxGroup = el_("input", { type: "number", min: 0, max: model.get("pipelines"), step: 1,
                                        title: "the largest partial-reduce group; 0: all pipelines" });
        touch("max_group", maxGroup);
        const policyButton = button("policy");
        const policyBox = el_("div", { className: "sdpipe-col sdpipe-policy" }, el_("b", { textContent: "policy" }),
          el_("label", { className: "sdpipe-row" }, el_("span", { textContent: "policy" }), select),
          el_("label", { className: "sdpipe-row", title: staleness.title },
            el_("span", { textContent: "staleness P" }), staleness),
          el_("label", { className: "sdpipe-row", title: maxGroup.title },
            el_("span", { textContent: "max group" }), maxGroup, el_("small", { textContent: "0: all" })),
          policyButton);

        // heterogeneity
        const hetBox = el_("div", { className: "sdpipe-col sdpipe-het" },
          el_("b", { textContent: "heterogeneity (slowdown per pipeline)",
                     title: "a pipeline slowed k times: its own steps take k times as long" }));
        const n = model.get("pipelines");
        for (let p = 0; p < n; p++) hetBox.append(slider(`slowdown/${p}`, `pipeline ${p}`, 1, 8, 0.5));
        hetBox.append(slider("straggle_prob", "straggle p", 0, 0.5, 0.05),
                      slider("straggle_delay", "delay (s)", 0, 0.5, 0.01));
        for (const key of [...Array.from({ length: n }, (_, p) => `slowdown/${p}`), "straggle_prob", "straggle_delay"])
          touch(key, inputs[key].input);
        const slowButton = button("slowdowns");
        hetBox.append(slowButton);

        const pauseButton = button("pause"), resumeButton = button("resume");
        const stopButton = button("stop", "sdpipe-danger");
        const runBox = el_("div", { className: "sdpipe-col sdpipe-run" }, el_("b", { textContent: "run" }),
          pauseButton, resumeButton, stopButton);

        // pipelines joining and leaving
        const removeInput = el_("input", { type: "number", min: 0, step: 1, title: "the pipeline to remove" });
        touch("remove", removeInput);
        const addButton = button("add pipeline");
        const removeButton = button("remove pipeline");
        const memberBox = el_("div", { className: "sdpipe-col sdpipe-members" }, el_("b", { textContent: "pipelines" }),
          addButton,
          el_("label", { className: "sdpipe-row" }, el_("span", { textContent: "pipeline" }), removeInput),
          removeButton);
        // the model's cut into stages
        const cutInput = el_("input", { type: "text", placeholder: "3, 6 or time",
          title: "the first layer of stages 1..S-1, comma separated; or params (balanced by parameter count) or " +
                 "time (by each layer's measured time)" });
        touch("cuts", cutInput);
        const recutButton = button("re-cut");
        const stageBox = el_("div", { className: "sdpipe-col sdpipe-stages" }, el_("b", { textContent: "stages" }),
          el_("label", { className: "sdpipe-row", title: cutInput.title }, el_("span", { textContent: "cut at" }),
            cutInput),
          recutButton);
        el.append(el_("div", { className: "sdpipe-panel" }, policyBox, hetBox, runBox, memberBox, stageBox));

        // the values the user touched; an untouched slowdown travels as null (the kernel keeps the run's)
        const values = () => {
          const all = {
            policy: select.value,
            staleness: Number(staleness.value),
            max_group: Number(maxGroup.value),
            straggle_prob: Number(inputs.straggle_prob.input.value),
            straggle_delay: Number(inputs.straggle_delay.input.value),
            remove: Number(removeInput.value),
            cuts: cutInput.value,
          };
          const out = Object.fromEntries(Object.entries(all).filter(([k]) => touched.has(k)));
          const slow = Array.from({ length: n }, (_, p) =>
            touched.has(`slowdown/${p}`) ? Number(inputs[`slowdown/${p}`].input.value) : null);
          if (slow.some((v) => v !== null)) out.slowdown = slow;
          return out;
        };
        // one custom message with the values: state updates would wait in the page while a cell awaits
        const press = (action) => { model.send({ action, values: values() }); touched.clear(); };

        const show = () => {
          const status = model.get("status");
          const live = status === "running" || status === "paused";
          const set = (key, apply) => { if (!touched.has(key)) apply(); };
          set("policy", () => { select.value = model.get("policy"); });
          const enabled = model.get("policy_enabled") && live;
          for (const e of [select, staleness, maxGroup, policyButton]) e.disabled = !enabled;
          set("staleness", () => { staleness.value = model.get("staleness"); });
          set("max_group", () => { maxGroup.value = model.get("max_group"); });
          model.get("slowdown").forEach((v, p) =>
            inputs[`slowdown/${p}`] && set(`slowdown/${p}`, () => inputs[`slowdown/${p}`].set(v)));
          set("straggle_prob", () => inputs.straggle_prob.set(model.get("straggle_prob")));
          set("straggle_delay", () => inputs.straggle_delay.set(model.get("straggle_delay")));
          for (const [key, { input }] of Object.entries(inputs)) input.disabled = !live;
          slowButton.disabled = !live;
          set("remove", () => { removeInput.value = model.get("remove"); });
          pauseButton.disabled = status !== "running";
          resumeButton.disabled = status !== "paused";
          stopButton.disabled = !(live || status === "starting");
          for (const e of [addButton, removeButton, removeInput]) e.disabled = !(model.get("elastic") && live);
          set("cuts", () => { cutInput.value = model.get("cuts"); });
          for (const e of [cutInput, recutButton]) e.disabled = !(model.get("recut_enabled") && live);
          el.dataset.status = status;
        };
        show();
        model.on("change", show);
        return () => model.off("change", show);
      }
    };
    """
    _css = """
    .sdpipe-controls .sdpipe-panel { display: flex; flex-flow: row wrap; gap: 4px 24px;
      font-size: var(--jp-widgets-font-size, 13px); color: var(--jp-widgets-color, inherit); }
    .sdpipe-controls .sdpipe-col { display: flex; flex-direction: column; gap: 4px; }
    .sdpipe-controls .sdpipe-policy { width: 300px; }
    .sdpipe-controls .sdpipe-het { width: 340px; }
    .sdpipe-controls .sdpipe-run { width: 150px; }
    .sdpipe-controls .sdpipe-members { width: 260px; }
    .sdpipe-controls .sdpipe-stages { width: 260px; }
    .sdpipe-controls .sdpipe-row { display: flex; align-items: center; gap: 8px; }
    .sdpipe-controls .sdpipe-row > span { width: 80px; flex: none; text-align: right; }
    .sdpipe-controls .sdpipe-row > select, .sdpipe-controls .sdpipe-row > input[type=number] { width: 150px; }
    .sdpipe-controls .sdpipe-row > input[type=range] { width: 190px; }
    .sdpipe-controls .sdpipe-row > output { width: 36px; font-variant-numeric: tabular-nums; }
    .sdpipe-controls .sdpipe-button { width: 148px; height: 28px; cursor: pointer; border: none; border-radius: 2px;
      background: var(--jp-layout-color2, #eee); color: inherit; }
    .sdpipe-controls .sdpipe-button:hover { box-shadow: 0 1px 3px rgba(0, 0, 0, 0.3); }
    .sdpipe-controls .sdpipe-button:disabled { opacity: 0.5; cursor: default; box-shadow: none; }
    .sdpipe-controls .sdpipe-danger { background: #d9534f; color: white; }
    """

    policies = traitlets.List(traitlets.Unicode()).tag(sync=True)
    #: the policy shown ("" when the run's policy cannot be switched live)
    policy = traitlets.Unicode("").tag(sync=True)
    policy_enabled = traitlets.Bool(True).tag(sync=True)
    staleness = traitlets.Int(1).tag(sync=True)
    #: the largest group; 0: all pipelines
    max_group = traitlets.Int(0).tag(sync=True)
    pipelines = traitlets.Int(1).tag(sync=True)
    slowdown = traitlets.List(traitlets.Float()).tag(sync=True)
    straggle_prob = traitlets.Float(0.0).tag(sync=True)
    straggle_delay = traitlets.Float(0.0).tag(sync=True)
    #: the pipeline "remove pipeline" takes out
    remove = traitlets.Int(0).tag(sync=True)
    #: whether pipelines can be added and removed (the run's policy lets them)
    elastic = traitlets.Bool(False).tag(sync=True)
    #: the cut "re-cut" moves the stages to: cut points ("3, 6"), "params" or "time"
    cuts = traitlets.Unicode("").tag(sync=True)
    #: whether the run can be re-cut (an nn.Sequential, under a policy that lets it)
    recut_enabled = traitlets.Bool(False).tag(sync=True)
    #: the run's status: the buttons that do not apply to it are disabled ("running": all but resume, "paused":
    #: all but pause, "starting": stop alone, ended: none)
    status = traitlets.Unicode("running").tag(sync=True)

    def __init__(self, on_press, **kwargs):
        super().__init__(**kwargs)
        self._on_press = on_press
        self.on_msg(self._on_message)

    def press(self, action: str, **values) -> None:
        """Press ``action``'s button with these values (the others as they are), as a press in a page does."""
        if action not in ACTIONS:
            raise ValueError(f"action: must be one of {', '.join(ACTIONS)}, got {action!r}")
        self._take(values)
        self._on_press(action)

    def _on_message(self, _, content, buffers) -> None:
        if not isinstance(content, dict) or content.get("action") not in ACTIONS:
            return
        try:
            self._take(content.get("values") or {})
        except ValueError as e:  # a page sent values its inputs should not allow: say so, apply nothing
            self._on_press(content["action"], error=e)
            return
        self._on_press(content["action"])

    def _take(self, values: dict) -> None:
        """Check ``values`` (as sent by a page or given to :meth:`press`) and take them."""
        known = {"policy", "staleness", "max_group", "slowdown", "straggle_prob", "straggle_delay", "remove", "cuts"}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"values: unknown {', '.join(sorted(unknown))}")
        checked = {}
        if "policy" in values:
            if values["policy"] not in self.policies and values["policy"] != self.policy:
                raise ValueError(f"policy: must be one of {', '.join(self.policies)}, got {values['policy']!r}")
            checked["policy"] = values["policy"]
        if "staleness" in values:
            checked["staleness"] = number("P (staleness)", values["staleness"], 1, MAX_STALENESS, whole=True)
        if "max_group" in values:
            checked["max_group"] = number("max group", values["max_group"], 0, self.pipelines, whole=True)
        if "slowdown" in values:  # None: that pipeline's slowdown as it is (a page sends only what was touched)
            s = values["slowdown"]
            if not isinstance(s, (list, tuple)) or len(s) != self.pipelines:
                raise ValueError(f"slowdown: must be {self.pipelines} numbers (one per pipeline), got {s!r}")
            checked["slowdown"] = [
                self.slowdown[p] if x is None else number(f"slowdown of pipeline {p}", x, *SLOWDOWN[:2])
                for p, x in enumerate(s)
            ]
        if "straggle_prob" in values:
            checked["straggle_prob"] = number("straggle p", values["straggle_prob"], *STRAGGLE_PROB[:2])
        if "straggle_delay" in values:
            checked["straggle_delay"] = number("delay", values["straggle_delay"], *STRAGGLE_DELAY[:2])
        if "remove" in values:
            checked["remove"] = number("pipeline", values["remove"], 0, 10**6, whole=True)
        if "cuts" in values:
            parse_cuts(values["cuts"])  # a one-line error for what is no cut at all; the run checks the rest
            checked["cuts"] = str(values["cuts"]).strip()
        with self.hold_sync():
            for k, v in checked.items():
                setattr(self, k, v)
