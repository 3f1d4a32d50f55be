// The gateway's chat page: sessions, history, and a reply streaming in that survives a
// page refresh and a gateway restart. No build step, no library.
//
// A turn being written is kept in localStorage ("pipeline.turn") from before it is sent
// until its reply has ended: its Idempotency-Key (so sending it again never makes two
// turns), its completion id once known, the text rendered so far and the position of
// the last chunk rendered (its event_id). A page loaded while a turn is kept resumes it
// from there with Last-Event-ID, on whichever gateway answers.
"use strict";

const KEY = "pipeline.apiKey";
const TURN = "pipeline.turn";
const SESSION = "pipeline.session";
const MODEL = "pipeline.model";

const $ = (id) => document.getElementById(id);
// Errors inside a stream that pass: a stream dropped for falling behind, a dependency away.
const PASSING = new Set(["stream_lagging", "log_unavailable", "store_unavailable",
                         "projection_lagging"]);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
  // A refusal worth trying again later (the service is away or busy), not a bad request.
  get retryable() { return this.status >= 500 || this.status === 429; }
}

function randomKey() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function headers(extra = {}) {
  const out = { "Content-Type": "application/json", ...extra };
  const key = localStorage.getItem(KEY);
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

async function failure(resp) {
  const body = await resp.json().catch(() => ({}));
  const error = body.error || {};
  return new ApiError(resp.status, error.message || resp.statusText, error.code);
}

async function api(method, path, body) {
  const resp = await fetch(path, {
    method, headers: headers(), body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}

function say(text) { $("status").textContent = text || ""; }

// -- server-sent events over fetch (EventSource cannot send an Authorization header) ----
async function* sseData(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const message = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = message.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

// -- rendering -----------------------------------------------------------------------
function bubble(role, text, requestId) {
  const li = document.createElement("li");
  li.className = role;
  li.textContent = text;
  if (requestId) li.dataset.requestId = requestId;
  $("messages").append(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

async function loadSessions() {
  const list = await api("GET", "/v1/sessions?limit=50");
  const current = localStorage.getItem(SESSION);
  $("sessions").replaceChildren(...list.data.map((s) => {
    const li = document.createElement("li");
    li.textContent = s.title || "(untitled)";
    li.dataset.sessionId = s.id;
    li.classList.toggle("current", s.id === current);
    li.addEventListener("click", () => openSession(s.id).catch(show));
    return li;
  }));
}

async function openSession(id) {
  if (turn.running) return;  // one reply at a time
  localStorage.setItem(SESSION, id);
  for (const li of $("sessions").children) {
    li.classList.toggle("current", li.dataset.sessionId === id);
  }
  const history = await api("GET", `/v1/sessions/${id}/messages`);
  $("messages").replaceChildren();
  for (const m of history.data) bubble(m.role, m.content, m.request_id);
  return history.data;
}

// -- a turn ---------------------------------------------------------------------------
const turn = { running: false };

function keep(pending) { localStorage.setItem(TURN, JSON.stringify(pending)); }
function kept() {
  try { return JSON.parse(localStorage.getItem(TURN)); } catch { return null; }
}

function streaming(on) {
  turn.running = on;
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// The request that (re)opens the stream: the first POST, sent again with the same
// Idempotency-Key until the turn's id is known, then GETs after the last position.
function open(pending) {
  if (!pending.completion) {
    return fetch(`/v1/sessions/${pending.session}/messages`, {
      method: "POST", headers: headers({ "Idempotency-Key": pending.key }),
      body: JSON.stringify({ content: pending.content, model: pending.model, stream: true }),
    });
  }
  const after = pending.lastEventId ? { "Last-Event-ID": pending.lastEventId } : {};
  return fetch(`/v1/chat/completions/${pending.completion}/stream`, { headers: headers(after) });
}

// Reads the turn to its end, reconnecting (with backoff) whenever the stream breaks.
async function follow(pending, reply) {
  streaming(true);
  reply.dataset.state = "streaming";
  let attempt = 0;
  try {
    for (;;) {
      try {
        const resp = await open(pending);
        if (!resp.ok) throw await failure(resp);
        pending.completion = pending.completion || resp.headers.get("X-Request-Id");
        reply.dataset.requestId = pending.completion;
        if (!pending.lastEventId) pending.text = "";  // the stream starts over
        keep(pending);
        say("");
        for await (const data of sseData(resp)) {
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          pending.completion = pending.completion || chunk.id;
          if (chunk.error) {
            // Resume where we are, or after a while, from a refusal that passes;
            // anything else is the turn's own end (it failed, or timed out): show it
            // once and stop, for a retry would only read the same end again.
            if (PASSING.has(chunk.error.code)) break;
            throw new ApiError(422, chunk.error.message, chunk.error.code);
          }
          for (const choice of chunk.choices || []) pending.text += choice.delta.content || "";
          if (chunk.event_id) pending.lastEventId = chunk.event_id;
          keep(pending);
          reply.textContent = pending.text;
          attempt = 0;
        }
      } catch (error) {
        if (error instanceof ApiError && !error.retryable) throw error;
      }
      attempt += 1;
      say(`Connection lost; reconnecting (attempt ${attempt})…`);
      await sleep(Math.min(250 * 2 ** attempt, 5000));
    }
  } catch (error) {
    reply.classList.add("error");
    reply.textContent = `${pending.text}\n[${error.message}]`;
  } finally {
    reply.dataset.state = "done";
    localStorage.removeItem(TURN);
    streaming(false);
    loadSessions().catch(show);
  }
}

async function send(content) {
  let session = localStorage.getItem(SESSION);
  if (!session) {
    session = (await api("POST", "/v1/sessions", {})).id;
    localStorage.setItem(SESSION, session);
  }
  const pending = { session, key: randomKey(), content, model: $("model").value,
                    completion: null, lastEventId: null, text: "" };
  keep(pending);  // before sending: a refresh now sends it again, under the same key
  bubble("user", content);
  await follow(pending, bubble("assistant", ""));
}

// A turn left running by an earlier page: show what it had, then carry on from there.
async function resumeKept() {
  const pending = kept();
  if (!pending) return false;
  let history;
  try {
    history = await openSession(pending.session);
  } catch (error) {
    if (error.status !== 404) throw error;
    localStorage.removeItem(TURN);  // its session is gone (deleted, or another key's)
    localStorage.removeItem(SESSION);
    return false;
  }
  const mine = history.filter((m) => pending.completion && m.request_id === pending.completion);
  if (mine.some((m) => m.role === "assistant")) {  // it ended and is stored
    localStorage.removeItem(TURN);
    return true;
  }
  if (!mine.length) bubble("user", pending.content);
  follow(pending, bubble("assistant", pending.text, pending.completion));
  return true;
}

function show(error) { say(error.message || String(error)); }

// What the server holds for this key: models, sessions, and a turn to resume.
async function load() {
  try {
    const models = await api("GET", "/v1/models");
    const chosen = localStorage.getItem(MODEL);
    $("model").replaceChildren(...models.data.map((m) => new Option(m.id, m.id, false,
                                                                     m.id === chosen)));
    await loadSessions();
    say("");
  } catch (error) {
    say(error.status === 401 ? "Enter an API key to continue." : error.message);
    return;
  }
  if (turn.running || await resumeKept()) return;
  const session = localStorage.getItem(SESSION);
  if (session) await openSession(session).catch(() => localStorage.removeItem(SESSION));
}

function init() {
  $("api-key").value = localStorage.getItem(KEY) || "";
  $("key-form").onsubmit = (e) => {
    e.preventDefault();
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(KEY, key); else localStorage.removeItem(KEY);
    load().catch(show);
  };
  $("model").onchange = () => localStorage.setItem(MODEL, $("model").value);
  $("new-chat").onclick = () => {
    if (turn.running) return;
    localStorage.removeItem(SESSION);
    $("messages").replaceChildren();
    loadSessions().catch(show);
  };
  $("composer").onsubmit = (e) => {
    e.preventDefault();
    const content = $("prompt").value.trim();
    if (!content || turn.running) return;
    $("prompt").value = "";
    send(content).catch(show);
  };
  $("stop").onclick = () => {
    const pending = kept();
    if (pending && pending.completion) {
      api("POST", `/v1/chat/completions/${pending.completion}/cancel`).catch(show);
    }
  };
}

init();
load().catch(show).finally(() => { document.body.dataset.ready = "true"; });
