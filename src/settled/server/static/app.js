// settled /ui: the four clocks of every session, live. Hand-written; no build step, no library.
//
// Rules this file keeps (the command, its output and everything it names are hostile):
// - Server data reaches the DOM only as text (textContent, Text nodes): there is no innerHTML,
//   outerHTML, insertAdjacentHTML or document.write anywhere here, and no URL is built from data.
// - Log bytes are decoded by hand: valid UTF-8 is shown as text; invalid bytes, control
//   characters (ANSI escapes among them) and invisible or bidi characters are shown as \xNN or
//   \uNNNN escapes; a log is read a page at a time from a cursor, so a 4 MiB line never lands
//   in the page at once.
// - The token comes from the form or the URL fragment (never the query string), lives in
//   sessionStorage, and goes out only as `Authorization: Bearer` on this origin's fetches. The
//   live stream is fetch + ReadableStream (EventSource cannot send that header).
// - `#task=T` in the address is a link to task T: it is selected once the stream shows it, and
//   selecting another task puts that one's id there (an id is `[A-Za-z0-9_-]{1,128}`, checked).
"use strict";

const TOKEN_KEY = "settled.token";
const SHOWN_PAGES = 16; // pages of a log kept on the page; earlier ones are dropped (say so)
const FOLLOW_MS = 500;
const $ = (id) => document.getElementById(id);
const TASK_ID = /^[A-Za-z0-9_-]{1,128}$/; // grammar.check_id: nothing else names a task

// -- DOM, as text only ---------------------------------------------------------------------

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "class") node.className = value;
    else if (key === "title") node.title = value;
    else if (key === "data") for (const [k, v] of Object.entries(value)) node.dataset[k] = String(v);
    else if (key === "click") node.addEventListener("click", value);
    else throw new Error("el: no property " + key);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node; // append() of a string makes a Text node: never markup
}

function setText(id, text) { $(id).textContent = text === null || text === undefined ? "" : String(text); }
function short(digest) { return digest ? String(digest).replace(/^([a-z0-9]+:)(.{12}).*$/, "$1$2…") : ""; }
function iso(seconds) { return seconds ? new Date(seconds * 1000).toISOString() : "—"; }
function json(value) { return JSON.stringify(value, null, 2); }

// -- the token -------------------------------------------------------------------------------

function fragmentValue(name) { // name is one of this file's constants
  const found = new RegExp("(?:^#|&)" + name + "=([^&]*)").exec(location.hash); // "+" stays "+": not a form
  if (!found) return null;
  try { return decodeURIComponent(found[1]) || null; } catch (_) { return null; }
}

function fragmentToken() { return fragmentValue("token"); }

function fragmentTask() {
  const task = fragmentValue("task");
  return task && TASK_ID.test(task) ? task : null;
}

function taskAddress(task) { return location.pathname + (task && TASK_ID.test(task) ? "#task=" + task : ""); }

function tokenFromFragment() {
  const token = fragmentToken();
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  ui.wanted = fragmentTask() || ui.wanted;
  if (location.hash) history.replaceState(null, "", taskAddress(ui.wanted)); // the token out of the URL bar
}

function token() { return sessionStorage.getItem(TOKEN_KEY); }

function needToken(why) {
  stopLive();
  $("token-form").hidden = false;
  $("token-forget").hidden = true;
  setLink("token", why || "a token is needed: the page holds no data of its own");
}

class Unauthorized extends Error {}

