"""A run's Chrome trace (``run.export_trace(path)``) drawn as a timeline in one self-contained HTML page.

Perfetto (ui.perfetto.dev) and chrome://tracing open the trace too; this page needs neither a network nor a
server: the trace, the script and the styles are inline, and a file picker in it opens another trace::

    python tools/trace_view.py run.json               # writes run.html beside it
    python tools/trace_view.py run.json -o view.html

One row per thread of the trace (a worker's stage, its overlapped averaging, a stage of the group scheduler)
under its process (a pipeline, the group scheduler); every complete event a bar in the colour of its time
category (the dashboard's colours, ``sdpipe.widgets.style.COLORS``: compute blue, a pipeline bubble as
communication orange, averaging green, waiting for a group grey, a pause hatched grey), nested ones inset; each
flow (a round's members) a line through its points; instants as marks: a control over every row, an epoch over
its pipeline's rows, a worker's own on its row.  Wheel to zoom, drag to pan, double-click for the whole run.
Hover a bar for its record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: the time categories of sdpipe.attribution (and "background": an overlapped averaging) -> the dashboard's
#: colour that draws the same time (its kinds: forward/backward compute, send/recv communication, sync
#: synchronization, wait and pause waiting, eval and save eval)
CATEGORY_KIND = {
    "compute": "compute",
    "bubble": "communication",
    "averaging": "synchronization",
    "background": "synchronization",
    "group": "waiting",
    "paused": "waiting",
    "eval": "eval",
}


def colors() -> dict:
    from sdpipe.widgets.style import COLORS

    return {category: COLORS[kind] for category, kind in CATEGORY_KIND.items()}


def page(trace: dict, title: str = "sdpipe trace") -> str:
    """The HTML page that draws ``trace`` (a Chrome trace's JSON object)."""
    data = json.dumps(trace).replace("</", "<\\/")  # inside a <script> element
    return (
        _PAGE.replace("{{TITLE}}", title.replace("<", "&lt;"))
        .replace("{{COLORS}}", json.dumps(colors()))
        .replace("{{TRACE}}", data)
    )


_PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{{TITLE}}</title>
<style>
  body { font: 13px system-ui, sans-serif; color: #2a3f5f; margin: 12px 16px; }
  h1 { font-size: 16px; margin: 0 0 4px; }
  #summary { margin-bottom: 6px; }
  #legend span { display: inline-block; margin-right: 14px; }
  #legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -2px; }
  #timeline { display: block; user-select: none; cursor: grab; }
  .row-label { font-size: 12px; }
  .process-label { font-size: 12px; font-weight: 600; }
  .span-text { font-size: 10px; fill: white; pointer-events: none; }
  .tick { font-size: 10px; fill: #506784; }
  .instant-text { font-size: 10px; }
  .flow { fill: none; stroke: #E45756; stroke-width: 1.2; stroke-opacity: 0.75; }
  .hint { color: #7f8fa6; margin-left: 12px; }
</style>
</head>
<body>
<h1>{{TITLE}}</h1>
<div id="summary"></div>
<div id="legend"></div>
<div><input type="file" id="file" accept=".json,application/json">
<span class="hint">wheel: zoom, drag: pan, double-click: the whole run; hover a bar for its record</span></div>
<svg id="timeline" xmlns="http://www.w3.org/2000/svg"></svg>
<script type="application/json" id="trace">{{TRACE}}</script>
<script>
"use strict";
const COLORS = {{COLORS}};
const INSTANT_COLORS = {control: "#2a3f5f", epoch: "#72B7B2", checkpoint: "#B279A2", "worker-lost": "#E45756",
                        stage: "#506784"};
const LABEL = 200, RIGHT = 16, AXIS = 30, HEADER = 20, ROW = 20, INSET = 4;
const svg = document.getElementById("timeline");
let view = null;  // the loaded trace: rows, spans, flows, instants, the whole time range and the window shown

function esc(s) {
  return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}

function seconds(us) {
  const s = us / 1e6;
  return Math.abs(s) >= 1 ? s.toFixed(3) + " s" : (s * 1e3).toFixed(3) + " ms";
}

// the trace's events -> rows (one per thread, under its process), spans with their nesting depth, flows, instants
function load(trace) {
  const events = Array.isArray(trace) ? trace : trace.traceEvents;
  const procs = new Map(), threads = new Map(), spans = [], flows = new Map(), instants = [];
  const proc = pid => procs.get(pid) || procs.set(pid, {pid, name: "process " + pid, sort: pid}).get(pid);
  const thread = (pid, tid) => {
    const key = pid + ":" + tid;
    if (!threads.has(key)) threads.set(key, {pid, tid, name: "thread " + tid, sort: tid, spans: []});
    proc(pid);
    return threads.get(key);
  };
  for (const e of events) {
    if (e.ph === "M") {
      if (e.name === "process_name") proc(e.pid).name = e.args.name;
      else if (e.name === "process_sort_index") proc(e.pid).sort = e.args.sort_index;
      else if (e.name === "thread_name") thread(e.pid, e.tid).name = e.args.name;
      else if (e.name === "thread_sort_index") thread(e.pid, e.tid).sort = e.args.sort_index;
    } else if (e.ph === "X") {
      const s = {e, row: thread(e.pid, e.tid), depth: 0};
      s.row.spans.push(s);
      spans.push(s);
    } else if (e.ph === "s" || e.ph === "t" || e.ph === "f") {
      if (!flows.has(e.id)) flows.set(e.id, []);
      flows.get(e.id).push(e);
    } else if (e.ph === "i" || e.ph === "I") {
      instants.push(e);
    }
  }
  const order = [...procs.values()].sort((a, b) => a.sort - b.sort || a.pid - b.pid);
  const rows = [];
  let y = AXIS;
  for (const p of order) {
    p.y = y;
    y += HEADER;
    const mine = [...threads.values()].filter(t => t.pid === p.pid);
    mine.sort((a, b) => a.sort - b.sort || a.tid - b.tid);
    for (const t of mine) {
      // nesting: a span inside the one before it on its thread is drawn one inset deeper
      t.spans.sort((a, b) => a.e.ts - b.e.ts || b.e.dur - a.e.dur);
      const open = [];
      let deepest = 0;
      for (const s of t.spans) {
        while (open.length && open[open.length - 1] <= s.e.ts) open.pop();
        s.depth = open.length;
        deepest = Math.max(deepest, s.depth);
        open.push(s.e.ts + s.e.dur);
      }
      t.index = rows.length;
      t.y = y;
      t.height = ROW + 2 * INSET * deepest;
      y += t.height + 2;
      rows.push(t);
    }
    p.bottom = y;
  }
  const times = spans.map(s => s.e.ts).concat(spans.map(s => s.e.ts + s.e.dur), instants.map(e => e.ts));
  const t0 = times.length ? Math.min(...times) : 0, t1 = times.length ? Math.max(...times) : 1;
  view = {trace, rows, procs: order, spans, flows: [...flows.values()], instants, t0, t1: Math.max(t1, t0 + 1),
          from: t0, to: Math.max(t1, t0 + 1), height: y + 8, threads};
  summary();
  draw();
}

function summary() {
  const other = view.trace.otherData || {}, cfg = other.config || {};
  const parts = [];
  if (cfg.policy) parts.push(`policy ${cfg.policy}`);
  if (cfg.stages) parts.push(`${cfg.stages} stages x ${cfg.pipelines} pipelines`);
  if (typeof other.simulated === "boolean") parts.push(other.simulated ? "simulated" : "real run");
  parts.push(`${view.rows.length} tracks, ${view.spans.length} spans, ${view.flows.length} rounds linked, ` +
             `${view.instants.length} instants over ${seconds(view.t1 - view.t0)}`);
  document.getElementById("summary").textContent = parts.join(" · ");
  const counts = {};
  for (const s of view.spans) counts[s.e.cat] = (counts[s.e.cat] || 0) + 1;
  const known = Object.keys(COLORS).filter(c => c in counts);
  const swatch = c => `background:${COLORS[c] || "#999"}` + (c === "background" ? ";opacity:0.55" : "") +
    (c === "paused" ? ";background-image:repeating-linear-gradient(45deg,#fff 0 2px,transparent 2px 5px)" : "");
  document.getElementById("legend").innerHTML =
    known.concat(Object.keys(counts).filter(c => !(c in COLORS)).sort()).map(c =>
      `<span data-cat="${esc(c)}"><i style="${swatch(c)}"></i>${esc(c)} (${counts[c]})</span>`).join("") +
    `<span><i style="background:#E45756;height:2px;vertical-align:3px"></i>a round: decision and members</span>`;
}

function ticks(from, to, width) {
  const raw = (to - from) / Math.max(2, width / 110), mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const digits = Math.max(0, 6 - Math.floor(Math.log10(step)));  // of a second, for this step in microseconds
  const out = [];
  for (let t = Math.ceil(from / step) * step; t <= to; t += step) out.push([t, (t / 1e6).toFixed(digits) + " s"]);
  return out;
}

function draw() {
  const width = Math.max(600, document.body.clientWidth - 8), plot = width - LABEL - RIGHT;
  const scale = plot / (view.to - view.from), x = t => LABEL + (t - view.from) * scale;
  const out = [
    `<defs><clipPath id="plot"><rect x="${LABEL}" y="0" width="${plot}" height="${view.height}"/></clipPath>`,
    `<pattern id="hatch" width="5" height="5" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">`,
    `<rect width="5" height="5" fill="${COLORS.paused}"/><rect width="2" height="5" fill="#fff"/></pattern>`,
    `<marker id="dot" viewBox="0 0 6 6" refX="3" refY="3" markerWidth="5" markerHeight="5">`,
    `<circle cx="3" cy="3" r="2.5" fill="#E45756"/></marker></defs>`];
  for (const [t, text] of ticks(view.from, view.to, plot)) {
    out.push(`<line x1="${x(t)}" x2="${x(t)}" y1="${AXIS - 4}" y2="${view.height}" stroke="#E5ECF6"/>`);
    if (x(t) + 7 * text.length < width) out.push(`<text class="tick" x="${x(t) + 2}" y="${AXIS - 8}">${text}</text>`);
  }
  for (const p of view.procs) {
    out.push(`<rect x="0" y="${p.y}" width="${width}" height="${HEADER - 2}" fill="#E5ECF6"/>`,
             `<text class="process-label" x="4" y="${p.y + 13}">${esc(p.name)}</text>`);
  }
  for (const r of view.rows) {
    const shade = r.index % 2 ? "#FAFBFD" : "#F3F6FA";
    out.push(`<rect x="${LABEL}" y="${r.y}" width="${plot}" height="${r.height}" fill="${shade}"/>`,
             `<text class="row-label" data-row="${r.index}" x="14" y="${r.y + 14}">${esc(r.name)}</text>`);
  }
  out.push(`<g clip-path="url(#plot)">`);
  let drawn = 0;
  for (const s of view.spans) {
    const e = s.e;
    if (e.ts + e.dur < view.from || e.ts > view.to) continue;
    const left = x(e.ts), w = Math.max(e.dur * scale, 0.8), y = s.row.y + INSET * s.depth;
    const h = s.row.height - 2 * INSET * s.depth;
    const fill = e.cat === "paused" ? "url(#hatch)" : (COLORS[e.cat] || "#999");
    const faint = e.cat === "background" ? ' fill-opacity="0.55"' : "";
    const args = Object.entries(e.args || {}).map(([k, v]) => `${k} ${JSON.stringify(v)}`).join("\n");
    const title = `${e.name} (${e.cat}) ${seconds(e.dur)} from ${seconds(e.ts)}\n${args}`;
    out.push(`<rect class="span" data-row="${s.row.index}" data-cat="${esc(e.cat)}" x="${left}" y="${y}" ` +
             `width="${w}" height="${h}" fill="${fill}"${faint}><title>${esc(title)}</title></rect>`);
    if (w > 7 * e.name.length + 6) {
      out.push(`<text class="span-text" x="${left + 3}" y="${y + h / 2 + 3}">${esc(e.name)}</text>`);
    }
    drawn++;
  }
  const center = e => { const r = view.threads.get(e.pid + ":" + e.tid); return r ? r.y + r.height / 2 : null; };
  for (const f of view.flows) {
    const points = f.slice().sort((a, b) => a.ts - b.ts).filter(e => center(e) !== null);
    out.push(`<polyline class="flow" data-flow="${esc(f[0].id)}" ` +
             `points="${points.map(e => x(e.ts) + "," + center(e)).join(" ")}" ` +
             `marker-start="url(#dot)" marker-mid="url(#dot)" marker-end="url(#dot)">` +
             `<title>${esc(f[0].name)}</title></polyline>`);
  }
  for (const e of view.instants) {
    const at = x(e.ts), color = INSTANT_COLORS[e.cat] || "#2a3f5f";
    const title = `<title>${esc(e.name)} at ${seconds(e.ts)}</title>`;
    const near_end = at > LABEL + plot - 80;  // its name left of the mark, inside the plot
    const mark = (y0, y1, dash, label) =>
      `<g class="instant" data-scope="${e.s}"><line x1="${at}" x2="${at}" y1="${y0}" y2="${y1}" stroke="${color}" ` +
      `stroke-width="1.5"${dash ? ' stroke-dasharray="4 3"' : ""}/><text class="instant-text" ` +
      `x="${near_end ? at - 3 : at + 3}" y="${label}" fill="${color}"${near_end ? ' text-anchor="end"' : ""}>` +
      `${esc(e.name)}</text>${title}</g>`;
    if (e.s === "g") {
      out.push(mark(AXIS, view.height, true, AXIS + 10));
    } else if (e.s === "p") {
      const p = view.procs.find(p => p.pid === e.pid);
      out.push(mark(p.y, p.bottom, false, p.y + 13));
    } else {
      const r = view.threads.get(e.pid + ":" + e.tid);
      out.push(`<g class="instant" data-scope="t"><path d="M${at - 4},${r.y} L${at + 4},${r.y} L${at},${r.y + 7} Z" ` +
               `fill="${color}"/>${title}</g>`);
    }
  }
  out.push(`</g>`);
  svg.setAttribute("width", width);
  svg.setAttribute("height", view.height);
  svg.innerHTML = out.join("");
  svg.dataset.drawn = drawn;
}

// zoom around the pointer, pan by dragging, the whole run on a double-click
svg.addEventListener("wheel", ev => {
  ev.preventDefault();
  const box = svg.getBoundingClientRect(), plot = box.width - LABEL - RIGHT;
  const at = view.from + (ev.clientX - box.left - LABEL) / plot * (view.to - view.from);
  const k = Math.exp(ev.deltaY * 0.002);
  view.from = at - (at - view.from) * k;
  view.to = at + (view.to - at) * k;
  requestAnimationFrame(draw);
}, {passive: false});
let dragging = null;
svg.addEventListener("mousedown", ev => { dragging = {x: ev.clientX, from: view.from, to: view.to}; });
window.addEventListener("mouseup", () => { dragging = null; });
window.addEventListener("mousemove", ev => {
  if (!dragging) return;
  const plot = svg.getBoundingClientRect().width - LABEL - RIGHT;
  const dt = (ev.clientX - dragging.x) / plot * (dragging.to - dragging.from);
  view.from = dragging.from - dt;
  view.to = dragging.to - dt;
  requestAnimationFrame(draw);
});
svg.addEventListener("dblclick", () => { view.from = view.t0; view.to = view.t1; draw(); });
window.addEventListener("resize", () => requestAnimationFrame(draw));
document.getElementById("file").addEventListener("change", ev => {
  const file = ev.target.files[0];
  if (file) file.text().then(text => load(JSON.parse(text)));
});
load(JSON.parse(document.getElementById("trace").textContent));
</script>
</body>
</html>
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a trace written by run.export_trace(path)")
    parser.add_argument("-o", "--out", type=Path, help="the page to write (default: the trace's name, .html)")
    args = parser.parse_args(argv)
    out = args.out or args.trace.with_suffix(".html")
    out.write_text(page(json.loads(args.trace.read_text()), title=f"sdpipe trace: {args.trace.name}"))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
