// tinkerq's console: plain JS, no libraries. The API key lives in this tab's sessionStorage only and goes to
// this gateway as X-API-Key, as the SDK sends it; everything shown is what the gateway answers for that key.
// Text from the server is always set as textContent (never parsed as HTML).
"use strict";

const KEY = "tinkerq-console-key";
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === false || value === null || value === undefined) continue;
    if (name === "onclick") node.addEventListener("click", value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

class Unauthorized extends Error {}

async function api(path, options) {
  const key = sessionStorage.getItem(KEY);
  const response = await fetch(path, { ...(options || {}), headers: { "X-API-Key": key || "" },
                                       cache: "no-store", credentials: "omit" });
  if (response.status === 401) throw new Unauthorized("this API key is unknown or revoked");
  const body = response.headers.get("content-type")?.includes("json") ? await response.json() : null;
  if (!response.ok) throw new Error((body && body.detail) || `${response.status} ${response.statusText}`);
  return body;
}

function fmt(n) {
  if (n === null || n === undefined) return "none";
  if (typeof n !== "number") return String(n);
  if (Number.isInteger(n)) return n.toLocaleString("en");
  return Math.abs(n) >= 1e4 || (Math.abs(n) < 1e-3 && n !== 0) ? n.toExponential(3) : n.toPrecision(4);
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function when(iso) {
  return iso ? new Date(iso).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "never";
}

// A line chart of ys over xs, as inline SVG. The plotted numbers are kept on the element (data-values) as well.
function lineChart(title, xs, ys, xLabel) {
  const W = 440, H = 220, L = 62, R = 12, T = 24, B = 34;
  const chart = svg("svg", { class: "chart", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img",
                             "aria-label": title, "data-series": title, "data-values": JSON.stringify(ys),
                             "data-steps": JSON.stringify(xs) });
  chart.append(svg("text", { class: "title", x: L, y: 15 }, title));
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    chart.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: py(y), y2: py(y) }));
    chart.append(svg("text", { x: L - 6, y: py(y) + 4, "text-anchor": "end" }, fmt(y)));
  }
  chart.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  chart.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  chart.append(svg("text", { x: L, y: H - B + 15 }, fmt(Math.min(...xs))));
  chart.append(svg("text", { x: W - R, y: H - B + 15, "text-anchor": "end" }, fmt(Math.max(...xs))));
  chart.append(svg("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle" }, xLabel));
  const points = xs.map((x, i) => `${px(x).toFixed(1)},${py(ys[i]).toFixed(1)}`).join(" ");
  chart.append(svg("polyline", { class: "line", points }));
  if (xs.length <= 60) xs.forEach((x, i) => chart.append(svg("circle", { class: "dot", cx: px(x), cy: py(ys[i]), r: 2.5 })));
  return chart;
}

// -- the views ------------------------------------------------------------------------------------------------

function showUsage(data) {
  const { limits, in_use: used } = data.quota;
  const card = (label, value, full) => el("div", { class: full ? "card full" : "card" }, el("b", {}, value), label);
  const quota = (name, label) => {
    const limit = limits[name];
    const n = used[name];
    return card(label, n === undefined ? fmt(limit) : `${fmt(n)} / ${limit === null ? "∞" : fmt(limit)}`,
                limit !== null && n !== undefined && n >= limit);
  };
  const totals = data.usage.totals;
  const hours = new Map();
  for (const row of data.usage.hourly) {
    const h = hours.get(row.hour) || { training: 0, sampled: 0 };
    h.training += row.training_tokens || 0;
    h.sampled += row.sampled_tokens || 0;
    hours.set(row.hour, h);
  }
  const now = Date.now();
  const xs = [...hours.keys()].map((h) => Math.round((Date.parse(h) - now) / 360e3) / 10);
  const charts = el("div", { class: "charts" });
  if (xs.length) {
    charts.append(lineChart("training tokens per hour", xs, [...hours.values()].map((h) => h.training), "hour bucket (hours from now, UTC hours)"));
    charts.append(lineChart("sampled tokens per hour", xs, [...hours.values()].map((h) => h.sampled), "hour bucket (hours from now, UTC hours)"));
  }
  document.querySelector("#usage .body").replaceChildren(
    el("div", { class: "cards" },
       quota("max_training_clients", "training clients open"),
       quota("max_sampling_inflight", "sampling requests in flight"),
       card("max tokens per minute", limits.max_tokens_per_minute === null ? "∞" : fmt(limits.max_tokens_per_minute)),
       card("checkpoints kept per run", limits.keep_checkpoints === null ? "all" : fmt(limits.keep_checkpoints)),
       card("training tokens (48 h)", fmt(totals.training_tokens)),
       card("prefill tokens (48 h)", fmt(totals.prefill_tokens)),
       card("sampled tokens (48 h)", fmt(totals.sampled_tokens)),
       card("checkpoints stored", `${fmt(data.storage.checkpoints)} (${bytes(data.storage.bytes)})`)),
    charts);
}