async function api(path, { method = "GET", body, headers = {}, signal } = {}) {
  const sent = { ...headers, Authorization: "Bearer " + token() };
  if (body !== undefined) sent["Content-Type"] = "application/json";
  const res = await fetch(path, {
    method, headers: sent, signal, cache: "no-store", credentials: "omit",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (res.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    needToken("the server did not accept that token");
    throw new Unauthorized("401");
  }
  return res;
}

async function apiJSON(path, options) {
  const res = await api(path, options);
  let body = null;
  try { body = await res.json(); } catch (_) { body = { message: "not JSON (" + res.status + ")" }; }
  return { res, body };
}

function problem(body, res) {
  return (body && (body.error ? body.error + ": " : "") + (body.message || "")) || "HTTP " + res.status;
}

// -- the live stream of tasks (its own transport clock is the header's line) ------------------

const live = { lastId: null, abort: null, retries: 0, order: [], tasks: new Map(), at: null, woken: "" };
const ui = { task: null, wanted: null, explainFor: null, receiptFor: null };

function setLink(state, words) {
  const link = $("link");
  link.dataset.state = state;
  link.textContent = words;
}

function stopLive() {
  if (live.abort) live.abort.abort();
  live.abort = null;
}

async function connect() {
  if (!token()) return needToken();
  stopLive();
  const control = new AbortController();
  live.abort = control;
  $("token-form").hidden = true;
  $("token-forget").hidden = false;
  setLink("connecting", "connecting…");
  try {
    const headers = live.lastId ? { "Last-Event-ID": live.lastId } : {};
    const res = await api("/v1/events?follow=1", { headers, signal: control.signal });
    if (!res.ok) throw new Error("HTTP " + res.status);
    live.retries = 0;
    setLink("live", "live: the stream of tasks is open");
    await readEvents(res.body, onEvent);
  } catch (err) {
    if (err instanceof Unauthorized || control.signal.aborted) return;
  }
  if (control.signal.aborted) return;
  const wait = Math.min(10000, 500 * 2 ** live.retries++);
  setLink("retrying", "stream lost: reconnecting in " + (wait / 1000) + " s, resuming after event " + (live.lastId || "none"));
  setTimeout(() => { if (live.abort === control) connect(); }, wait);
}

async function readEvents(body, handle) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const event = { name: "message", id: null, data: [] };
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue; // a comment keeps the connection alive
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event.name = text;
        else if (field === "id") event.id = text;
        else if (field === "data") event.data.push(text);
      }
      if (event.data.length) handle(event.name, JSON.parse(event.data.join("\n")));
      if (event.id) live.lastId = event.id;
    }
  }
}

function onEvent(name, data) {
  if (name === "snapshot") {
    live.tasks = new Map(data.tasks.map((t) => [t.task, t]));
    live.order = data.order.slice();
    live.woken = data.woken_by;
  } else if (name === "tasks") {
    for (const view of data.tasks) {
      if (!live.tasks.has(view.task) && !live.order.includes(view.task)) live.order.unshift(view.task);
      live.tasks.set(view.task, view);
    }
  } else return;
  live.at = Date.now();
  setLink("live", "live (" + live.woken + "): last change seen " + new Date(live.at).toLocaleTimeString());
  renderTasks();
  if (ui.wanted && ui.wanted !== ui.task) selectWanted();
  else if (ui.task && live.tasks.has(ui.task)) renderTask(live.tasks.get(ui.task));
}

// The task the address names, once the stream shows it; one this token cannot see is said so.
function onAddress() {
  if (fragmentToken()) {
    tokenFromFragment();
    live.lastId = null;
    return connect();
  }
  const task = fragmentTask();
  if (task && task !== ui.task) { ui.wanted = task; selectWanted(); } else if (!task && ui.task) showNoTask();
}

function selectWanted() {
  if (live.tasks.has(ui.wanted)) return selectTask(ui.wanted, false);
  const wanted = ui.wanted;
  showNoTask();
  ui.wanted = wanted; // selected if the stream shows it later
  setText("empty-hint", "task " + wanted + " (from the address) is not among the tasks this token can see; select a task on the left");
}

// -- tasks -----------------------------------------------------------------------------------

function renderTasks() {
  const list = $("tasks");
  list.replaceChildren();
  for (const id of live.order) {
    const view = live.tasks.get(id);
    if (!view) continue;
    const livecount = view.sessions.filter((s) => ["admitted", "running", "settling"].includes(s.state)).length;
    const item = el("li", { data: { task: id, state: view.state }, class: id === ui.task ? "chosen" : "" },
      el("button", { click: () => selectTask(id) },
        el("code", null, id), " ", el("span", { class: "badge", data: { state: view.state } }, view.state),
        el("span", { class: "small" }, " " + view.sessions_total + " session(s)" + (livecount ? ", " + livecount + " live" : "")),
        el("span", { class: "small path" }, view.workspace)));
    list.append(item);
  }
  setText("tasks-note", live.order.length ? "" : "no task this token can see yet");
}

