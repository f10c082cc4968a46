// asyncgraph ui: the dashboard of job runs. Self-contained (no library, no CDN); reads
// the local JSON API of `asyncgraph ui` (see asyncgraph/jobs/_ui.py) and polls it, so a
// running job's charts, parameters and calls update live. Text from the runs is only
// ever put in the page as text nodes, never as HTML.
//
// Charts and timelines are drawn at the pixel width of their card (redrawn when the
// window is resized), so their text is the size the stylesheet says, never scaled down.
// After each render the page checks its own layout: <body data-overflow="..."> lists the
// elements wider than their box or than the window, and data-small-text the chart texts
// drawn under MIN_TEXT_PX (both empty when the page is right; the tests read them).
//
// Runs of different lengths: the step chosen (by default the latest of any run) is shown
// by each run that has it; a run that ends before it shows its own latest step instead,
// and every card of its column (parameters, timeline, calls) shows that same step
// (runStep). The step picker says which steps each run has.
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#be185d"];
const POLL_MS = 2000;
const MIN_TEXT_PX = 10.5;
const TEXT_PX = 11; // chart and timeline text, as in app.css
const SVG = "http://www.w3.org/2000/svg";
const METRICS = [
  { key: "train_loss", title: "training loss" },
  { key: "train_score", title: "training accuracy" },
  { key: "val_score", title: "validation score", initial: true },
  { key: "tokens", title: "tokens (cumulative)" },
  { key: "cost_usd", title: "cost in US dollars (cumulative)", unknown: "unpriced_calls" },
];

