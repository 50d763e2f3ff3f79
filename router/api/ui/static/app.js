// The chat playground at /: a chat streamed from /v1/chat/completions with the model, sampling
// parameters and system prompt chosen here, and the models' lifecycle through /v1/models.
import { ApiError, call, errorMessage, setKeyAsker, sseData } from "./client.js";

const $ = (id) => document.getElementById(id);
const TRANSIENT_STATES = new Set(["downloading", "starting", "stopping"]);

// this chat's messages, the system prompt left out; a new chat is a new array, so an answer
// still ending adds to the chat it belongs to
let history = [];
let models = []; // GET /v1/models's, as last read
let answering = null; // the AbortController of the answer being streamed
let refreshTimer = null;

function showError(error) {
  $("error").textContent = error instanceof Error ? error.message : String(error);
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
}

// runs an event's work, showing what went wrong instead of losing it in the console
const guarded = (work) => (...args) => work(...args).catch(showError);

function modelPath(id) {
  // an id may hold one '/': kept raw, each segment encoded
  return id.split("/").map(encodeURIComponent).join("/");
}

// --- models

function stateText(model) {
  const progress = model.metadata?.progress;
  if (model.state === "downloading" && progress?.bytes_total) {
    return `downloading ${Math.floor((100 * progress.bytes_done) / progress.bytes_total)}%`;
  }
  return model.state ?? "";
}

function fillModelSelect(models) {
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren(...models.map((model) => {
    const label = model.state === "running" ? model.id : `${model.id} (${model.state})`;
    return new Option(label, model.id);
  }));
  const running = models.find((model) => model.state === "running");
  if (models.some((model) => model.id === chosen)) select.value = chosen;
  else if (running) select.value = running.id;
  updateAttach();
}

// an image can be attached only for a model that takes images (its metadata says so)
function updateAttach() {
  const chosen = models.find((model) => model.id === $("model").value);
  const takesImages = chosen?.metadata?.takes_images === true;
  $("image").disabled = !takesImages;
  $("attach").classList.toggle("disabled", !takesImages);
  if (!takesImages) $("image").value = "";
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function lifecycleButton(label, model, action) {
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = label;
  button.dataset.action = action;
  button.onclick = guarded(async () => {
    button.disabled = true;
    setTimeout(guarded(refreshModels), 300); // shows "starting" or "stopping" while the call waits
    try {
      await call(`v1/models/${modelPath(model.id)}/${action}`, { method: "PUT" });
    } finally {
      await refreshModels();
    }
  });
  return button;
}

function modelRow(model) {
  const row = document.createElement("tr");
  row.dataset.id = model.id;
  const name = document.createElement("td");
  name.textContent = model.id;
  name.title = [model.source_url, model.metadata?.size].filter(Boolean).join(" · ");
  const state = document.createElement("td");
  state.textContent = stateText(model);
  if (model.metadata?.error) {
    state.title = model.metadata.error;
    state.classList.add("failed");
  }
  const actions = document.createElement("td");
  if (["downloaded", "stopped"].includes(model.state)) {
    actions.append(lifecycleButton("Start", model, "start"));
  } else if (model.state === "running") {
    actions.append(lifecycleButton("Stop", model, "stop"));
  }
  row.append(name, state, actions);
  return row;
}

async function refreshModels() {
  clearTimeout(refreshTimer);
  const reply = await (await call("v1/models")).json();
  models = reply.data ?? [];
  fillModelSelect(models);
  document.querySelector("#models tbody").replaceChildren(...models.map(modelRow));
  if (models.some((model) => TRANSIENT_STATES.has(model.state))) {
    refreshTimer = setTimeout(guarded(refreshModels), 1500);
  }
}

async function pull(event) {
  event.preventDefault();
  const body = { model: $("pull-source").value.trim() };
  const id = $("pull-id").value.trim();
  if (id) body.id = id;
  const reply = await (await call("v1/models/pull", { method: "POST", body })).json();
  $("pull-source").value = "";
  $("pull-id").value = "";
  $("pull-status").textContent = reply.message ?? `${reply.id}: ${reply.state}`;
  await refreshModels();
}

// --- chat

function addMessage(role, text = "", image = null) {
  const message = document.createElement("div");
  message.className = `message ${role}`;
  if (image) {
    const picture = document.createElement("img");
    picture.className = "attached";
    picture.src = image;
    picture.alt = "attached image";
    message.append(picture);
  }
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  message.append(reasoning, content);
  $("messages").append(message);
  message.scrollIntoView({ block: "end" });
  return { message, reasoning, content };
}

function numberField(id) {
  const value = $(id).valueAsNumber;
  return Number.isNaN(value) ? undefined : value;
}

function chatBody() {
  const system = $("system").value.trim();
  return {
    model: $("model").value || "tgi",
    messages: [...(system ? [{ role: "system", content: system }] : []), ...history],
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    max_tokens: numberField("max-tokens"),
  };
}

function showStats({ started, firstAt, lastAt, tokens }) {
  if (!firstAt) return;
  const seconds = (lastAt - firstAt) / 1000;
  // the decoding rate: the first token's wait (the prompt's prefill) is shown apart
  const rate = tokens > 1 && seconds > 0
    ? (tokens - 1) / seconds : tokens / ((lastAt - started) / 1000);
  $("stats").textContent = `${tokens} tokens · ${rate.toFixed(1)} tokens/s · `
    + `first token after ${Math.round(firstAt - started)} ms`;
}

async function streamAnswer(view, signal) {
  const chat = history;
  const stats = { started: performance.now(), firstAt: 0, lastAt: 0, tokens: 0 };
  let text = "";
  let usage = null;
  const response = await call("v1/chat/completions", { method: "POST", body: chatBody(), signal });
  try {
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(0, errorMessage(chunk));
      usage = chunk.usage ?? usage;
      const delta = chunk.choices?.[0]?.delta;
      if (!delta) continue;
      stats.tokens += 1;
      stats.lastAt = performance.now();
      stats.firstAt ||= stats.lastAt;
      if (delta.reasoning_content) {
        view.reasoning.hidden = false;
        view.reasoning.textContent += delta.reasoning_content;
      }
      text += delta.content ?? "";
      view.content.textContent = text;
      view.message.scrollIntoView({ block: "end" });
      showStats(stats);
    }
  } finally {
    // what came before an error or the stop button stays in the chat
    if (text) chat.push({ role: "assistant", content: text });
    if (usage?.completion_tokens) stats.tokens = usage.completion_tokens;
    showStats(stats);
  }
}