function selectTask(id, remember = true) {
  if (remember && id !== fragmentTask()) history.pushState(null, "", taskAddress(id)); // a link to it; Back returns
  ui.task = ui.wanted = id;
  ui.explainFor = ui.receiptFor = null;
  $("clock-detail").hidden = true;
  if (logState.task !== id) closeLog();
  $("empty-pane").hidden = true;
  $("task-pane").hidden = false;
  $("detail").scrollTop = 0;
  renderTasks();
  if (live.tasks.has(id)) renderTask(live.tasks.get(id));
}

function showNoTask() {
  ui.task = ui.wanted = null;
  closeLog();
  $("task-pane").hidden = true;
  $("empty-pane").hidden = false;
  setText("empty-hint", "Select a task on the left to see its sessions, their four clocks, its log and why it is (or is not) complete.");
  renderTasks();
}

function renderTask(view) {
  setText("task-id", view.task);
  $("task-state").dataset.state = view.state;
  setText("task-state", view.complete ? "complete" : view.state);
  setText("task-words", headline(view));
  setText("task-workspace", view.workspace);
  setText("task-steps", view.close_steps.length ? view.close_steps.join(" → ") : "none yet");
  const rows = $("session-rows");
  rows.replaceChildren(...view.sessions.map((s) => sessionRow(s)));
  const hidden = view.sessions_total - view.sessions.length;
  setText("sessions-note", hidden > 0 ? hidden + " older session(s) not shown" : (view.sessions.length ? "" : "no session yet"));
  const stamp = JSON.stringify([view.state, view.close_steps, view.sessions.map((s) => [s.session, s.state])]);
  if (ui.explainFor !== stamp) { ui.explainFor = stamp; loadExplain(view.task); }
  const closeDigest = view.close ? view.close.digest : null;
  if (ui.receiptFor !== closeDigest) { ui.receiptFor = closeDigest; loadCloseReceipt(view.task, closeDigest); }
}

function headline(view) {
  if (view.complete) return "complete: the close receipt below proves it (kind close, " + short(view.close && view.close.digest) + ")";
  if (view.state === "frozen") return "frozen: " + (view.frozen || "its host was declared vanished") + "; it admits nothing, recovery settles what it can prove";
  if (view.state === "open") return "open: admitting commands; closing it seals admission, settles every session and checkpoints the workspace";
  const owed = view.blocked_on ? view.blocked_on.authority + " owes " + view.blocked_on.obligation : "";
  if (view.blocked_on && view.state === "blocked") return "blocked: " + owed;
  if (view.blocked_on) return view.state + ": the close is under way; next, " + owed;
  return view.state + ": the close is under way";
}

const MARKS = { settled: "✓ settled", not_yet: "… not yet", unknown: "? unknown", incomplete: "! incomplete" };
const CLOCKS = ["transport", "process", "output", "workspace"];

function sessionRow(session) {
  const exit = session.exit ? (session.exit.signal ? "signal " + session.exit.signal : "exit " + session.exit.code) + " (" + session.exit.reason + ")" : "";
  return el("tr", { data: { session: session.session, state: session.state } },
    el("td", null, el("code", null, session.session), el("div", { class: "small" }, "key " + session.key)),
    el("td", { class: "command" }, session.command),
    el("td", null, session.state, el("div", { class: "small" }, exit),
      session.network ? el("div", { class: "small network", title: "what left the sandbox through settled's proxy (the session's ledger)" }, "network: " + session.network) : null),
    ...CLOCKS.map((name) => clockCell(session, name, session.clocks[name])),
    el("td", null, el("button", { click: () => openLog(session.session) }, "log")));
}

function clockCell(session, name, clock) {
  const when = clock.at ? "+" + (clock.at - session.created_at).toFixed(3) + " s" : "";
  const by = clock.by ? clock.by.kind + " " + short(clock.by.digest) : "";
  return el("td", {
    class: "clock", title: clock.words,
    data: { clock: name, state: clock.state, digest: clock.by ? clock.by.digest : "" },
    click: () => showClock(session, name, clock),
  }, el("span", { class: "mark" }, MARKS[clock.state] || clock.state),
     when ? el("span", { class: "when" }, when) : null,
     by ? el("span", { class: "by" }, by) : null);
}