const state = { runs: [], data: [], step: null, follow: true, text: "", cache: new Map() };
// The token the URL carried is in a cookie now: out of the address bar and the history.
const query = new URLSearchParams(location.search);
if (query.has("token")) {
  query.delete("token");
  const rest = query.toString();
  history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + location.hash);
}
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
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}: ${await response.text()}`);
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

// The steps one run recorded, ascending (the API's recorded_steps).
function stepsOf(run) {
  return run.recorded_steps || [];
}

function allSteps() {
  const steps = new Set();
  for (const run of state.data) for (const s of stepsOf(run)) steps.add(s);
  return [...steps].sort((a, b) => a - b);
}

// The step a run's column shows: the step chosen when the run has it, else the run's
// latest step before it (a run that ended earlier shows its last step).
function runStep(run) {
  const steps = stepsOf(run);
  let shown = null;
  for (const s of steps) if (s <= state.step) shown = s;
  return shown === null ? (steps.length ? steps[0] : state.step) : shown;
}

// "steps 0 to 4", "steps 0 to 2, 5", "step 0", "no step yet".
function stepRanges(steps) {
  if (!steps.length) return "no step yet";
  const parts = [];
  for (let k = 0; k < steps.length; ) {
    let j = k;
    while (j + 1 < steps.length && steps[j + 1] === steps[j] + 1) j++;
    parts.push(j === k ? `${steps[k]}` : `${steps[k]} to ${steps[j]}`);
    k = j + 1;
  }
  return (steps.length === 1 ? "step " : "steps ") + parts.join(", ");
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
  const layout = checkLayout();
  document.body.dataset.overflow = layout.overflow.join(" ");
  document.body.dataset.smallText = layout.smallText.join(" ");
  document.body.dataset.ready = "1";
  document.body.dataset.step = String(state.step);
}

// A run is named by its label (its directory, unique among the runs shown) with its job's
// name beside it: runs of one job differ by directory, not by name.
function runName(run, i) {
  return [
    el("span", { class: "swatch", style: `background:${color(i)}` }),
    el("span", { class: "label" }, run.label),
    run.name && run.name !== run.label ? el("span", { class: "job" }, run.name) : null,
  ];
}

function runText(run) {
  return run.name && run.name !== run.label ? `${run.label} (${run.name})` : run.label;
}

// Dollars with the digits that matter: a cap of $0.00001 is not "$0.0000".
function money(value) {
  if (value === 0) return "$0";
  return "$" + (value >= 1 ? value.toFixed(2) : String(Number(value.toPrecision(3))));
}

const STOPPED = { cost_cap: "stopped at the cost cap", interrupted: "interrupted", patience: "stopped early (patience)" };

// A run's chip: its progress, why it stopped (when steps.jsonl says), where its forwards
// ran, what it spent against its cap (only when it had one), and the model calls replayed
// from their task's journal after a worker crashed (only when there were some).
function renderRuns() {
  const box = document.getElementById("runs");
  box.replaceChildren(
    ...state.data.map((run, i) => {
      const total = run.total_steps ? `/${run.total_steps}` : "";
      const unfinished = run.total_steps && run.steps_done < run.total_steps;
      const live = STOPPED[run.stopped] || (unfinished ? "running or stopped" : null);
      const spent = run.max_cost_usd == null ? null
        : `spent ${run.cost_usd == null ? "?" : (run.cut_calls > 0 ? "at most " : "") + money(run.cost_usd)} of the ${money(run.max_cost_usd)} cap`;
      const replayed = run.replayed_calls > 0
        ? `${run.replayed_calls} model call${run.replayed_calls === 1 ? "" : "s"} replayed from the journal` : null;
      return el(
        "span",
        { class: "run-chip", title: run.dir, "data-run": i },
        runName(run, i),
        el("span", { class: "progress" }, `step ${run.steps_done}${total}`),
        run.forward_on === "workers" ? el("span", { class: "live" }, "forwards on the workers") : null,
        spent && el("span", { class: "spent" }, spent),
        replayed && el("span", { class: "replayed", title: "not paid again: a rerun task replayed the calls that had finished" }, replayed),
        live && el("span", { class: run.stopped === "cost_cap" ? "live capped" : "live" }, live)
      );
    })
  );
}

function renderCharts() {
  const box = document.getElementById("metrics");
  const cards = METRICS.map((metric) => {
    const holder = el("div", { class: "chart-box" });
    return { metric, holder, card: el("div", { class: "card" }, el("h3", {}, metric.title), holder) };
  });
  box.replaceChildren(...cards.map((c) => c.card));
  for (const c of cards) c.holder.append(...chartParts(c.metric, widthOf(c.holder, 250)));
}

// The width in CSS pixels that a drawing placed in `node` gets (`fallback` when it is not
// laid out, e.g. a column replaced by a newer render while its trace was loading).
function widthOf(node, fallback) {
  return Math.floor(node.clientWidth) || fallback;
}

// Roughly how wide `text` is at `px` (an average glyph of the sans-serif fonts), to size
// margins before anything is laid out; labels are then fitted exactly (fitLabel).
function textWidth(text, px) {
  return String(text).length * px * 0.62;
}

function chartParts(metric, W) {
  const H = 180, R = 12, T = 10, B = 34;
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
    return { i, points, unknown, run, name: runText(run) };
  });
  const all = series.flatMap((s) => s.points);
  // Nothing to draw (no step ended yet): said, not an empty chart with made-up ticks.
  if (!all.length) return [el("p", { class: "empty no-data", "data-metric": metric.key }, "nothing recorded yet")];
  const xMax = Math.max(1, ...all.map((p) => p[0]));
  let yMin = Math.min(...all.map((p) => p[1]));
  let yMax = Math.max(...all.map((p) => p[1]));
  if (yMin === yMax) { yMin -= 0.5; yMax += 0.5; }
  if (metric.key === "train_loss" && yMin >= 0) yMin = 0;
  if (metric.key === "train_score" || metric.key === "val_score") { yMin = Math.min(0, yMin); yMax = Math.max(1, yMax); }
  if (metric.key === "tokens" || metric.key === "cost_usd") {
    yMin = 0;
    if (yMax <= 0) yMax = 1;
  }
  // Whole ticks for a count: its middle one too (not 0, 1, 1 for a top of 1).
  if (metric.key === "tokens") yMax = Math.max(2, 2 * Math.ceil(yMax / 2));
  const yTicks = [yMin, (yMin + yMax) / 2, yMax];
  const L = 10 + Math.max(...yTicks.map((v) => textWidth(fmt(v, metric.key), TEXT_PX)));
  const x = (s) => L + (s / xMax) * (W - L - R);
  const y = (v) => T + (1 - (v - yMin) / (yMax - yMin)) * (H - T - B);
  const chart = svg("svg", { class: "chart", "data-metric": metric.key, width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": metric.title });
  chart.append(
    svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B })
  );
  for (const v of yTicks) {
    chart.append(svg("text", { x: L - 5, y: y(v) + 4, "text-anchor": "end" }, fmt(v, metric.key)));
  }
  // As many step ticks as fit with their numbers apart.
  const room = (W - L - R) / (textWidth(xMax, TEXT_PX) + 8);
  const every = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000].find((n) => xMax / n <= room) || Math.ceil(xMax / room);
  for (let s = 0; s <= xMax; s += every) {
    chart.append(svg("text", { x: x(s), y: H - B + 15, "text-anchor": "middle" }, s));
  }
  chart.append(svg("text", { x: W - R, y: H - 3, "text-anchor": "end" }, "step"));
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
  const legend = el("div", { class: "legend runs" }, series.map((s) => el("span", { class: "entry", title: s.run.dir }, runName(s.run, s.i))));
  return [chart, legend, ...notes.map((n) => el("div", { class: "note" }, n))];
}

// The steps to choose from (those of every run; one that only some runs have says how
// many), and beside them which steps each run has, runs with the same ones together.
function renderStepPicker() {
  const select = document.getElementById("step");
  const steps = allSteps();
  const runs = state.data.length;
  select.replaceChildren(...steps.map((s) => {
    const having = state.data.filter((run) => stepsOf(run).includes(s)).length;
    const text = (s === 0 ? "0 (start)" : String(s)) + (having < runs ? ` (${having} of ${runs} runs)` : "");
    return el("option", { value: s, selected: s === state.step }, text);
  }));
  document.getElementById("follow").checked = state.follow;
  const groups = new Map();
  for (const run of state.data) {
    const text = stepRanges(stepsOf(run));
    groups.set(text, [...(groups.get(text) || []), run.label]);
  }
  const summary = groups.size === 1
    ? (runs > 1 ? `every run: ${[...groups.keys()][0]}` : [...groups.keys()][0] || "")
    : [...groups].map(([text, labels]) => `${labels.join(", ")}: ${text}`).join(" · ");
  document.getElementById("step-runs").textContent = summary;
}

async function renderColumns() {
  const box = document.getElementById("columns");
  const columns = state.data.map((run, i) => column(run, i));
  box.replaceChildren(...columns.map((c) => c.node));
  await Promise.all(columns.map((c) => c.loaded));
}

function column(run, i) {
  const step = runStep(run);
  const steps = stepsOf(run);
  const latest = steps.length && step === steps[steps.length - 1] ? ", its latest" : "";
  const loaded = [];
  const node = el(
    "div",
    { class: "column", "data-run": i, "data-step": step },
    el("h2", { title: run.dir }, runName(run, i)),
    step !== state.step
      ? el("p", { class: "step-note" }, `no step ${state.step} in this run (${stepRanges(steps)}): showing step ${step}${latest}`)
      : null,
    run.parameters.length
      ? run.parameters.map((p) => parameterCard(p, step))
      : el("p", { class: "empty" }, "no parameter values recorded yet (steps.jsonl)")
  );
  const skipped = skippedCard(run, step);
  if (skipped) node.append(skipped);
  const timeline = el("div", { class: "card timeline-card" }, el("h3", {}, `timeline of step ${step}`));
  const calls = el("div", { class: "card calls-card" }, el("h3", {}, `model calls of step ${step}`));
  node.append(timeline, calls);
  loaded.push(fillTimeline(timeline, run, i, step), fillCalls(calls, run, i, step));
  return { node, loaded: Promise.all(loaded) };
}

// What a step skipped because a model's reply could not be parsed: updates the optimizer
// could not read (the parameter kept its value) and examples whose verdict never fit its
// response_format (scored 0). From the step's history row; none: no card.
function skippedCard(run, step) {
  const row = run.history.find((h) => h.step === step);
  const updates = (row && row.skipped_updates) || [];
  const examples = (row && row.skipped_examples) || [];
  if (!updates.length && !examples.length) return null;
  const card = el("div", { class: "card skipped" }, el("h3", {}, `skipped in step ${step}`));
  for (const u of updates) {
    card.append(el("p", {}, `update of ${u.role || "a parameter"} skipped: no readable value in ${u.attempts} repl${u.attempts === 1 ? "y" : "ies"}${u.structured ? " (structured outputs)" : ""}; it kept its value. Last reply: ${u.reply}`));
  }
  for (const e of examples) {
    card.append(el("p", {}, `${e.phase || "training"} example ${e.example} scored 0: its reply never fit its response_format after ${e.attempts} attempt(s). Last reply: ${e.reply}`));
  }
  return card;
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
  const holder = el("div", { class: "timeline-box" });
  card.append(holder);
  try {
    const trace = await cached(`trace/${i}/${step}/${info.time}`, () => getJSON(`/api/run/${i}/trace/${step}`));
    drawTimeline(holder, trace);
  } catch (error) {
    card.append(el("p", { class: "empty" }, String(error)));
  }
}

// `text` fitted to `room` pixels as drawn in `node` (an SVG text in the page): whole when
// it fits, else its last words ("…Judge" for "DemoJudge": class names share prefixes
// more than endings), else its start elided with "…"; nothing when not even three
// characters fit. The full text stays in the bar's tooltip.
function fitLabel(node, text, room) {
  const fits = (candidate) => {
    node.textContent = candidate;
    return node.getComputedTextLength() <= room;
  };
  if (fits(text)) return true;
  const words = [...text.matchAll(/[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+/g)].map((m) => m.index).filter((k) => k > 0);
  for (const k of words) {
    if (text.length - k >= 3 && fits("…" + text.slice(k))) return true;
  }
  for (let n = Math.min(text.length - 1, Math.floor(room / (TEXT_PX * 0.5))); n >= 3; n--) {
    if (fits(text.slice(0, n) + "…")) return true;
  }
  node.remove();
  return false;
}

// A call's bar is labelled by its model ("model gpt-4o-mini" in the trace: the model).
function spanLabel(e) {
  if (e.cat === "model") return (e.args && e.args.model) || e.name.replace(/^model /, "");
  return e.name;
}

// The step's trace as one row per trace thread (the phases, then each lane of work). A row
// has an upper lane for node backwards and phases and, below it, a thinner lane for model
// calls, so a call sits under the node that made it and neither hides the other's name.
function drawTimeline(holder, trace) {
  const events = trace.traceEvents.filter((e) => e.ph === "X");
  const names = new Map();
  for (const e of trace.traceEvents) if (e.ph === "M" && e.name === "thread_name") names.set(`${e.pid}:${e.tid}`, e.args.name);
  const keyOf = (e) => `${e.pid}:${e.tid}`;
  const rows = [...new Set(events.map(keyOf))].sort((a, b) => {
    const [pa, ta] = a.split(":").map(Number), [pb, tb] = b.split(":").map(Number);
    return pa - pb || ta - tb;
  });
  const W = widthOf(holder, 600), UPPER = 16, LOWER = 13, GAP = 5, AXIS = 20, R = 8;
  const LABEL = 8 + Math.max(...rows.map((row) => textWidth(names.get(row) || row, TEXT_PX)));
  // Each row's lanes and their top: a row without calls (the phases) has no lower lane.
  const layout = new Map();
  let top = 2;
  for (const row of rows) {
    const own = events.filter((e) => keyOf(e) === row);
    const upper = own.some((e) => e.cat !== "model") ? UPPER : 0;
    const lower = own.some((e) => e.cat === "model") ? LOWER : 0;
    layout.set(row, { top, upper, lower });
    top += upper + (upper && lower ? 2 : 0) + lower + GAP;
  }
  const H = top + AXIS;
  const t0 = Math.min(...events.map((e) => e.ts));
  const t1 = Math.max(...events.map((e) => e.ts + e.dur));
  const scale = (W - LABEL - R) / Math.max(1, t1 - t0);
  const root = svg("svg", { class: "timeline", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "timeline" });
  holder.replaceChildren(root);
  for (const row of rows) {
    const { top, upper, lower } = layout.get(row);
    root.append(svg("text", { class: "rowlabel", x: 2, y: top + (upper + lower) / 2 + 4 }, names.get(row) || row));
  }
  // Depth of each span among the spans of its lane: a span nested in another one (a phase
  // in a phase) is drawn inset, inside it.
  const depth = new Map();
  const open = new Map();
  for (const e of [...events].sort((a, b) => a.ts - b.ts || b.dur - a.dur)) {
    const key = `${keyOf(e)}:${e.cat === "model"}`;
    const stack = open.get(key) || [];
    while (stack.length && stack[stack.length - 1] <= e.ts) stack.pop();
    depth.set(e, stack.length);
    stack.push(e.ts + e.dur);
    open.set(key, stack);
  }
  const labels = [];
  for (const e of events) {
    const { top, upper, lower } = layout.get(keyOf(e));
    const model = e.cat === "model";
    const laneTop = model ? top + upper + (upper ? 2 : 0) : top;
    const laneHeight = model ? lower : upper;
    const inset = Math.min(depth.get(e), 2) * 3;
    const x = LABEL + (e.ts - t0) * scale;
    const w = Math.max(1, e.dur * scale);
    const status = e.args && e.args.status ? ` ${e.args.status}` : "";
    const details = Object.entries(e.args || {})
      .filter(([k]) => !["inputs", "outputs", "seq", "node_seq", "labels"].includes(k))
      .map(([k, v]) => `${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join("\n");
    root.append(
      svg("rect", { class: `span ${e.cat}${status}`, x: x.toFixed(1), y: laneTop + inset, width: w.toFixed(1), height: laneHeight - inset, rx: 2 },
        svg("title", {}, `${e.name} (${(e.dur / 1000).toFixed(1)} ms)\n${details}`))
    );
    if (!inset && w > 24) labels.push({ text: spanLabel(e), x: x + 3, y: laneTop + laneHeight / 2 + 4, room: w - 6, model });
  }
  for (const label of labels) {
    const node = svg("text", { class: label.model ? "label call" : "label", x: label.x.toFixed(1), y: label.y.toFixed(1) });
    root.append(node);
    fitLabel(node, label.text, label.room);
  }
  // Time ticks at a round number of milliseconds, as many as fit.
  const span = (t1 - t0) / 1000;
  const room = (W - LABEL - R) / (textWidth(`${Math.round(span)} ms`, TEXT_PX) + 16);
  const every = niceStep(span / Math.max(1, Math.floor(room)));
  for (let k = 0; k * every <= span + 1e-9; k++) {
    const t = k * every;
    const x = LABEL + t * 1000 * scale;
    const anchor = t === 0 ? "start" : x + textWidth(`${t} ms`, TEXT_PX) / 2 > W ? "end" : "middle";
    root.append(svg("text", { class: "rowlabel", x: x.toFixed(1), y: H - 5, "text-anchor": anchor }, `${+t.toFixed(3)} ms`));
  }
  holder.append(el("div", { class: "legend" },
    el("span", { class: "key", style: "--c:#93c5fd" }, "node backward"),
    el("span", { class: "key", style: "--c:#fdba74" }, "model call (under the node that made it)"),
    el("span", { class: "key", style: "--c:#e5e7eb" }, "phase"),
    `${events.length} spans on ${rows.length} rows; hover a bar for its details, or open the file in ui.perfetto.dev`));
}