function setAnswering(controller) {
  answering = controller;
  $("send").disabled = controller !== null;
  $("stop").disabled = controller === null;
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || answering) return;
  clearError();
  const file = $("image").files[0];
  // the image as a data: URL in an image_url part, before the text, as OpenAI's clients send it
  const image = file ? await readDataUrl(file) : null;
  $("prompt").value = "";
  $("image").value = "";
  $("stats").textContent = "";
  const chat = history;
  chat.push({ role: "user", content: image ? [{ type: "image_url", image_url: { url: image } },
                                              { type: "text", text: prompt }] : prompt });
  addMessage("user", prompt, image);
  const view = addMessage("assistant");
  const controller = new AbortController();
  setAnswering(controller);
  try {
    await streamAnswer(view, controller.signal);
  } catch (error) {
    if (error.name === "AbortError") {
      view.message.classList.add("stopped");
      return;
    }
    view.message.classList.add("failed");
    view.content.textContent ||= error.message;
    if (chat.at(-1)?.role === "user") chat.pop(); // unanswered: a retry sends it again
    throw error;
  } finally {
    setAnswering(null);
  }
}

function newChat() {
  answering?.abort();
  history = [];
  $("messages").replaceChildren();
  $("stats").textContent = "";
  clearError();
}

function askForKeyInDialog(why) {
  const dialog = $("key-dialog");
  $("key-why").textContent = why;
  $("key-input").value = "";
  dialog.returnValue = ""; // Escape closes it without a value: not the last time's "ok"
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      resolve(dialog.returnValue === "ok" ? $("key-input").value : null);
    }, { once: true });
  });
}

setKeyAsker(askForKeyInDialog);
$("key-cancel").addEventListener("click", () => $("key-dialog").close("cancel"));
$("composer").addEventListener("submit", guarded(send));
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => answering?.abort());
$("clear").addEventListener("click", newChat);
$("model").addEventListener("change", updateAttach);
$("pull-form").addEventListener("submit", guarded(pull));
guarded(refreshModels)();