function showClock(session, name, clock) {
  const box = $("clock-detail");
  box.hidden = false;
  box.replaceChildren(
    el("h3", null, name + " clock of ", el("code", null, session.session), ": " + (MARKS[clock.state] || clock.state)),
    el("p", null, "settled at " + iso(clock.at) + (clock.by ? " by the " + clock.by.kind + " receipt " : ""), clock.by ? el("code", null, clock.by.digest) : null),
    el("p", { class: "words" }, clock.words),
    el("details", null, el("summary", null, "facts (raw JSON)"), el("pre", null, json(clock.facts))));
}

async function loadExplain(task) {
  try {
    const { res, body } = await apiJSON("/v1/tasks/" + encodeURIComponent(task) + "/explain");
    if (ui.task !== task) return;
    setText("explain-brief", res.ok ? body.brief : problem(body, res));
    setText("explain-words", res.ok ? body.words : "");
    setText("explain-raw", json(body));
  } catch (err) { if (!(err instanceof Unauthorized)) setText("explain-brief", "explain failed: " + err); }
}

async function loadCloseReceipt(task, digest) {
  const section = $("close-receipt");
  if (!digest) { section.hidden = true; section.dataset.digest = ""; return; }
  try {
    const { res, body } = await apiJSON("/v1/tasks/" + encodeURIComponent(task) + "/clocks");
    if (ui.task !== task || !res.ok || !body.close_receipt) return;
    renderCloseReceipt(body.close_receipt);
  } catch (err) { if (!(err instanceof Unauthorized)) setText("close-note", "could not read the close receipt: " + err); }
}

function renderCloseReceipt(receipt) {
  const section = $("close-receipt");
  const outcome = receipt.outcome || {};
  const checkpoint = receipt.checkpoint || {};
  const readBack = checkpoint.read_back || {};
  const commands = Object.entries(outcome.commands || {}).filter(([, v]) => v.length).map(([k, v]) => k + " " + v.length);
  const rows = [
    ["complete", String(outcome.complete)],
    ["commands", commands.join(", ") || "none"],
    ["all commands succeeded", String(outcome.all_commands_succeeded)],
    ["sealed at", iso(receipt.sealed_at)],
    ["sessions", (receipt.sessions || []).map((s) => s.session + " (process receipt " + short(s.receipt) + ")" + (s.network ? ", network: " + s.network : "")).join("; ") || "none"],
    ["checkpoint", (checkpoint.manifest || "none") + " (receipt " + short(checkpoint.digest) + ")"],
    ["read back", readBack.verified ? "verified: " + readBack.rehashed + " of " + readBack.objects_reached + " objects re-hashed" : "NOT verified"],
    ["watermark", String(checkpoint.watermark)],
    ["fence", receipt.fence ? "generation " + receipt.fence.fenced_generation + " → " + receipt.fence.generation + " at " + iso(receipt.fence.fenced_at) : "none"],
    ["output incomplete", (outcome.output_incomplete || []).length ? json(outcome.output_incomplete) : "none"],
    ["final response", receipt.final === null || receipt.final === undefined ? "none" : String(receipt.final)],
    ["issued at", iso(receipt.issued_at)],
  ];
  $("close-summary").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", null, k), el("dd", null, v)]));
  setText("close-digest", receipt.digest);
  setText("close-raw", json(receipt));
  section.dataset.digest = receipt.digest;
  section.hidden = false;
}

// -- forms -----------------------------------------------------------------------------------

function newKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(8));
  return "ui_" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function seconds(text) { return text.trim() === "" ? undefined : Number(text); }

async function startSession(event) {
  event.preventDefault();
  const task = ui.task;
  const command = $("start-command").value;
  if (!task || !command.trim()) return setText("start-note", "type a command first");
  if (!$("start-key").value.trim()) $("start-key").value = newKey(); // kept until it answers: a retry reuses it
  const body = { key: $("start-key").value.trim(), shell: command, timeout: seconds($("start-timeout").value) };
  setText("start-note", "starting…");
  try {
    const { res, body: answer } = await apiJSON("/v1/tasks/" + encodeURIComponent(task) + "/sessions", { method: "POST", body });
    if (!res.ok) return setText("start-note", problem(answer, res));
    $("start-key").value = "";
    setText("start-note", "session " + answer.session + (answer.reused ? " (reused: same key, same command; nothing launched)" : " started"));
  } catch (err) {
    if (!(err instanceof Unauthorized)) setText("start-note", "no answer (" + err + "): press Start again, the same key never launches twice");
  }
}