// The smallest of 1, 2, 5 times a power of ten that is at least `x` (> 0).
function niceStep(x) {
  const power = 10 ** Math.floor(Math.log10(Math.max(x, 1e-9)));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= x);
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
  // One model for every call (the usual case) is said once, above the table, and its
  // column left out: the replies get the room.
  const models = [...new Set(calls.map((c) => c.model))];
  const oneModel = models.length === 1 ? models[0] : null;
  card.append(el("div", { class: "note" }, `${calls.length} calls${oneModel ? ` to ${oneModel}` : ""}, ${tokens.toLocaleString("en-US")} tokens; click a row for the request and reply`));
  // A fixed layout (app.css gives the narrow columns their widths): the reply column takes
  // what is left and long words wrap, so the table stays inside its card at any width.
  const headings = [["#", "num"], ["phase · node", "where"], oneModel ? null : ["model", "model"], ["tokens in/out", "tokens"], ["ms", "ms"], ["reply", "reply"]].filter(Boolean);
  const body = el("tbody");
  calls.forEach((c, k) => {
    const messages = c.request && (c.request.messages || (c.request.body && c.request.body.messages)) || [];
    const last = messages.length ? String(messages[messages.length - 1].content || "") : "";
    const excerpt = (c.error || c.reply || "") || last;
    const detail = el("tr", { class: "detail", hidden: true },
      el("td", { colspan: headings.length },
        el("div", { class: "role" }, "request"), el("pre", {}, JSON.stringify(c.request, null, 1)),
        el("div", { class: "role" }, c.error ? "error" : "reply"), el("pre", {}, c.error || c.reply || "")));
    const notes = [c.cached ? "cached" : null, c.retries ? `${c.retries} retr${c.retries === 1 ? "y" : "ies"}` : null].filter(Boolean);
    const row = el("tr", { class: "call", onclick: () => { detail.hidden = !detail.hidden; } },
      el("td", { class: "num" }, k + 1),
      el("td", {}, (c.labels && c.labels.phase) || "", c.node ? el("div", { class: "sub" }, c.node.function) : null),
      oneModel ? null : el("td", {}, c.model),
      el("td", { class: "num" }, `${c.prompt_tokens}/${c.completion_tokens}`),
      el("td", { class: "num" }, Math.round((c.latency_s || 0) * 1000), notes.map((n) => el("div", { class: "sub" }, n))),
      el("td", { class: "excerpt", title: excerpt.slice(0, 1000) }, el("div", { class: "clamp" }, excerpt.slice(0, 300))));
    body.append(row, detail);
  });
  card.append(el("table", { class: "calls" },
    el("colgroup", {}, headings.map(([, name]) => el("col", { class: name }))),
    el("thead", {}, el("tr", {}, headings.map(([h, name]) => el("th", { class: ["num", "tokens", "ms"].includes(name) ? "num" : null }, h)))),
    body));
}

