// asyncgraph ui: the dashboard of job runs. Self-contained (no library, no CDN); reads
// the local JSON API of `asyncgraph ui` (see asyncgraph/jobs/_ui.py) and polls it, so a
// running job's charts, parameters and calls update live. Text from the runs is only
// ever put in the page as text nodes, never as HTML.
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#be185d"];
const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const METRICS = [
  { key: "train_loss", title: "training loss" },
  { key: "train_score", title: "training accuracy" },
  { key: "val_score", title: "validation score", initial: true },
  { key: "tokens", title: "tokens (cumulative)" },
  { key: "cost_usd", title: "cost in US dollars (cumulative)", unknown: "unpriced_calls" },
];

const state = { runs: [], data: [], step: null, follow: true, text: "", cache: new Map() };
// ?step=N opens that step (and stops following the latest one).
const asked = new URLSearchParams(location.search).get("step");
if (asked !== null && /^\d+$/.test(asked)) {
  state.step = Number(asked);
  state.follow = false;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

function color(i) {
  return COLORS[i % COLORS.length];
}

function fmt(value, key) {
  if (value === null || value === undefined || Number.isNaN(value)) return "-";
  if (key === "tokens") return Math.round(value).toLocaleString("en-US");
  if (key === "cost_usd") return value === 0 ? "$0" : "$" + value.toFixed(value < 1 ? 4 : 2);
  return Number(value).toFixed(Math.abs(value) >= 100 ? 0 : 2);
}

// -- data ----------------------------------------------------------------------------------

async function refresh() {
  const runs = (await getJSON("/api/runs")).runs;
  const data = await Promise.all(runs.map((_, i) => getJSON(`/api/run/${i}`)));
  const text = JSON.stringify(data);
  if (text === state.text) return;
  state.text = text;
  state.runs = runs;
  state.data = data;
  const steps = allSteps();
  if (state.follow || state.step === null || !steps.includes(state.step)) {
    state.step = steps.length ? steps[steps.length - 1] : 0;
  }
  await render();
}

function allSteps() {
  const steps = new Set();
  for (const run of state.data) {
    for (const row of run.history) steps.add(row.step);
    for (const s of run.steps) steps.add(s.step);
  }
  return [...steps].sort((a, b) => a - b);
}

async function cached(key, load) {
  if (!state.cache.has(key)) state.cache.set(key, load());
  try {
    return await state.cache.get(key);
  } catch (error) {
    state.cache.delete(key);
    throw error;
  }
}

// -- rendering -----------------------------------------------------------------------------

async function render() {
  renderRuns();
  renderCharts();
  renderStepPicker();
  await renderColumns();
  const status = document.getElementById("status");
  status.textContent = `updated ${new Date().toLocaleTimeString()} · polling every ${POLL_MS / 1000}s`;
  document.body.dataset.ready = "1";
  document.body.dataset.step = String(state.step);
}

function renderRuns() {
  const box = document.getElementById("runs");
  box.replaceChildren(
    ...state.data.map((run, i) => {
      const total = run.total_steps ? `/${run.total_steps}` : "";
      const live = run.total_steps && run.steps_done < run.total_steps ? "running or stopped" : null;
      return el(
        "span",
        { class: "run-chip", title: run.dir },
        el("span", { class: "swatch", style: `background:${color(i)}` }),
        `${run.name} · step ${run.steps_done}${total}`,
        live && el("span", { class: "live" }, live)
      );
    })
  );
}

function renderCharts() {
  const box = document.getElementById("metrics");
  box.replaceChildren(...METRICS.map((metric) => chartCard(metric)));
}

function chartCard(metric) {
  const W = 420, H = 190, L = 48, R = 10, T = 10, B = 26;
  const series = state.data.map((run, i) => {
    const points = [];
    if (metric.initial && typeof run.initial_val_score === "number") {
      points.push([0, run.initial_val_score]);
    }
    for (const row of run.history) {
      const v = row[metric.key];
      if (typeof v === "number" && Number.isFinite(v)) points.push([row.step, v]);
    }
    const last = run.history[run.history.length - 1];
    const unknown = metric.unknown && last ? last[metric.unknown] || 0 : 0;
    return { i, points, unknown, name: run.name };
  });
  const all = series.flatMap((s) => s.points);
  const xMax = Math.max(1, ...all.map((p) => p[0]));
  let yMin = Math.min(...all.map((p) => p[1]));
  let yMax = Math.max(...all.map((p) => p[1]));
  if (!all.length) { yMin = 0; yMax = 1; }
  if (yMin === yMax) { yMin -= 0.5; yMax += 0.5; }
  if (metric.key === "train_loss" && yMin >= 0) yMin = 0;
  if (metric.key === "train_score" || metric.key === "val_score") { yMin = Math.min(0, yMin); yMax = Math.max(1, yMax); }
  if (metric.key === "tokens" || metric.key === "cost_usd") {
    yMin = 0;
    if (yMax <= 0) yMax = 1;
  }
  const x = (s) => L + (s / xMax) * (W - L - R);
  const y = (v) => T + (1 - (v - yMin) / (yMax - yMin)) * (H - T - B);
  const chart = svg("svg", { class: "chart", "data-metric": metric.key, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": metric.title });
  chart.append(
    svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B })
  );
  for (const v of [yMin, (yMin + yMax) / 2, yMax]) {
    chart.append(svg("text", { x: L - 4, y: y(v) + 3, "text-anchor": "end" }, fmt(v, metric.key)));
  }
  const ticks = xMax <= 12 ? [...Array(xMax + 1).keys()] : [0, Math.round(xMax / 2), xMax];
  for (const s of ticks) {
    chart.append(svg("text", { x: x(s), y: H - B + 14, "text-anchor": "middle" }, s));
  }
  chart.append(svg("text", { x: W - R, y: H - 2, "text-anchor": "end" }, "step"));
  if (state.step !== null) {
    chart.append(svg("line", { class: "selected", x1: x(state.step), y1: T, x2: x(state.step), y2: H - B }));
  }
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, k) => `${k ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
    // Earlier runs drawn wider, so a run that retraces another one leaves it visible.
    const width = Math.max(1.5, 4 - 1.2 * s.i);
    chart.append(svg("path", { class: "series" + (s.unknown ? " unknown" : ""), "data-run": s.i, d, stroke: color(s.i), "stroke-width": width }));
    for (const p of s.points) {
      chart.append(
        svg("circle", { cx: x(p[0]).toFixed(1), cy: y(p[1]).toFixed(1), r: 2.5, fill: color(s.i) },
          svg("title", {}, `${s.name}, step ${p[0]}: ${fmt(p[1], metric.key)}`))
      );
    }
  }
  const notes = series.filter((s) => s.unknown).map((s) => `${s.name}: cost unknown for ${s.unknown} call(s) of models without a price (dashed: the priced part)`);
  const legend = el("div", { class: "legend" }, series.map((s) => el("span", { style: `--c:${color(s.i)}` }, s.name)));
  return el("div", { class: "card" }, el("h3", {}, metric.title), chart, legend, notes.map((n) => el("div", { class: "note" }, n)));
}

function renderStepPicker() {
  const select = document.getElementById("step");
  const steps = allSteps();
  select.replaceChildren(...steps.map((s) => el("option", { value: s, selected: s === state.step }, s === 0 ? "0 (start)" : s)));
  document.getElementById("follow").checked = state.follow;
}

async function renderColumns() {
  const box = document.getElementById("columns");
  const columns = state.data.map((run, i) => column(run, i));
  box.replaceChildren(...columns.map((c) => c.node));
  await Promise.all(columns.map((c) => c.loaded));
}

function column(run, i) {
  const step = state.step;
  const loaded = [];
  const node = el(
    "div",
    { class: "column", "data-run": i },
    el("h2", { title: run.dir }, el("span", { class: "swatch", style: `background:${color(i)}` }), run.name),
    run.parameters.length
      ? run.parameters.map((p) => parameterCard(p, step))
      : el("p", { class: "empty" }, "no parameter values recorded yet (steps.jsonl)")
  );
  const timeline = el("div", { class: "card timeline-card" }, el("h3", {}, `timeline of step ${step}`));
  const calls = el("div", { class: "card calls-card" }, el("h3", {}, `model calls of step ${step}`));
  node.append(timeline, calls);
  loaded.push(fillTimeline(timeline, run, i, step), fillCalls(calls, run, i, step));
  return { node, loaded: Promise.all(loaded) };
}

function recordAt(param, step) {
  let found = null;
  for (const record of param.steps) if (record.step <= step) found = record;
  return found;
}

function parameterCard(param, step) {
  const record = recordAt(param, step);
  const title = param.name ? `${param.name}: ${param.role || "parameter"}` : param.role || "parameter";
  const card = el("div", { class: "card param" }, el("h3", {}, title));
  if (!record) {
    card.append(el("p", { class: "empty" }, `no value recorded at step ${step}`));
    return card;
  }
  const label = record.step === step ? `value after step ${step}` : `value at step ${record.step} (latest recorded)`;
  card.append(el("div", { class: "role" }, label + (record.diff ? ", changes against the step before" : "")));
  const diff = el("div", { class: "diff" });
  if (record.diff) {
    for (const [op, text] of record.diff) {
      diff.append(op === "+" ? el("ins", {}, text) : op === "-" ? el("del", {}, text) : document.createTextNode(text));
    }
  } else {
    diff.append(document.createTextNode(record.value));
  }
  card.append(diff);
  const feedback = el("div", { class: "feedback" });
  if (record.step === step && step > 0) {
    const entries = Array.isArray(record.feedback) ? record.feedback : record.feedback == null ? [] : [record.feedback];
    const shown = entries.map((e) => (typeof e === "string" ? e : JSON.stringify(e))).filter((e) => e.trim());
    feedback.append(
      el("div", { class: "role" }, `feedback received in step ${step}: ${shown.length} entr${shown.length === 1 ? "y" : "ies"}`),
      shown.length ? el("ol", {}, shown.map((t) => el("li", {}, t))) : el("p", { class: "empty" }, "none")
    );
  }
  card.append(feedback);
  card.append(
    el("div", { class: "changes", "aria-label": "steps" },
      param.steps.map((r) =>
        el("button", {
          type: "button",
          class: (r.changed ? "changed" : "") + (r.step === record.step ? " current" : ""),
          title: r.changed ? `changed in step ${r.step}` : `unchanged in step ${r.step}`,
          onclick: () => selectStep(r.step),
        }, r.step)
      )
    )
  );
  return card;
}

async function fillTimeline(card, run, i, step) {
  const info = run.steps.find((s) => s.step === step);
  if (!info || !info.trace) {
    card.append(el("p", { class: "empty" }, run.traces.length ? `no trace for step ${step}` : "no traces: run the job with --trace"));
    return;
  }
  try {
    const trace = await cached(`trace/${i}/${step}/${info.time}`, () => getJSON(`/api/run/${i}/trace/${step}`));
    card.append(drawTimeline(trace));
  } catch (error) {
    card.append(el("p", { class: "empty" }, String(error)));
  }
}

function drawTimeline(trace) {
  const events = trace.traceEvents.filter((e) => e.ph === "X");
  const names = new Map();
  for (const e of trace.traceEvents) if (e.ph === "M" && e.name === "thread_name") names.set(`${e.pid}:${e.tid}`, e.args.name);
  const rows = [...new Set(events.map((e) => `${e.pid}:${e.tid}`))].sort((a, b) => {
    const [pa, ta] = a.split(":").map(Number), [pb, tb] = b.split(":").map(Number);
    return pa - pb || ta - tb;
  });
  const t0 = Math.min(...events.map((e) => e.ts));
  const t1 = Math.max(...events.map((e) => e.ts + e.dur));
  const W = 640, ROW = 14, LABEL = 52, AXIS = 18;
  const H = rows.length * ROW + AXIS + 4;
  const scale = (W - LABEL - 8) / Math.max(1, t1 - t0);
  const root = svg("svg", { class: "timeline", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "timeline" });
  rows.forEach((row, r) => {
    root.append(svg("text", { class: "rowlabel", x: 2, y: r * ROW + 11 }, names.get(row) || row));
  });
  // Depth of each span in its row: a model call nested in its node is drawn inside it.
  const depth = new Map();
  const open = new Map();
  for (const e of [...events].sort((a, b) => a.ts - b.ts || b.dur - a.dur)) {
    const key = `${e.pid}:${e.tid}`;
    const stack = open.get(key) || [];
    while (stack.length && stack[stack.length - 1] <= e.ts) stack.pop();
    depth.set(e, stack.length);
    stack.push(e.ts + e.dur);
    open.set(key, stack);
  }
  for (const e of events) {
    const r = rows.indexOf(`${e.pid}:${e.tid}`);
    const inset = Math.min(depth.get(e), 2) * 4;
    const x = LABEL + (e.ts - t0) * scale;
    const w = Math.max(1, e.dur * scale);
    const status = e.args && e.args.status ? ` ${e.args.status}` : "";
    const details = Object.entries(e.args || {})
      .filter(([k]) => !["inputs", "outputs", "seq", "node_seq", "labels"].includes(k))
      .map(([k, v]) => `${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join("\n");
    root.append(
      svg("rect", { class: `span ${e.cat}${status}`, x: x.toFixed(1), y: r * ROW + 2 + inset, width: w.toFixed(1), height: ROW - 3 - inset, rx: 2 },
        svg("title", {}, `${e.name} (${(e.dur / 1000).toFixed(1)} ms)\n${details}`))
    );
    if (w > 46 && !inset) root.append(svg("text", { x: (x + 3).toFixed(1), y: r * ROW + 11 }, e.name.slice(0, Math.floor(w / 5.5))));
  }
  const span = (t1 - t0) / 1000;
  for (const f of [0, 0.25, 0.5, 0.75, 1]) {
    root.append(svg("text", { class: "rowlabel", x: (LABEL + f * (W - LABEL - 8)).toFixed(1), y: H - 4, "text-anchor": f === 0 ? "start" : f === 1 ? "end" : "middle" }, `${(f * span).toFixed(0)} ms`));
  }
  const note = el("div", { class: "legend" },
    el("span", { style: "--c:#93c5fd" }, "node backward"),
    el("span", { style: "--c:#fdba74" }, "model call"),
    el("span", { style: "--c:#e5e7eb" }, "phase"),
    `${events.length} spans on ${rows.length} rows; open the file in ui.perfetto.dev for more`);
  return el("div", {}, root, note);
}