function showQueue(q) {
  const states = Object.entries(q.by_state).map(([state, n]) => `${n} ${state}`).join(", ");
  document.querySelector("#queue .body").replaceChildren(...[
    el("p", { id: "queue-summary" }, q.waiting ? `${q.waiting} of your requests waiting: ${states}` : "None of your requests is waiting."),
    q.oldest.length ? el("table", {}, el("tr", {}, el("th", {}, "request"), el("th", {}, "kind"), el("th", {}, "state"),
                                           el("th", {}, "waiting for"), el("th", {}, "why")),
                          q.oldest.map((w) => el("tr", {}, el("td", { class: "mono" }, w.request_id.slice(0, 12)),
                                                 el("td", {}, w.kind), el("td", {}, w.state), el("td", {}, `${w.age_s} s`),
                                                 el("td", {}, w.reason || "")))) : null,
    el("h3", {}, "Workers serving"),
    q.workers.length ? el("table", {}, el("tr", {}, el("th", {}, "base model"), el("th", {}, "role"), el("th", {}, "workers")),
                          q.workers.map((w) => el("tr", {}, el("td", {}, w.base_model), el("td", {}, w.role), el("td", {}, w.count))))
      : el("p", { class: "muted" }, "No worker is serving any model right now.")].filter(Boolean));
}

function showSessions(sessions, selected) {
  document.querySelector("#sessions .body").replaceChildren(sessions.length
    ? el("table", {}, el("tr", {}, el("th", {}, "session"), el("th", {}, "created"), el("th", {}, "last heartbeat"),
                         el("th", {}, "state"), el("th", {}, "training runs"), el("th", {}, "tags")),
         sessions.map((s) => el("tr", { class: s.session_id === selected ? "selected" : null, "data-session-id": s.session_id },
                                el("td", { class: "mono" }, s.session_id), el("td", {}, when(s.created)),
                                el("td", {}, when(s.last_heartbeat)), el("td", {}, s.finished ? "finished" : "open"),
                                el("td", {}, s.training_runs), el("td", {}, s.tags.join(", ")))))
    : el("p", { class: "muted" }, "No sessions yet."));
}

function showRuns(runs, actions, selected) {
  const body = document.querySelector("#runs .body");
  if (!runs.length) { body.replaceChildren(el("p", { class: "muted" }, "No training runs yet.")); return; }
  body.replaceChildren(...runs.map((run, i) => {
    const details = el("details", { class: run.training_run_id === selected ? "run selected" : "run",
                                    "data-run-id": run.training_run_id },
      el("summary", {}, el("span", { class: "mono" }, run.training_run_id), " · ", run.base_model,
         run.is_lora ? ` · LoRA rank ${run.lora_rank}` : " · full fine-tune", ` · last request ${when(run.last_request_time)}`,
         run.closed ? " · closed" : ""),
      el("div", { class: "charts" }, el("p", { class: "muted" }, "loading curves…")),
      el("div", { class: "checkpoints" }));
    details.addEventListener("toggle", () => {
      if (details.open && !details.dataset.loaded) {
        loadRun(details, actions).catch((err) => details.querySelector(".charts").replaceChildren(
          el("p", { class: "error" }, err.message)));
      }
    });
    if (run.training_run_id === selected || (!selected && i === 0)) details.open = true;
    return details;
  }));
  const chosen = body.querySelector("details.selected");
  if (chosen) chosen.scrollIntoView();
}