// -- the page's own layout check --------------------------------------------------------

// What on the page is wider than its box or than the window, and which chart texts are
// drawn smaller than MIN_TEXT_PX; each as a short description (tag.class@run).
function checkLayout() {
  const view = document.documentElement.clientWidth;
  const overflow = new Set(), smallText = new Set();
  const describe = (node) => {
    const cls = typeof node.className === "string" ? node.className : node.getAttribute("class") || "";
    const column = node.closest("[data-run]");
    return node.tagName.toLowerCase() + (cls ? "." + cls.trim().split(/\s+/)[0] : "") + (column ? "@run" + column.dataset.run : "");
  };
  for (const node of document.body.querySelectorAll("*")) {
    const box = node.getBoundingClientRect();
    if (!box.width && !box.height) continue; // hidden (a closed call's details)
    if (box.right > view + 1 || box.left < -1) overflow.add(describe(node) + ":beyond-window");
    else if (node instanceof HTMLElement && node.clientWidth && node.scrollWidth > node.clientWidth + 1) overflow.add(describe(node) + ":scrolls");
    if (node instanceof SVGTextElement) {
      const owner = node.ownerSVGElement.getBoundingClientRect();
      if (box.right > owner.right + 1 || box.left < owner.left - 1) overflow.add(describe(node) + ":beyond-chart");
      const px = parseFloat(getComputedStyle(node).fontSize) * (owner.width / node.ownerSVGElement.viewBox.baseVal.width || 1);
      if (px < MIN_TEXT_PX) smallText.add(`${describe(node.ownerSVGElement)}:${px.toFixed(1)}px`);
    }
  }
  if (document.documentElement.scrollWidth > view) overflow.add("page:scrolls");
  return { overflow: [...overflow], smallText: [...smallText] };
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
// Charts and timelines are drawn at their card's width: draw them again at the new one.
let resizing = null;
window.addEventListener("resize", () => {
  clearTimeout(resizing);
  resizing = setTimeout(() => {
    if (state.data.length) render().catch(showError);
  }, 200);
});
poll();