async function closeTask(event) {
  event.preventDefault();
  const task = ui.task;
  const body = { final: $("close-final").value || undefined, deadline: seconds($("close-deadline").value) };
  setText("close-note", "closing: sealing admission, settling sessions, checkpointing…");
  try {
    const { res, body: answer } = await apiJSON("/v1/tasks/" + encodeURIComponent(task) + "/close", { method: "POST", body });
    if (res.status === 200) {
      setText("close-note", "complete");
      if (ui.task === task) { ui.receiptFor = answer.digest; renderCloseReceipt(answer); }
    } else if (res.status === 409) setText("close-note", "blocked on: " + json(answer.blocked_on));
    else setText("close-note", problem(answer, res));
  } catch (err) { if (!(err instanceof Unauthorized)) setText("close-note", "close failed: " + err + " (closing again resumes it)"); }
}

async function newTask(event) {
  event.preventDefault();
  const workspace = $("new-task-workspace").value.trim();
  try {
    const { res, body } = await apiJSON("/v1/tasks", { method: "POST", body: workspace ? { workspace } : {} });
    if (!res.ok) return setText("tasks-note", problem(body, res));
    setText("tasks-note", "task " + body.task + " created");
    selectTask(body.task);
  } catch (err) { if (!(err instanceof Unauthorized)) setText("tasks-note", "no answer: " + err); }
}

// -- a session's log, from a cursor ------------------------------------------------------------

const INVISIBLE = /[\u0080-\u009f\u00ad\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ufff9-\ufffb]/;

function hex2(n) { return n.toString(16).padStart(2, "0"); }

// UTF-8 decoding by hand, so every invalid byte is shown as itself. Returns [kind, text] runs
// ("text" or "esc") and the bytes of a sequence cut by the end of the page (when not `last`).
function decodeBytes(bytes, last) {
  const runs = [];
  let text = [], esc = [];
  const flush = () => {
    if (text.length) { runs.push(["text", text.join("")]); text = []; }
    if (esc.length) { runs.push(["esc", esc.join("")]); esc = []; }
  };
  const pushText = (s) => { if (esc.length) flush(); text.push(s); };
  const pushEsc = (s) => { if (text.length) flush(); esc.push(s); };
  let i = 0;
  while (i < bytes.length) {
    const b = bytes[i];
    if (b < 0x80) {
      if (b === 0x0a || b === 0x09 || (b >= 0x20 && b < 0x7f)) pushText(String.fromCharCode(b));
      else pushEsc("\\x" + hex2(b));
      i += 1;
      continue;
    }
    const need = b >= 0xc2 && b <= 0xdf ? 2 : b >= 0xe0 && b <= 0xef ? 3 : b >= 0xf0 && b <= 0xf4 ? 4 : 0;
    if (need && i + need > bytes.length && !last && validPrefix(bytes, i, bytes.length)) {
      flush();
      return { runs, rest: bytes.slice(i) };
    }
    const cp = need ? codePoint(bytes, i, need) : -1;
    if (cp < 0) { pushEsc("\\x" + hex2(b)); i += 1; continue; }
    const ch = String.fromCodePoint(cp);
    if (INVISIBLE.test(ch)) pushEsc("\\u" + cp.toString(16).padStart(4, "0"));
    else pushText(ch);
    i += need;
  }
  flush();
  return { runs, rest: new Uint8Array(0) };
}

function secondRange(lead) {
  if (lead === 0xe0) return [0xa0, 0xbf];
  if (lead === 0xed) return [0x80, 0x9f]; // no surrogates
  if (lead === 0xf0) return [0x90, 0xbf];
  if (lead === 0xf4) return [0x80, 0x8f];
  return [0x80, 0xbf];
}

function validPrefix(bytes, start, end) {
  for (let j = start + 1; j < end; j++) {
    const [lo, hi] = j === start + 1 ? secondRange(bytes[start]) : [0x80, 0xbf];
    if (bytes[j] < lo || bytes[j] > hi) return false;
  }
  return true;
}

