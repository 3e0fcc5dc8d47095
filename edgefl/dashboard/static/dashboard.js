// edgefl dashboard: folds the server's Server-Sent Events into tables and two SVG charts.
// No library: everything is built with the DOM, and text from the network goes in through
// textContent only (node and run ids are whatever a broker delivered).
"use strict";
(function () {
  const view = {
    broker: {}, nodes: new Map(), runs: new Map(), points: new Map(), events: [],
    selected: null,         // the run whose curves are shown, when the user picked one
    skew: 0,                // this browser's clock minus the server's, in seconds
    connected: false,
  };
  const MAX_EVENTS_SHOWN = 200;
  const ACTIVE = ["running", "paused"];
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";

  // ---------------------------------------------------------------- the feed
  function applySnapshot(doc) {
    view.broker = doc.broker || {};
    view.nodes = new Map((doc.nodes || []).map((n) => [n.node, n]));
    view.runs = new Map((doc.runs || []).map((r) => [r.id, r]));
    view.points = new Map();
    for (const [run, list] of Object.entries(doc.points || {})) {
      view.points.set(run, new Map(list.map((p) => [p.round, p])));
    }
    view.events = (doc.events || []).slice(-MAX_EVENTS_SHOWN);
    if (typeof doc.now === "number") view.skew = Date.now() / 1000 - doc.now;
  }

  const handlers = {
    snapshot: applySnapshot,
    broker: (doc) => { view.broker = doc; },
    node: (doc) => { view.nodes.set(doc.node, doc); },
    node_gone: (doc) => { view.nodes.delete(doc.node); },
    run: (doc) => { view.runs.set(doc.id, doc); },
    run_gone: (doc) => { view.runs.delete(doc.id); view.points.delete(doc.id); },
    point: (doc) => {
      if (!view.points.has(doc.run)) view.points.set(doc.run, new Map());
      view.points.get(doc.run).set(doc.round, doc);
    },
    event: (doc) => {
      view.events.push(doc);
      if (view.events.length > MAX_EVENTS_SHOWN) view.events.shift();
    },
  };

  function connect() {
    const source = new EventSource("/events");
    for (const [kind, handle] of Object.entries(handlers)) {
      source.addEventListener(kind, (message) => {
        view.connected = true;
        handle(JSON.parse(message.data));
        schedule();
      });
    }
    source.onopen = () => { view.connected = true; schedule(); };
    // the browser reconnects by itself and the server starts again from a snapshot
    source.onerror = () => { view.connected = false; schedule(); };
  }

  // ---------------------------------------------------------------- rendering
  let pending = null;
  function schedule() {
    if (pending === null) pending = setTimeout(() => { pending = null; render(); }, 50);
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value !== undefined && value !== null) node.setAttribute(key, value);
    }
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function cell(row, text, cls) {
    row.appendChild(el("td", cls ? { class: cls } : null, text === undefined || text === null || text === "" ? "-" : text));
  }

  function clock(at) {
    if (typeof at !== "number") return "-";
    const d = new Date((at + view.skew) * 1000);
    return d.toTimeString().slice(0, 8);
  }

  function ago(at) {
    if (typeof at !== "number") return "-";
    const s = Math.max(0, Date.now() / 1000 - view.skew - at);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
    return `${Math.floor(s / 86400)} d ago`;
  }

  function fmt(x, digits) {
    return typeof x === "number" ? x.toFixed(digits === undefined ? 4 : digits) : "-";
  }

  function naturalKey(text) {
    return String(text).split(/(\d+)/).map((part, i) => (i % 2 ? Number(part) : part));
  }

  function naturalCompare(a, b) {
    const ka = naturalKey(a), kb = naturalKey(b);
    for (let i = 0; i < Math.min(ka.length, kb.length); i++) {
      if (ka[i] < kb[i]) return -1;
      if (ka[i] > kb[i]) return 1;
    }
    return ka.length - kb.length;
  }

  function renderHeader() {
    $("federation").textContent = view.broker.federation || "-";
    $("broker").textContent = view.broker.url || "-";
    const link = $("link");
    let state = "connecting", text = "connecting";
    if (!view.connected) { state = "offline"; text = "dashboard unreachable, retrying"; }
    else if (view.broker.connected) { state = "live"; text = "live"; }
    else { state = "broker-down"; text = `broker unreachable (${view.broker.reason || "reconnecting"})`; }
    link.dataset.state = state;
    link.textContent = text;
  }

  function nodeNote(n) {
    if (n.refused) return `refused run ${n.refused.run}: ${n.refused.reason}`;
    if (n.service === "waiting") return `waiting for a run${n.queued ? `, ${n.queued} queued` : ""}`;
    if (n.paused) return "run paused";
    if (n.round) return `round ${n.round} open`;
    if (n.need_model) return `waiting for the model of round ${n.need_model}`;
    return "";
  }

  function renderFleet() {
    const body = $("fleet").tBodies[0];
    const nodes = [...view.nodes.values()].sort((a, b) =>
      (a.online !== true) - (b.online !== true) || naturalCompare(a.node, b.node));
    body.replaceChildren();
    for (const n of nodes) {
      const row = el("tr", { "data-node": n.node, "data-online": String(n.online) });
      cell(row, n.node, "node");
      cell(row, n.role);
      const status = n.online === true ? "online" : n.online === false ? "offline" : "unknown";
      cell(row, status, `dot ${status}`);
      cell(row, n.profile);
      cell(row, n.version);
      cell(row, ago(n.seen), "seen");
      cell(row, n.last_round, "num");
      cell(row, n.run);
      // a status is whatever its board published: a field of another type is shown as
      // text, never called (a number's .slice threw, and no row was drawn again)
      let model = "";
      if (n.onnx_sha256) model = (n.onnx_round ? `round ${n.onnx_round} · ` : "") + String(n.onnx_sha256).slice(0, 12);
      cell(row, model, "model");
      cell(row, nodeNote(n));
      body.appendChild(row);
    }
    const online = nodes.filter((n) => n.online === true).length;
    $("fleet-summary").textContent = nodes.length ? `${nodes.length} node(s), ${online} online` : "";
    $("fleet-empty").hidden = nodes.length > 0;
  }

  function runOrder(r) {
    if (ACTIVE.includes(r.state)) return 0;
    if (r.state === "queued") return 1;
    return 2;
  }

  function sortedRuns() {
    return [...view.runs.values()].sort((a, b) => runOrder(a) - runOrder(b) ||
      (runOrder(a) === 1 ? (a.created || 0) - (b.created || 0)
        : (b.ended || b.started || b.created || 0) - (a.ended || a.started || a.created || 0)));
  }

  function curveRun() {
    if (view.selected && (view.runs.has(view.selected) || view.points.has(view.selected))) return view.selected;
    const runs = sortedRuns();
    const active = runs.find((r) => ACTIVE.includes(r.state));
    if (active) return active.id;
    const drawn = runs.find((r) => view.points.has(r.id));
    if (drawn) return drawn.id;
    const [first] = view.points.keys();
    return first || null;
  }

  function renderRuns(shown) {
    const body = $("runs").tBodies[0];
    const runs = sortedRuns();
    body.replaceChildren();
    for (const r of runs) {
      const row = el("tr", { "data-run": r.id, "data-state": r.state, class: r.id === shown ? "selected" : null });
      cell(row, r.id, "run");
      cell(row, r.state, `state state-${r.state}`);
      cell(row, `${r.rounds_done || 0}/${r.rounds || "?"}`, "num rounds");
      cell(row, fmt(typeof r.final_accuracy === "number" ? r.final_accuracy : r.test_accuracy), "num");
      cell(row, clock(r.started));
      cell(row, clock(r.ended));
      row.addEventListener("click", () => { view.selected = r.id; schedule(); });
      body.appendChild(row);
    }
    const count = (states) => runs.filter((r) => states.includes(r.state)).length;
    $("runs-summary").textContent = runs.length
      ? `${count(ACTIVE)} active, ${count(["queued"])} queued, ${runs.length - count(ACTIVE) - count(["queued"])} ended` : "";
    $("runs-empty").hidden = runs.length > 0;
  }

  // ---------------------------------------------------------------- charts
  const W = 480, H = 240, M = { left: 48, right: 12, top: 12, bottom: 30 };

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function roundTicks(last) {
    // integer rounds only, at most ~10 labels
    const step = Math.max(1, Math.ceil(last / 10));
    const ticks = [];
    for (let r = 1; r <= last; r += step) ticks.push(r);
    if (ticks[ticks.length - 1] !== last) ticks.push(last);
    return ticks;
  }

  function chart(target, series, options) {
    const box = $(target);
    box.replaceChildren();
    const all = series.flatMap((s) => s.points);
    if (!all.length) {
      box.appendChild(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "nodata" }, options.empty));
      return;
    }
    const last = Math.max(options.rounds || 1, ...all.map((p) => p.round));
    const [ymin, ymax] = options.range(all.map((p) => p.value));
    const x = (r) => M.left + (last === 1 ? 0.5 : (r - 1) / (last - 1)) * (W - M.left - M.right);
    const y = (v) => H - M.bottom - (v - ymin) / (ymax - ymin || 1) * (H - M.top - M.bottom);
    for (let i = 0; i <= 4; i++) {
      const v = ymin + (ymax - ymin) * i / 4;
      box.appendChild(svg("line", { x1: M.left, x2: W - M.right, y1: y(v), y2: y(v), class: "grid" }));
      box.appendChild(svg("text", { x: M.left - 6, y: y(v) + 4, "text-anchor": "end" }, v.toFixed(options.digits)));
    }
    box.appendChild(svg("line", { x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom, class: "axis" }));
    box.appendChild(svg("line", { x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, class: "axis" }));
    for (const r of roundTicks(last)) {
      box.appendChild(svg("text", { x: x(r), y: H - M.bottom + 16, "text-anchor": "middle" }, r));
    }
    box.appendChild(svg("text", { x: W - M.right, y: H - 2, "text-anchor": "end" }, "round"));
    for (const s of series) {
      const pts = s.points.slice().sort((a, b) => a.round - b.round);
      if (s.line) {
        // one line per stretch of rounds the page saw close: rounds it missed (the broker
        // or this page away; events are not retained) leave a gap, not a straight line
        // drawn across them as if measured (options.closed: the rounds seen closing)
        for (const part of stretches(pts, options.closed)) {
          if (part.length > 1) {
            box.appendChild(svg("polyline", { class: `line ${s.cls}`, points: part.map((p) => `${x(p.round)},${y(p.value)}`).join(" ") }));
          }
        }
      }
      for (const p of pts) {
        const dot = svg("circle", { class: `point ${s.cls}`, cx: x(p.round), cy: y(p.value), r: 3.5, "data-round": p.round });
        dot.appendChild(svg("title", {}, `round ${p.round}: ${s.label} ${p.value.toFixed(4)}`));
        box.appendChild(dot);
      }
    }
  }

  function stretches(pts, closed) {
    // pts (sorted by round) cut wherever a round between two of them was not seen closing
    const parts = [];
    let part = [];
    for (const p of pts) {
      if (part.length && closed) {
        const prev = part[part.length - 1].round;
        // a gap wider than the rounds seen closing has one that was not (and the walk is
        // bounded by what was seen, never by the rounds' values)
        let cut = p.round - prev - 1 > closed.size;
        for (let r = prev + 1; !cut && r < p.round; r++) cut = !closed.has(r);
        if (cut) { parts.push(part); part = []; }
      }
      part.push(p);
    }
    if (part.length) parts.push(part);
    return parts;
  }

  function series(run, key) {
    const points = view.points.get(run);
    if (!points) return [];
    return [...points.values()].filter((p) => typeof p[key] === "number")
      .map((p) => ({ round: p.round, value: p[key] }));
  }

  function renderCurves(run) {
    const record = run ? view.runs.get(run) : null;
    $("curve-run").textContent = run ? `run ${run}${record ? ` (${record.state})` : ""}` : "";
    $("curves-section").dataset.run = run || "";
    const rounds = record && record.rounds;
    const closed = run && view.points.has(run) ? new Set(view.points.get(run).keys()) : null;
    const empty = run ? "no round evaluated yet" : "no run yet";
    chart("chart-accuracy", [{ cls: "accuracy", label: "test accuracy", line: true, points: run ? series(run, "test_accuracy") : [] }],
      { rounds, digits: 2, empty, closed, range: () => [0, 1] });
    chart("chart-loss", [
      { cls: "train-loss", label: "train loss", line: true, points: run ? series(run, "train_loss") : [] },
      { cls: "test-loss", label: "test loss", line: false, points: run ? series(run, "test_loss") : [] },
    ], { rounds, digits: 2, closed, empty: run ? "no round closed yet" : "no run yet",
      range: (values) => [0, Math.max(...values) * 1.1 || 1] });
  }

  // ---------------------------------------------------------------- events
  function eventText(e) {
    switch (e.event) {
      case "round_opened":
        return `round ${e.round} opened: ${(e.selected || []).length} selected`;
      case "round_closed":
        return `round ${e.round} closed (${e.closed_by}): ${e.updates} update(s), test accuracy ${fmt(e.test_accuracy)}`;
      case "client_joined": return `${e.client} online`;
      case "client_left": return `${e.client} offline`;
      case "client_refused": return `${e.client} refused round ${e.round}: ${e.reason}`;
      case "run_queued": return `queued: ${e.strategy}, ${e.rounds} rounds, ${e.ahead} ahead`;
      case "run_finished": return `finished after ${e.rounds} rounds, model ${String(e.model_sha256 || "").slice(0, 12)}`;
      case "error": return `error: ${e.error}`;
      default: {
        const extra = Object.entries(e).filter(([k]) => !["event", "run", "node", "at", "received", "sig"].includes(k))
          .map(([k, v]) => `${k} ${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ");
        return extra ? `${e.event}: ${extra}` : e.event;
      }
    }
  }

  function renderEvents() {
    const list = $("events");
    list.replaceChildren();
    for (const e of view.events.slice().reverse()) {
      const item = el("li", { "data-event": e.event, class: e.event === "error" ? "error" : null });
      item.appendChild(el("span", { class: "at" }, clock(typeof e.at === "number" ? e.at : e.received)));
      item.appendChild(el("span", { class: "run" }, e.run || e.node || "-"));
      item.appendChild(document.createTextNode(eventText(e)));
      list.appendChild(item);
    }
    $("events-summary").textContent = view.events.length ? `latest ${view.events.length}, newest first` : "none yet";
  }

  function render() {
    const run = curveRun();
    renderHeader();
    renderFleet();
    renderRuns(run);
    renderCurves(run);
    renderEvents();
    document.body.dataset.ready = "true";
  }

  setInterval(() => { if (view.nodes.size) renderFleet(); }, 1000);   // "last seen" ages
  render();
  connect();
})();