async function fillCalls(card, run, i, step) {
  if (!run.call_log) {
    card.append(el("p", { class: "empty" }, "no call log: run the job with --log-calls PATH"));
    return;
  }
  let calls;
  try {
    const info = run.steps.find((s) => s.step === step);
    const version = info ? info.time : run.steps_done;
    calls = (await cached(`calls/${i}/${step}/${version}`, () => getJSON(`/api/run/${i}/calls/${step}`))).calls;
  } catch (error) {
    card.append(el("p", { class: "empty" }, String(error)));
    return;
  }
  if (!calls.length) {
    card.append(el("p", { class: "empty" }, `no model calls logged in step ${step}`));
    return;
  }
  const tokens = calls.reduce((n, c) => n + (c.prompt_tokens || 0) + (c.completion_tokens || 0), 0);
  card.append(el("div", { class: "note" }, `${calls.length} calls, ${tokens.toLocaleString("en-US")} tokens; click a row for the request and reply`));
  const body = el("tbody");
  calls.forEach((c, k) => {
    const messages = c.request && (c.request.messages || (c.request.body && c.request.body.messages)) || [];
    const last = messages.length ? String(messages[messages.length - 1].content || "") : "";
    const detail = el("tr", { class: "detail", hidden: true },
      el("td", { colspan: 9 },
        el("div", { class: "role" }, "request"), el("pre", {}, JSON.stringify(c.request, null, 1)),
        el("div", { class: "role" }, c.error ? "error" : "reply"), el("pre", {}, c.error || c.reply || "")));
    const row = el("tr", { class: "call", onclick: () => { detail.hidden = !detail.hidden; } },
      el("td", { class: "num" }, k + 1),
      el("td", {}, (c.labels && c.labels.phase) || ""),
      el("td", {}, c.node ? c.node.function : "-"),
      el("td", {}, c.model),
      el("td", { class: "num" }, `${c.prompt_tokens}/${c.completion_tokens}`),
      el("td", { class: "num" }, Math.round((c.latency_s || 0) * 1000)),
      el("td", {}, c.cached ? "yes" : ""),
      el("td", { class: "num" }, c.retries || ""),
      el("td", { class: "excerpt" }, (c.error || c.reply || "").slice(0, 80) || last.slice(0, 80)));
    body.append(row, detail);
  });
  card.append(el("table", { class: "calls" },
    el("thead", {}, el("tr", {}, ["#", "phase", "node", "model", "tokens in/out", "ms", "cached", "retries", "reply"].map((h) => el("th", {}, h)))),
    body));
}

function selectStep(step) {
  const steps = allSteps();
  state.step = step;
  state.follow = step === steps[steps.length - 1];
  render().catch(showError);
}

function showError(error) {
  document.getElementById("status").textContent = `error: ${error.message || error} (retrying)`;
}

async function poll() {
  try {
    await refresh();
  } catch (error) {
    showError(error);
  }
  setTimeout(poll, POLL_MS);
}

document.getElementById("step").addEventListener("change", (e) => selectStep(Number(e.target.value)));
document.getElementById("prev-step").addEventListener("click", () => {
  const steps = allSteps();
  const k = steps.indexOf(state.step);
  if (k > 0) selectStep(steps[k - 1]);
});
document.getElementById("next-step").addEventListener("click", () => {
  const steps = allSteps();
  const k = steps.indexOf(state.step);
  if (k >= 0 && k < steps.length - 1) selectStep(steps[k + 1]);
});
document.getElementById("follow").addEventListener("change", (e) => {
  state.follow = e.target.checked;
  if (state.follow) {
    const steps = allSteps();
    selectStep(steps[steps.length - 1]);
  }
});
poll();