function codePoint(bytes, i, need) {
  if (i + need > bytes.length || !validPrefix(bytes, i, i + need)) return -1;
  let cp = bytes[i] & (need === 2 ? 0x1f : need === 3 ? 0x0f : 0x07);
  for (let j = 1; j < need; j++) cp = (cp << 6) | (bytes[i + j] & 0x3f);
  return cp;
}

function renderText(bytes, stream, last) {
  const carried = logState.carry[stream] || new Uint8Array(0);
  const all = new Uint8Array(carried.length + bytes.length);
  all.set(carried);
  all.set(bytes, carried.length);
  const { runs, rest } = decodeBytes(all, last);
  logState.carry[stream] = rest;
  const node = el("span", { class: "chunk", data: { stream } });
  for (const [kind, text] of runs) node.append(kind === "esc" ? el("span", { class: "esc" }, text) : text);
  return node;
}

function renderHex(bytes, stream, cursor) {
  const lines = [];
  for (let i = 0; i < bytes.length; i += 16) {
    const row = bytes.subarray(i, i + 16);
    const hexes = Array.from(row, hex2).join(" ").padEnd(47);
    const ascii = Array.from(row, (b) => (b >= 0x20 && b < 0x7f ? String.fromCharCode(b) : ".")).join("");
    lines.push(String(cursor + i).padStart(12) + "  " + hexes + "  |" + ascii + "|");
  }
  return el("span", { class: "chunk hex", data: { stream } }, stream + "\n" + lines.join("\n") + "\n");
}

const logState = { task: null, session: null, stream: "merged", cursor: 0, start: 0, final: false, end: null, carry: {}, pages: [], dropped: null, busy: null, gen: 0, follow: null };

function openLog(session) {
  logState.task = ui.task;
  $("log-pane").hidden = false;
  setText("log-session", session);
  $("log-from").value = "0";
  const inView = () => $("log-pane").scrollIntoView({ block: "nearest" }); // beside its task's sessions
  inView();
  Promise.resolve(readLog()).then(inView); // again once its first page has made it taller
}

function closeLog() {
  $("log-pane").hidden = true;
  $("log-follow").checked = false;
  Object.assign(logState, { task: null, session: null, gen: logState.gen + 1 }); // answers still on their way land nowhere
}

function readLog(event) {
  if (event) event.preventDefault();
  const cursor = Number($("log-from").value.trim() || "0");
  if (!Number.isSafeInteger(cursor) || cursor < 0) return setText("log-note", "a cursor is a whole number of bytes, 0 or more");
  Object.assign(logState, {
    session: $("log-session").textContent, stream: $("log-stream").value, cursor, start: cursor, final: false,
    end: null, carry: {}, pages: [], dropped: null, gen: logState.gen + 1,
  });
  const out = $("log-out");
  out.replaceChildren();
  delete out.dataset.cursor; // set again once the first page is read
  delete out.dataset.final;
  return nextPage();
}

// One read at a time per reading; a new reading (Read, another session) makes the answers of
// an older one arrive to nothing.
async function nextPage() {
  const gen = logState.gen;
  if (logState.busy === gen || !logState.session) return 0;
  logState.busy = gen;
  try {
    return await (logState.stream === "merged" ? mergedPage(gen) : streamPage(gen));
  } catch (err) {
    if (!(err instanceof Unauthorized) && gen === logState.gen) setText("log-note", "read failed: " + err);
    return 0;
  } finally { if (logState.busy === gen) logState.busy = null; }
}

function pageSize() { return Number($("log-page").value); }
function hexView() { return $("log-view").value === "hex"; }

async function mergedPage(gen) {
  const s = logState;
  const from = s.cursor;
  const { res, body } = await apiJSON("/v1/sessions/" + encodeURIComponent(s.session) + "/merged?from=" + from + "&max=" + pageSize());
  if (gen !== s.gen) return 0;
  if (!res.ok) { setText("log-note", problem(body, res)); return 0; }
  const chunks = body.chunks.map((c) => ({ ...c, bytes: base64Bytes(c.data) }));
  const last = body.final && chunks.length === 0;
  const nodes = chunks.map((c) => (hexView() ? renderHex(c.bytes, c.stream, c.stream_cursor) : renderText(c.bytes, c.stream, false)));
  if (body.final && !hexView() && body.cursor === from) nodes.push(...flushCarry());
  s.cursor = body.cursor;
  s.final = body.final;
  showPage(from, s.cursor, nodes);
  note(from, last);
  return s.cursor - from;
}