async function loadRun(details, actions) {
  details.dataset.loaded = "1";
  const runId = details.dataset.runId;
  const [metrics, checkpoints] = await Promise.all([
    api(`/api/v1/console/training_runs/${encodeURIComponent(runId)}/metrics`),
    api(`/api/v1/training_runs/${encodeURIComponent(runId)}/checkpoints`)]);
  const series = new Map();  // "<op> <metric>" -> {xs, ys}
  for (const point of metrics.points) {
    for (const [name, value] of Object.entries(point.metrics)) {
      if (!Number.isFinite(value)) continue;  // a NaN loss is a gap in the curve, not a broken chart
      const key = `${point.op} ${name}`;
      const s = series.get(key) || { xs: [], ys: [] };
      s.xs.push(point.seq_id);
      s.ys.push(value);
      series.set(key, s);
    }
  }
  const keys = [...series.keys()].sort((a, b) => (b.includes("loss") - a.includes("loss")) || a.localeCompare(b));
  details.querySelector(".charts").replaceChildren(...(keys.length
    ? keys.map((k) => lineChart(k, series.get(k).xs, series.get(k).ys, "request (seq_id)"))
    : [el("p", { class: "muted" }, "No forward_backward, forward or optim_step answered for this run yet.")]));
  showCheckpoints(details.querySelector(".checkpoints"), runId, checkpoints.checkpoints, actions);
  details.dataset.ready = "1";
}

function checkpointUrl(runId, checkpointId, tail) {
  const id = checkpointId.split("/").map(encodeURIComponent).join("/");
  return `/api/v1/training_runs/${encodeURIComponent(runId)}/checkpoints/${id}${tail || ""}`;
}

// What an action did (or why it failed), above the runs: the runs are drawn again after a change.
function notify(...parts) {
  document.getElementById("notice").replaceChildren(...parts);
}

// Signed links are made for exported weights only (tinker://<run>/external_weights/<name>).
const NOT_EXPORTED = "download links are signed for exported weights: export this run with " +
  "TrainingClient.save_weights_external (as `tinker checkpoint download` does)";

