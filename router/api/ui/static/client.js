// Calls from the pages to this server: the API key (--api-key), error messages in every shape
// the router answers, and Server-Sent Events read from a fetch body.

const KEY_STORAGE = "tgi-py.api-key";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function authHeaders() {
  const key = localStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// how a page asks for the key: (why) => the key, or null when the user declines
let askForKey = async (why) => window.prompt(`${why}\nAPI key:`);
let pendingKey = null;

export function setKeyAsker(ask) {
  askForKey = ask;
}

function keyFromUser(why) {
  // calls refused at the same time share one question
  pendingKey ??= askForKey(why).finally(() => { pendingKey = null; });
  return pendingKey;
}

// TGI's {error, error_type}, OpenAI's and SGLang's {error: {message, ...}}, or whatever came
export function errorMessage(body) {
  if (typeof body?.error === "string") return body.error;
  if (typeof body?.error?.message === "string") return body.error.message;
  if (typeof body?.message === "string") return body.message;
  return JSON.stringify(body);
}

async function readError(response) {
  const text = await response.text();
  let message;
  try {
    message = errorMessage(JSON.parse(text));
  } catch {
    message = text.trim() || response.statusText;
  }
  return `${response.status}: ${message}`;
}

// fetch `path` (relative to the page, so a prefix a proxy adds is kept) with the stored key;
// a 401 asks for the key and tries again; any other error status throws an ApiError with the
// server's message
export async function call(path, { method = "GET", body, signal } = {}) {
  for (;;) {
    const headers = authHeaders();
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (response.ok) return response;
    const message = await readError(response);
    if (response.status === 401) {
      const key = await keyFromUser(localStorage.getItem(KEY_STORAGE)
        ? "The server refused the stored API key." : "This server needs an API key.");
      if (key) {
        localStorage.setItem(KEY_STORAGE, key.trim());
        continue;
      }
    }
    throw new ApiError(response.status, message);
  }
}

// the data of each event of an SSE body, as it arrives
export async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  const dataOf = (event) => event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
    .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (const event of events) {
        const data = dataOf(event);
        if (data) yield data;
      }
    }
    const last = dataOf(buffer);
    if (last) yield last;
  } finally {
    // a reader that stops early (an error event, the stop button) closes the connection
    await reader.cancel().catch(() => {});
  }
}