async function streamPage(gen) {
  const s = logState;
  const from = s.cursor;
  const res = await api("/v1/sessions/" + encodeURIComponent(s.session) + "/output?stream=" + s.stream + "&from=" + from + "&max=" + pageSize());
  if (gen !== s.gen) return 0;
  if (!res.ok) {
    let body = null;
    try { body = await res.json(); } catch (_) { body = null; }
    setText("log-note", problem(body, res));
    return 0;
  }
  const bytes = new Uint8Array(await res.arrayBuffer());
  if (gen !== s.gen) return 0;
  const finalCursor = res.headers.get("Settled-Final-Cursor");
  s.end = finalCursor === null ? null : Number(finalCursor);
  s.cursor = from + bytes.length;
  s.final = s.end !== null && s.cursor >= s.end;
  const nodes = [];
  if (bytes.length) nodes.push(hexView() ? renderHex(bytes, s.stream, from) : renderText(bytes, s.stream, s.final));
  if (s.final && !hexView()) nodes.push(...flushCarry());
  showPage(from, s.cursor, nodes);
  note(from, s.final && !bytes.length);
  return bytes.length;
}

function flushCarry() {
  const nodes = [];
  for (const [stream, rest] of Object.entries(logState.carry)) {
    if (rest.length) { logState.carry[stream] = new Uint8Array(0); nodes.push(renderText(rest, stream, true)); }
  }
  return nodes;
}

function base64Bytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

function showPage(from, to, nodes) {
  if (!nodes.length) return;
  const out = $("log-out");
  const page = el("span", { class: "page", data: { from, to } }, ...nodes);
  out.append(page);
  logState.pages.push(page);
  while (logState.pages.length > SHOWN_PAGES) {
    const gone = logState.pages.shift();
    logState.dropped = Number(gone.dataset.to);
    gone.remove();
  }
}

function note(from, atEnd) {
  const s = logState;
  const unit = s.stream === "merged" ? "merged cursor" : s.stream + " cursor";
  const first = s.dropped !== null ? s.dropped : s.start;
  let words = "showing [" + first + ", " + s.cursor + ") by " + unit + " (last read from " + from + "); next page from " + s.cursor;
  if (s.final) words += atEnd || (s.end !== null && s.cursor >= s.end) ? "; end of the log: final" : "; the log is final";
  else words += "; the session may still write";
  if (s.dropped !== null) words += "; bytes before " + s.dropped + " are no longer shown (read from a cursor to see them)";
  setText("log-note", words);
  $("log-out").dataset.cursor = String(s.cursor);
  $("log-out").dataset.final = String(s.final);
}

async function followLog() {
  const ticket = (logState.follow = {});
  while ($("log-follow").checked && logState.follow === ticket) {
    const got = await nextPage();
    if (!got && logState.final) { $("log-follow").checked = false; break; }
    if (!got) await new Promise((resolve) => setTimeout(resolve, FOLLOW_MS));
  }
}

// -- start -----------------------------------------------------------------------------------

function start() {
  tokenFromFragment();
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token-input").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("token-input").value = "";
    live.lastId = null;
    connect();
  });
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    live.tasks = new Map();
    live.order = [];
    live.lastId = null;
    showNoTask();
    needToken();
  });
  $("new-task").addEventListener("submit", newTask);
  $("start").addEventListener("submit", startSession);
  $("close").addEventListener("submit", closeTask);
  $("log-form").addEventListener("submit", readLog);
  $("log-next").addEventListener("click", () => nextPage());
  $("log-follow").addEventListener("change", () => { if ($("log-follow").checked) followLog(); });
  window.addEventListener("hashchange", onAddress); // a link with #token=… or #task=… to an open page
  window.addEventListener("popstate", onAddress); // Back and Forward between selected tasks
  if (token()) connect(); else needToken();
}

document.addEventListener("DOMContentLoaded", start);