function showCheckpoints(box, runId, checkpoints, actions) {
  const missing = Object.entries(actions).filter(([, served]) => !served).map(([name]) => name);
  const note = missing.length ? el("p", { class: "note" }, `Not served by this gateway yet: ${missing.join(", ")}.`) : null;
  if (!checkpoints.length) { box.replaceChildren(el("h3", {}, "Checkpoints"), el("p", { class: "muted" }, "None saved.")); return; }
  const act = (label, name, run, why) => el("button", {
    type: "button", "data-action": name, disabled: !actions[name] || Boolean(why),
    title: !actions[name] ? `${name} is not served by this gateway yet` : why || null,
    onclick: async (event) => {
      try { await run(event.target); } catch (err) { notify(el("span", { class: "error" }, err.message)); }
    } }, label);
  const rows = checkpoints.map((c) => el("tr", { "data-checkpoint": c.tinker_path },
    el("td", { class: "mono" }, c.tinker_path), el("td", {}, c.checkpoint_type), el("td", {}, when(c.time)),
    el("td", {}, c.expires_at ? when(c.expires_at) : "never"), el("td", {}, c.public ? "public" : "private"),
    el("td", {},
       act("Download", "download", async () => {
         const got = await api(checkpointUrl(runId, c.checkpoint_id, "/external_weights_urls"));
         notify(`Signed links for ${c.tinker_path}, valid until ${when(got.expires)}: `,
                ...Object.entries(got.urls).map(([file, url]) => el("a", { href: url, download: file }, file, " ")));
       }, c.checkpoint_type === "external" ? null : NOT_EXPORTED),
       c.public ? act("Unpublish", "unpublish", async () => {
         await api(checkpointUrl(runId, c.checkpoint_id, "/publish"), { method: "DELETE" });
         await refresh(); notify(`${c.tinker_path} is private again`);
       }) : act("Publish", "publish", async () => {
         await api(checkpointUrl(runId, c.checkpoint_id, "/publish"), { method: "POST" });
         await refresh(); notify(`${c.tinker_path} is readable by every API key now`);
       }),
       act("Delete", "delete", async (button) => {
         if (button.dataset.armed !== "1") {  // a second click confirms (no modal dialogs)
           button.dataset.armed = "1"; button.textContent = "Really delete?"; return;
         }
         await api(checkpointUrl(runId, c.checkpoint_id), { method: "DELETE" });
         await refresh(); notify(`${c.tinker_path} deleted`);
       }))));
  box.replaceChildren(...[el("h3", {}, "Checkpoints"), el("table", {},
    el("tr", {}, el("th", {}, "path"), el("th", {}, "type"), el("th", {}, "saved"), el("th", {}, "expires"),
       el("th", {}, "visibility"), el("th", {}, "")), rows), note].filter(Boolean));
}

// -- routing, signing in and out ------------------------------------------------------------------------------

// The SDK's console links (tinker.lib.console_urls) under /console: /training_runs/<id>, /sessions/<id>,
// /checkpoints/<run>/<checkpoint>.
function route() {
  const parts = location.pathname.replace(/^\/console\/?/, "").split("/").map(decodeURIComponent);
  if ((parts[0] === "training_runs" || parts[0] === "checkpoints") && parts[1]) return { run: parts[1] };
  if (parts[0] === "sessions" && parts[1]) return { session: parts[1] };
  if (parts[0] === "keys") return { keys: true };  // `tinker auth`'s links
  return {};
}

async function refresh() {
  const data = await api("/api/v1/console/overview");
  const where = route();
  document.getElementById("who").textContent = `signed in as ${data.tenant}`;
  document.getElementById("page-note").textContent = where.keys ? "API keys are made and revoked by the fleet's " +
    "operator (tinkerq keys create NAME / revoke NAME); this console shows what a key may use, below." : "";
  showUsage(data);
  showQueue(data.queue);
  showRuns(data.training_runs, data.actions, where.run);
  if (data.training_runs_total > data.training_runs.length) {
    document.querySelector("#runs .body").append(el("p", { class: "note" },
      `The newest ${data.training_runs.length} of ${data.training_runs_total} training runs.`));
  }
  showSessions(data.sessions, where.session);
  document.body.dataset.tenant = data.tenant;
}

async function start() {
  const signedIn = Boolean(sessionStorage.getItem(KEY));
  document.getElementById("sign-in").hidden = signedIn;
  document.getElementById("console").hidden = !signedIn;
  document.getElementById("sign-out").hidden = !signedIn;
  if (!signedIn) return;
  try {
    await refresh();
  } catch (err) {
    if (err instanceof Unauthorized) { signOut(err.message); return; }
    document.getElementById("error").textContent = err.message;
  }
}

function signOut(why) {
  sessionStorage.removeItem(KEY);
  // Nothing of the last key's stays in the page, hidden or not.
  for (const body of document.querySelectorAll("#console .body")) body.replaceChildren();
  notify();
  delete document.body.dataset.tenant;
  document.getElementById("who").textContent = "";
  document.getElementById("sign-in-error").textContent = why || "";
  document.getElementById("api-key").value = "";
  start();
}

document.getElementById("sign-in").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, document.getElementById("api-key").value.trim());
  start();
});
document.getElementById("sign-out").addEventListener("click", () => signOut(""));
start();
