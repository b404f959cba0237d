// The calculator's page: builds the question from the form (the keyword arguments of
// pipeline.estimate.estimate), asks the server for the formula's answer while the user types and
// for the exact one after, and draws what comes back. Vanilla JS, no build step, nothing from a CDN.
"use strict";

const GIB = 2 ** 30;
const MAX_UPLOAD = 1 << 20; // the server's limit on a request body
const FORMULA_DELAY_MS = 150;
const EXACT_DELAY_MS = 600;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

const state = {
  models: [], byId: new Map(), gpus: [], accuracy: {}, info: {}, client: "loop", settingAccuracy: new Map(),
  gen: 0, q: null, formula: null, formulaError: null, exact: null, exactError: null,
  searches: {}, curve: [], layouts: null, exactQueue: new Map(), exactBusy: false, timers: {},
};

const EXAMPLES = {
  qlora: {model: "meta-llama/Llama-3.1-8B", batch: 4, seq: 4096, precision: "bf16", lora_r: 16,
          quantization: "nf4", gpu: "RTX 4090"},
  full7b: {model: "Qwen/Qwen2.5-7B", batch: 1, seq: 2048, precision: "bf16", gpu: "H100 80GB"},
  trainer: {model: "HuggingFaceTB/SmolLM2-135M", batch: 8, seq: 1024, precision: "amp-bf16", client: "trainer",
            optim: "adamw_torch_fused", gradient_accumulation: 4, gpu: "T4"},
};
const DEFAULT = {model: "meta-llama/Llama-3.2-1B", batch: 4, seq: 2048, precision: "bf16", gpu: "H100 80GB"};

// The command line's flag of each field, in the order the copied command lists them.
const FLAGS = [["batch", "--batch"], ["seq", "--seq"], ["precision", "--precision"],
  ["weights_dtype", "--weights-dtype"], ["client", "--client"],
  ["optimizer", "--optimizer"], ["optim", "--optim"], ["gradient_accumulation", "--gradient-accumulation"],
  ["checkpointing", "--checkpointing"], ["lora_r", "--lora-r"], ["lora_alpha", "--lora-alpha"],
  ["lora_targets", "--lora-targets"], ["lora_dropout", "--lora-dropout"], ["quantization", "--quantization"], ["num_gpus", "--num-gpus"],
  ["sharding", "--sharding"], ["shard_group", "--shard-group"], ["tensor_parallel", "--tensor-parallel"],
  ["accelerate_config", "--accelerate-config"], ["gpu", "--gpu"], ["gpu_memory_gib", "--gpu-memory"],
  ["expandable_segments", "--expandable-segments"], ["liger_kernel", "--liger-kernel"],
  ["packing", "--packing"], ["padding_free", "--padding-free"], ["lengths", "--lengths"], ["layouts", "--layouts"],
  ["min_gpus", "--min-gpus"], ["num_generations", "--num-generations"],
  ["max_completion_length", "--max-completion-length"], ["beta", "--beta"],
  ["axolotl_config", "--axolotl-config"], ["llamafactory_config", "--llamafactory-config"]];
// A pasted file is named by the file it would be on the command line (the server takes its content).
// The document lengths likewise: the command reads them from a file (--lengths FILE), one count per line.
const FILE_NAMES = {accelerate_config: "accelerate_config.yaml", axolotl_config: "axolotl.yaml",
  llamafactory_config: "llamafactory.yaml", lengths: "lengths.txt"};
// The clients that run a Trainer (its optim, accumulation and Liger), and TRL's, which checkpoint by default;
// GRPO and RLOO generate their completions in the step (completions per prompt, their length, beta).
const TRAINER_CLIENTS = ["trainer", "sft", "dpo", "grpo", "rloo"];
const TRL_CLIENTS = ["sft", "dpo", "grpo", "rloo"];
const ROLLOUT_CLIENTS = ["grpo", "rloo"];
const ROLLOUT_FIELDS = ["num_generations", "max_completion_length", "beta"];
const PACKING_FIELDS = ["packing", "padding_free"];  // TRL's SFTTrainer's packed batches (client sft)
const LINK_LENGTHS = 2000;  // the document lengths a shareable link holds (the first ones)
const NUMBER_FIELDS = ["batch", "seq", "gradient_accumulation", "lora_r", "lora_alpha", "lora_dropout", "num_gpus",
  "shard_group",
  "tensor_parallel", "gpu_memory_gib", ...ROLLOUT_FIELDS];
const LAYOUT_FIELDS = ["num_gpus", "sharding", "shard_group", "tensor_parallel"];  // the layouts table varies them
const DEFAULT_LAYOUTS_LIMIT = 8;  // the library's: estimate --layouts without --num-gpus

// Which field a server message is about: the first rule whose words it holds.
const ERROR_FIELDS = [
  ["lengths", /^lengths\b|document lengths/i],
  ["accelerate_config", /accelerate/i],
  ["packing", /packing|padding_free|padding-free/i],
  ["shard_group", /shard_group|shard group/i],
  ["tensor_parallel", /tensor_parallel|tensor parallel/i],
  ["adapters", /lora|quantiz|adapter|peft/i],
  ["sharding", /sharding|num_gpus|GPUs/],
  ["gpu", /\bgpu\b|gpu_memory|GiB/i],
  ["gradient_accumulation", /accumulation/i],
  ["optim", /\boptim\b|optim '/],
  ["optimizer", /optimizer/i],
  ["client", /client/i],
  ["precision", /precision/i],
  ["batch", /batch/i],
  ["seq", /\bseq\b|sequence/i],
];

const NAMES = {parameters: "weights", gradients: "gradients", optimizer_state: "optimizer state",
  optimizer_intermediates: "optimizer temporaries", activations: "activations", loss_backward: "logits and loss",
  workspaces: "workspaces", unsharded_parameters: "unsharded parameters (FSDP)", all_gather: "all-gather buffers",
  reduce_scatter: "reduce-scatter buffers (FSDP)", ddp_buckets: "gradient buckets (DDP)",
  slack: "allocator slack (reserved − allocated)", outside: "outside PyTorch (CUDA context, driver)"};
const COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2", "#edc948", "#9c755f", "#ff9da7"];
const SLACK_COLOR = "#c9c9c9", OUTSIDE_COLOR = "#7f7f7f";

class FieldError extends Error {
  constructor(field, message) { super(message); this.field = field; }
}

// ---------- formatting ----------
const gib = (bytes) => `${(bytes / GIB).toFixed(2)} GiB`;
const pct = (x) => `${(100 * x).toFixed(1)}%`;
function count(n) {
  if (n == null) return "?";
  for (const [unit, size] of [["T", 1e12], ["B", 1e9], ["M", 1e6], ["k", 1e3]]) {
    if (n >= size) return `${(n / size).toFixed(n >= 10 * size ? 0 : 1)}${unit}`;
  }
  return String(n);
}
function tokens(n) {
  if (n >= 1 << 20) return `${+(n / (1 << 20)).toFixed(1)}M`;
  if (n >= 1 << 10) return `${+(n / (1 << 10)).toFixed(1)}k`;
  return String(n);
}
function sh(text) {
  return /^[A-Za-z0-9_.\/:=,+@-]+$/.test(text) ? text : `'${text.replace(/'/g, `'\\''`)}'`;
}
function py(value) {
  if (value === true) return "True";
  if (value === false) return "False";
  if (value === null) return "None";
  return JSON.stringify(value);
}
function el(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

// ---------- the form ----------
function fillSelect(id, values, labels = {}) {
  const select = $(id);
  select.replaceChildren(...values.map((v) => {
    const option = document.createElement("option");
    option.value = v; option.textContent = labels[v] || v;
    return option;
  }));
}

function numberOrText(id) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const n = Number(raw);
  return Number.isFinite(n) ? n : raw; // the server names what is wrong with it
}

function question() {
  const q = {};
  const source = document.querySelector("input[name=source]:checked").value;
  if (source === "model") {
    const typed = $("model").value.trim();
    if (!typed) throw new FieldError("model", "choose a model from the list, or type a Hugging Face id (owner/name)");
    const model = resolveModel(typed);
    if (!model) {
      throw new FieldError("model", `no registry model is called ${JSON.stringify(typed)}: pick one from the list`);
    }
    q.model = model;
  } else if (source === "framework") {
    return frameworkQuestion();
  } else {
    const text = $("config").value.trim();
    if (!text) throw new FieldError("config", "paste a config.json, or choose the file");
    let config;
    try { config = JSON.parse(text); } catch (e) { throw new FieldError("config", `not valid JSON: ${e.message}`); }
    if (config === null || typeof config !== "object" || Array.isArray(config)) {
      throw new FieldError("config", "a config.json is a JSON object");
    }
    q.config = config;
  }
  for (const name of ["batch", "seq"]) {
    const v = numberOrText(name);
    if (v !== undefined) q[name] = v;
  }
  const client = $("client").value;
  Object.assign(q, precisionWords(client));
  if (client !== "loop") q.client = client;
  if (TRAINER_CLIENTS.includes(client)) {
    q.optim = $("optim").value;
    const k = numberOrText("gradient_accumulation");
    if (k !== undefined && k !== 1) q.gradient_accumulation = k;
    if ($("liger_kernel").checked) q.liger_kernel = true;
  } else if ($("optimizer").value !== "adamw") {
    q.optimizer = $("optimizer").value;
  }
  if (ROLLOUT_CLIENTS.includes(client)) {
    for (const name of ROLLOUT_FIELDS) {
      const v = numberOrText(name);
      if (v !== undefined) q[name] = v;
    }
  }
  if (client === "sft") {
    for (const name of PACKING_FIELDS) if ($(name).checked) q[name] = true;
    const lengths = documentLengths();
    if (lengths) q.lengths = lengths;
  }
  if (TRL_CLIENTS.includes(client)) q.checkpointing = $("checkpointing").checked;  // on unless told otherwise
  else if ($("checkpointing").checked) q.checkpointing = true;
  const adapters = $("adapters").value;
  if (adapters !== "none") {
    const r = numberOrText("lora_r");
    q.lora_r = r === undefined ? "" : r;
    const alpha = numberOrText("lora_alpha");
    if (alpha !== undefined) q.lora_alpha = alpha;
    const targets = $("lora_targets").value.trim();
    if (targets && targets !== state.info.all_linear) q.lora_targets = targets;
    const dropout = numberOrText("lora_dropout");
    if (dropout !== undefined && dropout !== 0) q.lora_dropout = dropout;
    if (adapters === "qlora") q.quantization = $("quantization").value;
  }
  const gpus = numberOrText("num_gpus");
  if (gpus !== undefined && gpus !== 1) q.num_gpus = gpus;
  const sharding = $("sharding").value;
  if (sharding) q.sharding = sharding;
  if (sharding === "hsdp") {
    const group = numberOrText("shard_group");
    q.shard_group = group === undefined ? "" : group;
  }
  const tp = numberOrText("tensor_parallel");
  if (client === "loop" && tp !== undefined && tp !== 1) q.tensor_parallel = tp;
  const accelerate = $("accelerate_config").value.trim();
  if (accelerate) q.accelerate_config = parseAccelerate(accelerate);
  withGpu(q);
  if (q.lengths && JSON.stringify(q).length > MAX_UPLOAD) {
    throw new FieldError("lengths", `${q.lengths.length.toLocaleString("en")} document lengths are over the `
      + "server's 1 MiB limit on a request: the command takes any number (--lengths FILE)");
  }
  return q;
}

// A dataset's document lengths as pasted (token counts between commas, spaces or new lines), or undefined for
// none: the answer adds the dataset's worst step. Anything but a whole number is a message beside the box.
function documentLengths() {
  const words = $("lengths").value.split(/[\s,]+/).filter(Boolean);
  if (!words.length) return undefined;
  const bad = words.find((w) => !/^\d+$/.test(w) || !Number.isSafeInteger(Number(w)));
  if (bad !== undefined) {
    const shown = bad.length > 24 ? `${bad.slice(0, 24)}…` : bad;
    throw new FieldError("lengths", `document lengths: ${JSON.stringify(shown)} is not a whole number of tokens `
      + "(token counts separated by commas, spaces or new lines)");
  }
  return words.map(Number);
}

// A question without its document lengths: the searches and the curve's points, which do not use them.
function withoutLengths(q) {
  const {lengths, ...rest} = q;
  return rest;
}

// The GPU of a question (from the catalogue, or its memory) and the allocator's expandable segments.
function withGpu(q) {
  if ($("gpu").value === "custom") {
    const memory = numberOrText("gpu_memory_gib");
    q.gpu_memory_gib = memory === undefined ? "" : memory;
  } else {
    q.gpu = $("gpu").value;
  }
  if ($("expandable_segments").checked) q.expandable_segments = true;
  return q;
}

// A framework file's question: the file as it is (the server parses its YAML), the GPU and the number of GPUs.
function frameworkQuestion() {
  const text = $("framework_file").value.trim();
  if (!text) throw new FieldError("framework_file", "paste the Axolotl or LLaMA-Factory YAML file, or choose it");
  const q = {[$("framework_kind").value]: text};
  const gpus = numberOrText("num_gpus");
  if (gpus !== undefined && gpus !== 1) q.num_gpus = gpus;
  return withGpu(q);
}

// An accelerate config as the server takes it (a JSON object): the JSON, or the YAML `accelerate config` writes
// (mappings nested by indentation, scalars, [] and {}); what else YAML allows is a message beside the field.
function parseAccelerate(text) {
  const field = "accelerate_config";
  if (text.startsWith("{")) {
    let value;
    try { value = JSON.parse(text); } catch (e) { throw new FieldError(field, `not valid JSON: ${e.message}`); }
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      throw new FieldError(field, "an accelerate config is a mapping of its keys");
    }
    return value;
  }
  const root = {};
  const stack = [{indent: -1, node: root}];
  const bare = [];  // keys with nothing after the colon: a mapping if lines follow, else null
  text.split(/\r?\n/).forEach((raw, i) => {
    const line = raw.replace(/\s+#.*$/, "");
    const body = line.trim();
    if (!body || body.startsWith("#") || body === "---") return;
    const indent = line.length - line.trimStart().length;
    const pair = body.match(/^([A-Za-z0-9_.-]+):(?:\s+(.*))?$/);
    if (!pair) throw new FieldError(field, `line ${i + 1} is not "key: value": paste the file's YAML or JSON`);
    while (indent <= stack[stack.length - 1].indent) stack.pop();
    const parent = stack[stack.length - 1].node;
    if (pair[2] === undefined) {
      parent[pair[1]] = {};
      bare.push([parent, pair[1]]);
      stack.push({indent, node: parent[pair[1]]});
    } else {
      parent[pair[1]] = yamlScalar(pair[2]);
    }
  });
  for (const [parent, key] of bare) if (!Object.keys(parent[key]).length) parent[key] = null;
  return root;
}

function yamlScalar(text) {
  const t = text.trim();
  if (/^'.*'$/.test(t)) return t.slice(1, -1).replace(/''/g, "'");
  if (/^".*"$/.test(t)) return JSON.parse(t);
  if (t === "[]") return [];
  if (t === "{}") return {};
  if (/^(true|True|TRUE)$/.test(t)) return true;
  if (/^(false|False|FALSE)$/.test(t)) return false;
  if (/^(null|Null|NULL|~)$/.test(t)) return null;
  if (/^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(t)) return Number(t);
  return t;
}

// ---------- precision in the Trainer's words ----------
// A trainer client is asked what its user knows: the dtype the weights are loaded in and TrainingArguments'
// bf16 / fp16; the precision they make is the server's table (info.precision_modes: vocabulary.precision_of).
function precisionOf(weights, autocast) {
  const found = Object.entries(state.info.precision_modes)
    .find(([, mode]) => mode.weights === weights && (mode.autocast || "") === autocast);
  return found ? found[0] : null;
}

function trainerWords(precision) {
  const mode = state.info.precision_modes[precision] || {weights: "bf16", autocast: null};
  return {weights: mode.weights, autocast: mode.autocast || ""};
}

function setTrainerWords(words) {
  $("weights_dtype").value = words.weights;
  $("autocast").value = words.autocast;
  const precision = precisionOf(words.weights, words.autocast);
  if (precision) $("precision").value = precision;
}

// The question's precision fields: the loop's precision; a trainer client's from the weights and its mixed
// precision, and for TRL's trainers on their default bf16=True the command's own words (--weights-dtype bf16
// makes bf16-autocast, as `estimate --client sft` does).
function precisionWords(client) {
  if (!TRAINER_CLIENTS.includes(client)) return {precision: $("precision").value};
  const weights = $("weights_dtype").value, autocast = $("autocast").value;
  const precision = precisionOf(weights, autocast);
  if (!precision) {
    throw new FieldError("autocast",
      `${autocast} autocast on ${weights} weights is not a precision this project models`);
  }
  return TRL_CLIENTS.includes(client) && autocast === "bf16" ? {weights_dtype: weights} : {precision};
}

// Choosing a client keeps the precision the user set, in the new client's words; TRL's trainers tick bf16=True
// (their default) as they tick checkpointing.
function clientChanged() {
  const client = $("client").value;
  const words = TRAINER_CLIENTS.includes(state.client)
    ? {weights: $("weights_dtype").value, autocast: $("autocast").value} : trainerWords($("precision").value);
  if (TRL_CLIENTS.includes(client)) {
    $("checkpointing").checked = true;
    if (!words.autocast) words.autocast = "bf16";
  }
  setTrainerWords(words);
  state.client = client;
}

// A registry id, or the one registry model whose name (after the owner) is the text, or an owner/name id.
function resolveModel(text) {
  if (state.byId.has(text)) return text;
  const lower = text.toLowerCase();
  const hits = state.models.filter((m) => m.id.toLowerCase() === lower || m.id.toLowerCase().endsWith(`/${lower}`));
  if (hits.length === 1) return hits[0].id;
  return text.includes("/") ? text : null;
}

function setForm(q) {
  const source = q.config ? "config" : "model";
  document.querySelector(`input[name=source][value=${source}]`).checked = true;
  if (q.model !== undefined) $("model").value = q.model;
  if (q.config) $("config").value = JSON.stringify(q.config, null, 2);
  $("batch").value = q.batch ?? "";
  $("seq").value = q.seq ?? "";
  const client = q.client || "loop";
  $("client").value = client;
  state.client = client;
  $("precision").value = q.precision || "bf16";
  setTrainerWords(q.precision ? trainerWords(q.precision)
    : {weights: q.weights_dtype || "bf16", autocast: TRL_CLIENTS.includes(client) ? "bf16" : ""});
  $("optimizer").value = q.optimizer || "adamw";
  $("optim").value = q.optim || "adamw_torch_fused";
  $("gradient_accumulation").value = q.gradient_accumulation ?? 1;
  $("checkpointing").checked = q.checkpointing ?? TRL_CLIENTS.includes(q.client);
  $("liger_kernel").checked = !!q.liger_kernel;
  for (const name of PACKING_FIELDS) $(name).checked = !!q[name];
  $("lengths").value = Array.isArray(q.lengths) ? q.lengths.join(", ") : q.lengths ?? "";
  for (const name of ROLLOUT_FIELDS) $(name).value = q[name] ?? "";
  $("adapters").value = q.quantization ? "qlora" : q.lora_r ? "lora" : "none";
  $("lora_r").value = q.lora_r ?? 16;
  $("lora_alpha").value = q.lora_alpha ?? "";
  $("lora_targets").value = q.lora_targets || state.info.all_linear || "all-linear";
  $("lora_dropout").value = q.lora_dropout ?? "";
  $("quantization").value = q.quantization || "nf4";
  $("num_gpus").value = q.num_gpus ?? 1;
  $("sharding").value = q.sharding || "";
  $("shard_group").value = q.shard_group ?? 8;
  $("tensor_parallel").value = q.tensor_parallel ?? 1;
  $("accelerate_config").value = q.accelerate_config ? JSON.stringify(q.accelerate_config, null, 2) : "";
  $("accelerate-box").open = !!q.accelerate_config;
  if (q.gpu_memory_gib !== undefined) {
    $("gpu").value = "custom";
    $("gpu_memory_gib").value = q.gpu_memory_gib;
  } else {
    $("gpu").value = q.gpu || DEFAULT.gpu;
  }
  $("expandable_segments").checked = !!q.expandable_segments;
  showBoxes();
}

function showBoxes() {
  const source = document.querySelector("input[name=source]:checked").value;
  $("model-box").hidden = source !== "model";
  $("config-box").hidden = source !== "config";
  $("framework-box").hidden = source !== "framework";
  for (const node of document.querySelectorAll(".from-file")) node.hidden = source === "framework";  // the file's
  const trainer = TRAINER_CLIENTS.includes($("client").value);
  $("precision-box").hidden = trainer;
  $("trainer-precision-box").hidden = !trainer;
  const made = precisionOf($("weights_dtype").value, $("autocast").value);
  $("precision-hint").textContent = made ? `precision ${made}` : "";
  $("optimizer-box").hidden = trainer;
  $("optim-box").hidden = !trainer;
  $("accumulation-box").hidden = !trainer;
  $("liger-box").hidden = !trainer;
  $("packing-box").hidden = $("client").value !== "sft";
  $("rollout-box").hidden = !ROLLOUT_CLIENTS.includes($("client").value);
  const adapters = $("adapters").value;
  for (const node of document.querySelectorAll(".lora-only")) node.hidden = adapters === "none";
  $("quantization").disabled = adapters !== "qlora";
  $("gpu-memory-box").hidden = $("gpu").value !== "custom";
  const framework = source === "framework";  // the file names its sharding
  $("shard-group-box").hidden = framework || $("sharding").value !== "hsdp";
  $("tensor-parallel-box").hidden = framework || $("client").value !== "loop";
  modelHint();
}

function modelHint() {
  const typed = $("model").value.trim();
  const model = typed ? resolveModel(typed) : null;
  const entry = model && state.byId.get(model);
  let hint = "";
  if (entry) {
    hint = `${model === typed ? "" : `${model} · `}${entry.family} · ${entry.model_type} · ${count(entry.parameters)} parameters`
      + (entry.active_parameters && entry.active_parameters !== entry.parameters ? ` (${count(entry.active_parameters)} active)` : "")
      + (entry.context_length ? ` · context ${entry.context_length.toLocaleString("en")}` : "")
      + (entry.trust_remote_code ? " · needs remote code, which the server does not run" : "");
  } else if (model && model.includes("/")) {
    hint = "not in the registry: its config.json is read from the Hugging Face Hub when the server can reach it";
  }
  $("model-hint").textContent = hint;
}

function writeHash(q) {
  if (q.config || q.axolotl_config || q.llamafactory_config) { history.replaceState(null, "", location.pathname); return; }
  const params = new URLSearchParams();
  for (const [k, v] of Object.entries(q)) {
    if (k === "lengths") params.set(k, v.slice(0, LINK_LENGTHS).join(","));
    else params.set(k, typeof v === "object" ? JSON.stringify(v) : String(v));
  }
  history.replaceState(null, "", `#${params}`);
}

function readHash() {
  if (location.hash.length < 2) return null;
  const q = {};
  for (const [k, v] of new URLSearchParams(location.hash.slice(1))) {
    q[k] = NUMBER_FIELDS.includes(k) ? Number(v) : v === "true" ? true : v;
    if (k === "accelerate_config") {
      try { q[k] = JSON.parse(v); } catch { delete q[k]; }
    }
  }
  return q.model ? q : null;
}

// ---------- errors beside the fields ----------
function clearErrors() {
  for (const node of document.querySelectorAll(".error")) node.textContent = "";
  for (const node of document.querySelectorAll(".invalid")) node.classList.remove("invalid");
}

function fieldOf(message) {
  const source = document.querySelector("input[name=source]:checked").value;
  if (source === "config" && /config|model_type|field '|shape/i.test(message)) return "config";
  if (source === "framework" && !/\bgpu\b|gpu_memory|num_gpus/i.test(message)) return "framework_file";
  for (const [field, words] of ERROR_FIELDS) if (words.test(message)) return field;
  return source;
}

function showError(field, message) {
  if (field === "precision" && TRAINER_CLIENTS.includes($("client").value)) field = "autocast";
  const box = $(`error-${field}`) || $(`error-${document.querySelector("input[name=source]:checked").value}`);
  box.textContent = message;
  const input = $(field);
  if (input) input.classList.add("invalid");
}

// ---------- talking to the server ----------
async function ask(q) {
  const started = performance.now();
  let status = 0, body;
  try {
    const response = await fetch("/api/estimate", {method: "POST", headers: {"Content-Type": "application/json"},
                                                   body: JSON.stringify(q)});
    status = response.status;
    try { body = await response.json(); } catch { body = {error: `the server answered HTTP ${status}`}; }
  } catch (e) {
    body = {error: `the server cannot be reached (${e.message})`};
  }
  return {ok: status === 200, status, body, seconds: (performance.now() - started) / 1000};
}

function changed() {
  showBoxes();
  const gen = ++state.gen;
  clearErrors();
  clearTimeout(state.timers.formula);
  clearTimeout(state.timers.exact);
  state.timers.exact = null;
  state.exactQueue.clear();
  Object.assign(state, {formula: null, formulaError: null, exact: null, exactError: null, searches: {}, curve: [],
                        layouts: null});
  let q;
  try {
    q = question();
  } catch (e) {
    if (!(e instanceof FieldError)) throw e;
    showError(e.field, e.message);
    setStatus("");
    state.q = null;
    render();
    return;
  }
  state.q = q;
  writeHash(q);
  setStatus("formula: asking…");
  render();
  state.timers.formula = setTimeout(() => runFormula(gen, q), FORMULA_DELAY_MS);
  state.timers.exact = setTimeout(askExact, EXACT_DELAY_MS);
}

// The exact answer of the question shown (once the typing pauses, or at once when a table is asked before).
function askExact() {
  clearTimeout(state.timers.exact);
  state.timers.exact = null;
  queueExact(state.gen, "estimate", {...state.q, method: "exact"});
}

async function runFormula(gen, q) {
  const f = {...q, method: "formula"};
  const bare = withoutLengths(f);  // the searches' values and the curve do not depend on the lengths
  const [main, batch, seq] = await Promise.all([ask(f), ask({...bare, max_batch_size: true}),
                                                ask({...bare, max_seq_len: true})]);
  if (gen !== state.gen) return;
  if (!main.ok) {
    state.formulaError = main.body.error;
    if (!state.exact) {
      clearErrors();
      showError(fieldOf(main.body.error), main.body.error);
    }
    render();
    return;
  }
  state.formula = main.body;
  state.formulaSeconds = main.seconds;
  state.searches.mbsFormula = batch.ok ? batch.body.max_batch_size : null;
  state.searches.mslFormula = seq.ok ? seq.body.max_seq_len : null;
  render();
  const points = await Promise.all(curveSeqs(q).map((s) => ask({...bare, seq: s})));
  if (gen !== state.gen) return;
  state.curve = points.filter((p) => p.ok).map((p) => p.body);
  render();
}

function curveSeqs(q) {
  const seq = Number(q.seq), batch = Number(q.batch) || 1;
  if (!Number.isInteger(seq) || seq < 1) return [];
  const entry = q.model ? state.byId.get(q.model) : null;
  const context = entry && entry.context_length;
  const seqs = new Set([seq]);
  const k = Math.round(Math.log2(seq));
  for (let i = k - 5; i <= k + 3; i++) {
    const s = 2 ** i;
    if (s >= 16 && (!context || s <= context) && batch * s <= 1 << 24) seqs.add(s);
  }
  return [...seqs].sort((a, b) => a - b);
}

// The exact simulations run one at a time on the server: the page keeps at most one of each kind
// waiting (the latest question's: estimate, mbs, msl, layouts) and drops those of a question that changed
// meanwhile.
function queueExact(gen, kind, q) {
  state.exactQueue.set(kind, {gen, q});
  if (!state.exactBusy) pumpExact();
}

async function pumpExact() {
  state.exactBusy = true;
  while (state.exactQueue.size) {
    // the answer's own simulation first (seconds), then the searches and tables in the order they were asked
    const kind = state.exactQueue.has("estimate") ? "estimate" : state.exactQueue.keys().next().value;
    const job = state.exactQueue.get(kind);
    state.exactQueue.delete(kind);
    if (job.gen !== state.gen) continue;
    const started = performance.now();
    const show = kind === "layouts" ? setLayoutsStatus : setStatus;
    const progress = () => kind === "layouts" && state.layouts && state.layouts.progress
      && !state.layouts.progress.finished && state.layouts.progress;
    const tick = setInterval(() => show(progress() ? progressText(progress())
      : statusText(((performance.now() - started) / 1000).toFixed(0), kind)), 500);
    show(statusText(0, kind));
    if (kind === "layouts") {
      const shown = state.layouts;
      const result = await streamLayouts(job.q, (progress) => {
        if (state.layouts !== shown || job.gen !== state.gen) return;
        shown.progress = progress;
        renderLayouts();
      });
      clearInterval(tick);
      if (shown && shown.progress) shown.progress.finished = true;
      if (job.gen !== state.gen) continue;
      show("");
      if (!shown || state.layouts !== shown || shown.exactQuestion !== job.q) continue;  // the other button meanwhile
      if (result.ok) Object.assign(shown, {exact: result.body, exactSeconds: result.seconds, progress: null});
      else shown.exactError = result.body.error;
      renderLayouts();
      continue;
    }
    const result = await ask(job.q);
    clearInterval(tick);
    if (job.gen !== state.gen) continue;
    if (kind === "estimate") {
      if (result.ok) {
        state.exact = result.body;
        state.exactSeconds = result.seconds;
        clearErrors();
      } else {
        state.exactError = result.body.error;
        clearErrors();
        showError(fieldOf(result.body.error), result.body.error);
      }
    } else {
      const key = kind === "mbs" ? "max_batch_size" : "max_seq_len";
      state.searches[`${kind}Exact`] = result.ok ? result.body[key] : `error: ${result.body.error}`;
      state.searches[`${kind}Seconds`] = result.seconds;
    }
    render();
  }
  state.exactBusy = false;
}

// The exact layouts as the server simulates them (/api/layouts: one JSON event a line): `onProgress` gets the rows
// so far ({rows: {layout: row}, done, total}) after each; the answer at the end, or the error (a stop at the
// server's time limit among them: the rows sent before it stay shown).
async function streamLayouts(q, onProgress) {
  const started = performance.now();
  const progress = {rows: {}, done: 0, total: null, started};
  let response;
  try {
    response = await fetch("/api/layouts", {method: "POST", headers: {"Content-Type": "application/json"},
                                            body: JSON.stringify(q)});
  } catch (e) {
    return {ok: false, body: {error: `the server cannot be reached (${e.message})`}};
  }
  if (response.status !== 200) {
    let body;
    try { body = await response.json(); } catch { body = {error: `the server answered HTTP ${response.status}`}; }
    return {ok: false, body};
  }
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), {stream: !done});
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 1);
      if (!line) continue;
      const event = JSON.parse(line);
      const seconds = (performance.now() - started) / 1000;
      if (event.event === "start") progress.total = event.layouts;
      else if (event.event === "count") progress.total = (progress.total || 0) + event.layouts;
      else if (event.event === "row") {
        progress.rows[event.row.layout] = event.row;
        progress.done += 1;
        onProgress(progress);
      } else if (event.event === "end") return {ok: true, body: event.answer, seconds};
      else if (event.event === "stopped") {
        return {ok: false, body: {error: `${event.reason} after ${progress.done} exact rows (shown; the others are `
                                         + "the formula's)"}};
      } else if (event.event === "error") return {ok: false, body: {error: event.error}};
    }
    if (done) return {ok: false, body: {error: "the server's answer ended before the table did"}};
  }
}

function statusText(seconds, kind) {
  const what = {estimate: "exact: simulating the step", mbs: "exact: searching the largest batch",
    msl: "exact: searching the longest sequence", layouts: "exact: simulating each layout"}[kind];
  return `${what}… ${seconds} s`;
}

function setLayoutsStatus(text) { $("layouts-status").textContent = text; }

function setStatus(text) { $("status").textContent = text; }

// ---------- drawing the answer ----------
function render() {
  const a = state.exact || state.formula;
  const answer = $("answer");
  answer.dataset.method = a ? a.method : "";
  answer.dataset.gen = String(state.gen);
  if (!a) {
    const v = $("verdict");
    v.className = "verdict pending";
    v.dataset.fits = "";
    v.textContent = state.q ? (state.formulaError && !state.exactError ? "Waiting for the exact answer…" : state.exactError
      ? "No answer: see the message beside the field." : "Estimating…") : "Fill in the question.";
    for (const id of ["peak", "reserved", "headroom"]) { $(id).textContent = "–"; $(id).dataset.bytes = ""; }
    $("method").textContent = "";
    renderWorstStep(null);
    if (state.exactError) setStatus("");
    // the exact method's message is beside the field; the formula's is a note while the exact one is awaited
    $("notes").textContent = state.formulaError && state.q && !state.exactError ? `formula: ${state.formulaError}` : "";
    $("bar").replaceChildren();
    $("plot").replaceChildren();
    renderSearches();
    renderLayouts();
    renderCopies(null);
    return;
  }
  renderVerdict(a);
  $("peak").textContent = gib(a.peak_bytes); $("peak").dataset.bytes = String(a.peak_bytes);
  $("reserved").textContent = gib(a.peak_reserved_bytes); $("reserved").dataset.bytes = String(a.peak_reserved_bytes);
  if ("headroom_bytes" in a) {
    $("headroom").textContent = gib(a.headroom_bytes); $("headroom").dataset.bytes = String(a.headroom_bytes);
  }
  renderWorstStep(a);
  const method = $("method");
  method.dataset.method = a.method;
  method.replaceChildren(methodLabel(a.method, a === state.exact ? state.exactSeconds : state.formulaSeconds),
    document.createElement("br"), accuracyLine(a));
  if (state.exact && state.formula) {
    method.append(document.createElement("br"),
      `formula said ${gib(state.formula.peak_bytes)} allocated, ${gib(state.formula.peak_reserved_bytes)} reserved`);
  }
  if (state.exact) setStatus("");
  else if (state.exactError) setStatus(`exact: ${state.exactError}`);
  const notes = [];
  if (state.formulaError && state.exact) notes.push(`formula: ${state.formulaError}`);
  if (a.expandable_segments_would_fit && !a.fits) {
    notes.push("It fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (no segment fragmentation).");
  }
  $("notes").textContent = notes.join(" ");
  drawBar(a);
  renderSearches();
  renderLayouts();
  drawPlot(a);
  renderCopies(a);
}

// The dataset's worst step (the answer's worst_step, for the document lengths asked): one line under the figures.
function renderWorstStep(a) {
  const line = $("worst-step");
  const w = a && a.worst_step;
  line.hidden = !w;
  line.dataset.documents = w ? String(w.documents) : "";
  line.dataset.tokens = w ? String(w.tokens) : "";
  line.dataset.fits = w && "fits" in w ? String(w.fits) : "";
  line.dataset.method = w ? a.method : "";
  if (!w) { line.textContent = ""; return; }
  const verdict = !("fits" in w) ? "" : w.fits ? `; fits, ${gib(w.headroom_bytes)} of headroom`
    : `; does not fit, ${gib(-w.headroom_bytes)} short`;
  line.textContent = `Worst step of your ${w.documents.toLocaleString("en")} document${w.documents === 1 ? "" : "s"}: `
    + `${w.tokens.toLocaleString("en")} tokens, peak ${gib(w.peak_bytes)} allocated, ${gib(w.peak_reserved_bytes)} `
    + `reserved${verdict} (${a.method})`;
}

function methodLabel(method, seconds) {
  const span = document.createElement("span");
  const what = method === "exact" ? "the step simulated on meta tensors" : method === "formula"
    ? "closed form from the config" : method;
  let text = `method: ${method} (${what})`;
  if (seconds != null) text += ` · answered in ${seconds.toFixed(2)} s`;
  span.textContent = text;
  return span;
}

// ---------- the measured accuracy of the setting asked ----------
// The setting an answer names, in estimate's words (the answer's own fields: what was estimated).
function settingQuery(a) {
  const params = new URLSearchParams({client: a.client || "loop", precision: a.precision});
  if (a.adapter) {
    params.set("lora_r", String(a.adapter.lora_r));
    if (a.adapter.quantization) params.set("quantization", a.adapter.quantization);
  }
  if (a.liger_kernel) params.set("liger_kernel", "true");
  if (a.padding_free) params.set("padding_free", "true");
  if (a.num_gpus > 1) {
    params.set("num_gpus", String(a.num_gpus));
    if (a.sharding) params.set("sharding", a.sharding);
    if (a.tensor_parallel > 1) params.set("tensor_parallel", String(a.tensor_parallel));
  }
  return params.toString();
}

// The server's answer for the setting (null while it is asked: the answer is drawn again when it comes).
function settingAccuracy(a) {
  const key = settingQuery(a);
  if (!state.settingAccuracy.has(key)) {
    state.settingAccuracy.set(key, null);
    getJSON(`/api/setting-accuracy?${key}`)
      .then((found) => {
        state.settingAccuracy.set(key, found.error ? {methods: {}, label: "", missing: found.error} : found);
        render();
      })
      .catch(() => state.settingAccuracy.delete(key));
  }
  return state.settingAccuracy.get(key);
}

function accuracyLine(a) {
  const span = document.createElement("span");
  span.id = "setting-accuracy";
  const found = settingAccuracy(a);
  const acc = found && found.methods[a.method];
  span.dataset.split = acc ? acc.split : "";
  span.dataset.points = acc ? String(acc.points) : "";
  if (!found) {
    span.textContent = "measured accuracy of this setting: asking…";
  } else if (!acc) {
    span.textContent = found.missing ? `measured accuracy: ${found.missing}`
      : `measured accuracy (${found.label}): none for the ${a.method} method`;
  } else {
    const several = found.setting.num_gpus > 1
      ? `; ${found.setting.layout} on ${acc.gpu_counts.join(" and ")} GPUs` : "";
    const gpus = acc.devices.map((d) => d.replace(/^NVIDIA /, "")).join(", ") + several;
    span.textContent = `measured |error| of the peak on this setting (${found.label}): median ${pct(acc.median)}, `
      + `90th percentile ${pct(acc.p90)}, worst ${pct(acc.worst)} over ${acc.points.toLocaleString("en")} `
      + `${acc.split} GPU peaks (${gpus}); fit verdict right for ${pct(acc.fit_accuracy)} of ${acc.fit_points} `
      + `(${found.source})`;
  }
  return span;
}

function gpuWords(a) {
  return state.gpus.some((g) => g.name === a.gpu) ? `the ${a.gpu}` : `a GPU of ${a.gpu}`;
}

function gpuLabel(a) {
  return state.gpus.some((g) => g.name === a.gpu) ? `${a.gpu}: ${gib(a.device_total_bytes)}` : `GPU: ${gib(a.device_total_bytes)}`;
}

function renderVerdict(a) {
  const v = $("verdict");
  if (!("fits" in a)) {
    v.className = "verdict pending"; v.dataset.fits = ""; v.textContent = "No GPU chosen: no verdict."; return;
  }
  const perGpu = a.num_gpus > 1 ? `, each GPU of ${layoutWords(a)}` : "";
  const head = a.fits ? `Fits on ${gpuWords(a)}${perGpu}: ${gib(a.headroom_bytes)} of headroom`
    : `Does not fit on ${gpuWords(a)}${perGpu}: ${gib(-a.headroom_bytes)} short`;
  const detail = `reserved ${gib(a.peak_reserved_bytes)} + ${gib(a.outside_bytes)} outside PyTorch `
    + `${a.fits ? "≤" : ">"} ${gib(a.device_total_bytes)} (${a.method})`;
  v.className = `verdict ${a.fits ? "fits" : "nofit"}`;
  v.dataset.fits = String(a.fits);
  const strong = document.createElement("strong");
  strong.textContent = head;
  const small = document.createElement("small");
  small.textContent = detail;
  v.replaceChildren(strong, small);
}

// A layout as the library describes it (training.layout.Layout.describe): "16 GPUs, hsdp (2 replicas x 8 shards)".
function layoutWords(a) {
  const parts = [`${a.num_gpus} GPU${a.num_gpus > 1 ? "s" : ""}`];
  if (a.sharding === "hsdp") {
    parts.push(`hsdp (${a.num_gpus / a.tensor_parallel / a.shard_group} replicas x ${a.shard_group} shards)`);
  } else if (a.sharding) {
    parts.push(a.sharding);
  }
  if (a.tensor_parallel > 1) parts.push(`tensor parallel ${a.tensor_parallel}`);
  return parts.join(", ");
}

function renderSearches() {
  const q = state.q || {};
  $("mbs-label").textContent = `largest batch${q.seq ? ` at seq ${q.seq}` : ""}`;
  $("msl-label").textContent = `longest sequence${q.batch ? ` at batch ${q.batch}` : ""}`;
  for (const kind of ["mbs", "msl"]) {
    const f = state.searches[`${kind}Formula`];
    $(`${kind}-formula`).textContent = f == null ? "–" : f === 0 ? "0: none fits" : String(f);
    $(`${kind}-formula`).dataset.value = f == null ? "" : String(f);
    const e = state.searches[`${kind}Exact`];
    const seconds = state.searches[`${kind}Seconds`];
    $(`${kind}-exact`).textContent = e == null ? "" : typeof e === "number"
      ? `${e === 0 ? "0: none fits" : e} (${seconds.toFixed(1)} s)` : e;
    $(`${kind}-exact`).dataset.value = typeof e === "number" ? String(e) : "";
    $(`${kind}-run`).disabled = !state.q;
  }
}

function drawBar(a) {
  const parts = Object.entries(a.components || {}).filter(([, v]) => v > 0)
    .map(([k, v], i) => ({name: NAMES[k] || k, key: k, bytes: v, color: COLORS[i % COLORS.length]}));
  const sum = parts.reduce((s, p) => s + p.bytes, 0);
  if (a.peak_reserved_bytes > sum) parts.push({name: NAMES.slack, key: "slack", bytes: a.peak_reserved_bytes - sum, color: SLACK_COLOR});
  if (a.outside_bytes) parts.push({name: NAMES.outside, key: "outside", bytes: a.outside_bytes, color: OUTSIDE_COLOR});
  const total = parts.reduce((s, p) => s + p.bytes, 0);
  const gpu = a.device_total_bytes || 0;
  const W = 640, H = 64, left = 8, right = 8, top = 18, barH = 28;
  const scale = (W - left - right) / Math.max(total, gpu) / 1.04;
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "components of the peak"});
  let x = left;
  for (const p of parts) {
    const w = p.bytes * scale;
    const rect = el("rect", {x, y: top, width: Math.max(w, 0.5), height: barH, fill: p.color});
    rect.append(el("title", {}, `${p.name}: ${gib(p.bytes)}`));
    svg.append(rect);
    x += w;
  }
  if (gpu) {
    const gx = left + gpu * scale;
    svg.append(el("line", {x1: gx, x2: gx, y1: 8, y2: top + barH + 6, stroke: "#c0392b", "stroke-width": 2}));
    const anchor = gx < 110 ? "start" : gx > W - 110 ? "end" : "middle";
    svg.append(el("text", {x: anchor === "start" ? gx - 2 : Math.min(gx, W - 4), y: 12, "text-anchor": anchor,
                           class: "gpu-label"}, gpuLabel(a)));
  }
  svg.append(el("text", {x: left, y: H - 2, class: "axis"}, "0"));
  const legend = document.createElement("ul");
  legend.className = "legend";
  for (const p of parts) {
    const li = document.createElement("li");
    const swatch = el("svg", {width: 12, height: 12, viewBox: "0 0 12 12"});
    swatch.append(el("rect", {width: 12, height: 12, fill: p.color}));
    li.append(swatch, ` ${p.name} `);
    const b = document.createElement("b");
    b.textContent = gib(p.bytes);
    b.dataset.component = p.key;
    b.dataset.bytes = String(p.bytes);
    li.append(b);
    legend.append(li);
  }
  const caption = document.createElement("p");
  caption.className = "hint";
  const formula = (a.peak_formula || "").trim();
  // GRPO / RLOO: every phase of the step (generation and the log-prob passes beside the training micro-batch)
  const phases = a.phase_peaks ? ` By phase: ${Object.entries(a.phase_peaks).map(([p, v]) => `${p} ${gib(v)}`)
    .join(", ")}.` : "";
  // packed or padding-free SFT batches: the command's line (estimate/cli.py human_summary)
  const packed = a.padding_free ? ` ${a.packing ? "Packed rows" : "Padding-free rows"}: each micro-batch one row of `
    + `${(a.batch_size * a.seq_len).toLocaleString("en")} tokens (every row full), position ids restarting at each `
    + "document." : "";
  caption.textContent = `${a.method}${a.peak_phase ? `, peak in the ${a.peak_phase}` : ""}: ${formula}`
    + `${formula && !formula.endsWith(".") ? "." : ""}${phases}${packed} After the parts: the allocator's cached `
    + "slack and what CUDA takes outside PyTorch; the red line is the GPU.";
  $("bar").replaceChildren(svg, legend, caption);
}

function drawPlot(a) {
  const curve = state.curve.filter((p) => p.batch_size === a.batch_size);
  const marks = [state.formula, state.exact].filter(Boolean);
  const all = [...curve, ...marks];
  if (!all.length) { $("plot").replaceChildren(); return; }
  const W = 640, H = 300, L = 56, R = 16, T = 16, B = 40;
  const tok = (p) => p.batch_size * p.seq_len;
  const used = (p) => p.peak_reserved_bytes + (p.outside_bytes || 0);
  const gpu = a.device_total_bytes || 0;
  const xs = all.map(tok);
  let x0 = Math.log2(Math.min(...xs)), x1 = Math.log2(Math.max(...xs));
  if (x1 - x0 < 2) { x0 -= 1; x1 += 1; }
  const highest = Math.max(gpu, ...all.map(used));
  const logY = highest > 3 * Math.max(gpu, 1);  // far beyond the GPU: a log scale keeps both in view
  const ymax = (logY ? highest * 1.3 : Math.max(gpu * 1.5, ...marks.map((p) => used(p) * 1.1))) / GIB;
  const ymin = logY ? Math.min(gpu || Infinity, ...all.map((p) => p.peak_bytes)) / 1.3 / GIB : 0;
  const X = (t) => L + (Math.log2(t) - x0) / (x1 - x0) * (W - L - R);
  const Y = (bytes) => T + (1 - (logY ? Math.log(bytes / GIB / ymin) / Math.log(ymax / ymin) : bytes / GIB / ymax))
    * (H - T - B);
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "peak against tokens"});
  const clip = el("clipPath", {id: "plot-area"});
  clip.append(el("rect", {x: L, y: T, width: W - L - R, height: H - T - B}));
  svg.append(clip);
  // axes and ticks
  svg.append(el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "frame"}));
  svg.append(el("line", {x1: L, x2: L, y1: T, y2: H - B, class: "frame"}));
  for (let k = Math.ceil(x0); k <= Math.floor(x1); k++) {
    const x = X(2 ** k);
    svg.append(el("line", {x1: x, x2: x, y1: T, y2: H - B, class: "grid"}));
    svg.append(el("text", {x, y: H - B + 14, "text-anchor": "middle", class: "axis"}, tokens(2 ** k)));
  }
  const ticks = [];
  if (logY) {
    for (let e = Math.floor(Math.log10(ymin)); e <= Math.ceil(Math.log10(ymax)); e++) {
      for (const m of [1, 2, 5]) { const v = m * 10 ** e; if (v >= ymin && v <= ymax) ticks.push(v); }
    }
  } else {
    const step = niceStep(ymax / 5);
    for (let v = 0; v <= ymax + 1e-9; v += step) ticks.push(v);
  }
  for (const v of ticks) {
    const y = Y(v * GIB);
    svg.append(el("line", {x1: L, x2: W - R, y1: y, y2: y, class: "grid"}));
    svg.append(el("text", {x: L - 6, y: y + 4, "text-anchor": "end", class: "axis"}, `${+v.toFixed(1)}`));
  }
  svg.append(el("text", {x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "axis"},
    `tokens per step per GPU (batch ${a.batch_size} × sequence length)`));
  svg.append(el("text", {x: 12, y: (T + H - B) / 2, transform: `rotate(-90 12 ${(T + H - B) / 2})`,
                         "text-anchor": "middle", class: "axis"}, logY ? "GiB (log scale)" : "GiB"));
  const area = el("g", {"clip-path": "url(#plot-area)"});
  if (gpu) {
    area.append(el("line", {x1: L, x2: W - R, y1: Y(gpu), y2: Y(gpu), class: "gpu-line"}));
    svg.append(el("text", {x: W - R - 4, y: Y(gpu) - 5, "text-anchor": "end", class: "gpu-label"}, gpuLabel(a)));
  }
  if (curve.length > 1) {
    const path = (f) => curve.map((p, i) => `${i ? "L" : "M"}${X(tok(p)).toFixed(1)},${Y(f(p)).toFixed(1)}`).join(" ");
    area.append(el("path", {d: path((p) => p.peak_bytes), class: "curve-peak"}));
    area.append(el("path", {d: path(used), class: "curve-used"}));
  }
  for (const p of marks) {
    const exact = p.method === "exact";
    const c = el("circle", {cx: X(tok(p)), cy: Y(used(p)), r: exact ? 5 : 4, class: exact ? "mark-exact" : "mark-formula"});
    c.append(el("title", {}, `${p.method}: ${gib(used(p))} reserved + outside at ${tok(p)} tokens`));
    area.append(c);
  }
  svg.append(area);
  const legend = document.createElement("ul");
  legend.className = "legend";
  const items = [["curve-peak", "formula: peak allocated"], ["curve-used", "formula: reserved + outside PyTorch (the verdict's side)"],
    ["gpu-line", "the GPU"], ["mark-formula", "this question, formula"], ["mark-exact", "this question, exact"]];
  for (const [cls, text] of items) {
    const li = document.createElement("li");
    const s = el("svg", {width: 18, height: 12, viewBox: "0 0 18 12"});
    s.append(cls.startsWith("mark") ? el("circle", {cx: 9, cy: 6, r: 4, class: cls})
      : el("line", {x1: 0, x2: 18, y1: 6, y2: 6, class: cls}));
    li.append(s, ` ${text}`);
    legend.append(li);
  }
  $("plot").replaceChildren(svg, legend);
}

function niceStep(raw) {
  const p = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) if (raw <= m * p) return m * p;
  return 10 * p;
}

// ---------- the same question elsewhere ----------
function renderCopies(a) {
  const q = state.q;
  if (!q) { $("cli").textContent = ""; $("python").textContent = ""; $("json-link").removeAttribute("href"); return; }
  const method = a ? a.method : "formula";
  $("cli").textContent = cliCommand(q, method);
  $("python").textContent = pythonCode(q, method);
  const link = $("json-link");
  if (state.blobUrl) { URL.revokeObjectURL(state.blobUrl); state.blobUrl = null; }
  if (q.model && !q.lengths) {  // a dataset's lengths make the link too long: the answer itself, as for a file
    const params = new URLSearchParams();
    for (const [k, v] of Object.entries({...q, method})) params.set(k, String(v));
    link.href = `/api/estimate?${params}`;
  } else if (a) {
    state.blobUrl = URL.createObjectURL(new Blob([JSON.stringify(a, null, 2)], {type: "application/json"}));
    link.href = state.blobUrl;
  } else {
    link.removeAttribute("href");
  }
}

function cliCommand(q, method) {
  const parts = ["python -m pipeline estimate", ...sourceArgument(q, (name) => `--${name.replace("_", "-")}`)];
  for (const [key, flag] of FLAGS) {
    if (key === "checkpointing" && q[key] === false && TRL_CLIENTS.includes(q.client)) parts.push("--no-checkpointing");
    if (q[key] === undefined || q[key] === false) continue;
    if (key in FILE_NAMES) parts.push(`${flag} ${FILE_NAMES[key]}`);
    else parts.push(q[key] === true ? flag : `${flag} ${sh(String(q[key]))}`);
  }
  parts.push(`--method ${method}`, "--json");
  return parts.join(" ");
}

// The model's argument of a command (python: true, a call): the model id or config.json; none for a framework
// file, whose flag names its model.
function sourceArgument(q, flag, python = false) {
  if (q.model) return [python ? `${flag("model")}${py(q.model)}` : `${flag("model")} ${sh(q.model)}`];
  if (q.axolotl_config || q.llamafactory_config) return [];
  return [python ? `${flag("config")}"config.json"` : `${flag("config")} config.json`];
}

function pythonCode(q, method) {
  const lines = ["from pipeline.estimate import estimate"];
  if (q.lengths) lines.push("from pipeline.training.packing import read_lengths");
  lines.push("");
  const args = sourceArgument(q, (name) => `${name}=`, true);
  for (const [key] of FLAGS) {
    if (q[key] === undefined) continue;
    if (key === "lengths") args.push(`lengths=read_lengths(${py(FILE_NAMES.lengths)})`);
    else args.push(`${key}=${key in FILE_NAMES ? py(FILE_NAMES[key]) : py(q[key])}`);
  }
  args.push(`method=${py(method)}`);
  lines.push(`answer = estimate(${args.join(", ")})`);
  lines.push(`print(answer["peak_bytes"], answer.get("fits"))`);
  return lines.join("\n");
}

async function copy(id, button) {
  const text = $(id).textContent;
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "copied";
  } catch {
    const range = document.createRange();
    range.selectNodeContents($(id));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    button.textContent = "selected: press Ctrl+C";
  }
  setTimeout(() => { button.textContent = id === "python" ? "copy as Python" : "copy as CLI command"; }, 1500);
}

// ---------- start ----------
async function getJSON(url) {
  const response = await fetch(url);
  return response.json();
}

async function start() {
  const [info, gpus, models, accuracy] = await Promise.all(
    ["/api/info", "/api/gpus", "/api/models", "/api/accuracy"].map(getJSON));
  Object.assign(state, {info, gpus, models, accuracy});
  state.byId = new Map(models.map((m) => [m.id, m]));
  fillSelect("precision", info.precisions);
  fillSelect("weights_dtype", info.weights_dtypes);
  fillSelect("client", info.clients, {loop: "loop (standard step)", trainer: "trainer (HF Trainer)",
    sft: "sft (TRL SFTTrainer)", dpo: "dpo (TRL DPOTrainer: batch = pairs)",
    grpo: "grpo (TRL GRPOTrainer)", rloo: "rloo (TRL RLOOTrainer)"});
  fillSelect("optimizer", info.optimizers);
  fillSelect("optim", info.optims);
  fillSelect("quantization", info.quantizations);
  fillSelect("sharding", ["", ...info.shardings], {"": "none"});
  fillSelect("gpu", [...gpus.map((g) => g.name), "custom"],
    Object.fromEntries([...gpus.map((g) => [g.name, `${g.name} (${(g.total_mib / 1024).toFixed(1)} GiB)`]),
                        ["custom", "another GPU: its memory in GiB"]]));
  $("models").replaceChildren(...models.map((m) => {
    const option = document.createElement("option");
    option.value = m.id;
    option.label = `${m.family} · ${m.model_type} · ${count(m.parameters)}`;
    return option;
  }));
  $("limits").textContent = `Limits: ${info.limits}. Nothing is kept between requests; no remote code is run.`;
  const acc = Object.entries(accuracy).map(([m, a]) => `${m}: median ${pct(a.median)}, worst ${pct(a.worst)}`);
  $("accuracy").textContent = acc.length ? `The standard loop's measured accuracy of the peak, over the H200's points `
    + `(${Object.values(accuracy)[0].source.split(" ")[0]}): ${acc.join("; ")}. The line under an answer quotes `
    + "its own setting's." : "";

  setForm(readHash() || DEFAULT);
  const form = $("question");
  form.addEventListener("input", (e) => { if (e.target.type !== "file") changed(); });
  form.addEventListener("change", (e) => { if (e.target.tagName === "SELECT" || e.target.type === "radio" || e.target.type === "checkbox") changed(); });
  $("config-file").addEventListener("change", (e) => readUpload(e, "config"));
  $("accelerate-file").addEventListener("change", (e) => readUpload(e, "accelerate_config"));
  $("framework-upload").addEventListener("change", (e) => readUpload(e, "framework_file"));
  $("layouts-run").addEventListener("click", () => runLayouts("layouts"));
  $("min-gpus-run").addEventListener("click", () => runLayouts("min_gpus"));
  $("copy-layouts-cli").addEventListener("click", (e) => copy("layouts-cli", e.target));
  for (const button of document.querySelectorAll(".example")) {
    button.addEventListener("click", () => { setForm({...EXAMPLES[button.dataset.example]}); changed(); });
  }
  $("mbs-run").addEventListener("click", () => runSearch("mbs"));
  $("msl-run").addEventListener("click", () => runSearch("msl"));
  $("copy-cli").addEventListener("click", (e) => copy("cli", e.target));
  // before the form's own listener asks: the client's words for the precision, TRL's defaults ticked
  $("client").addEventListener("change", clientChanged);
  $("copy-python").addEventListener("click", (e) => copy("python", e.target));
  changed();
}

function runSearch(kind) {
  if (!state.q) return;
  const q = {...withoutLengths(state.q), method: "exact"};
  if (kind === "mbs") q.max_batch_size = true; else q.max_seq_len = true;
  state.searches[`${kind}Exact`] = "queued…";
  renderSearches();
  if (state.timers.exact) askExact();
  queueExact(state.gen, kind, q);
}

// ---------- which layouts fit ----------
// The layouts table (N = 1, 2, 4, ... up to the GPUs asked, else 8) or the fewest GPUs (up to the server's
// limit): the question without its layout, which the table varies. The formula's answer comes at once, the
// exact one after the simulations queued before it.
function layoutsLimit() {
  const n = Number($("num_gpus").value);
  return Number.isInteger(n) && n > 1 ? n : DEFAULT_LAYOUTS_LIMIT;
}

function layoutsQuestion(kind) {
  const q = withoutLengths(state.q);  // the server refuses them with layouts and min_gpus
  for (const name of LAYOUT_FIELDS) delete q[name];
  q.num_gpus = kind === "min_gpus" ? state.info.max_num_gpus : layoutsLimit();
  q[kind] = true;
  return q;
}

async function runLayouts(kind) {
  if (!state.q) return;
  const q = layoutsQuestion(kind), gen = state.gen;
  const shown = {kind, q, exactQuestion: {...q, method: "exact"}, formula: null, exact: null,
                 formulaError: null, exactError: null};
  state.layouts = shown;
  renderLayouts();
  if (state.timers.exact) askExact();  // the answer's own simulation first: seconds, not a table's minute
  if (state.exactBusy) setLayoutsStatus("exact: waiting for the simulation before it…");
  queueExact(gen, "layouts", shown.exactQuestion);
  const result = await ask({...q, method: "formula"});
  if (state.layouts !== shown) return;
  if (result.ok) Object.assign(shown, {formula: result.body, formulaSeconds: result.seconds});
  else shown.formulaError = result.body.error;
  renderLayouts();
}

function renderLayouts() {
  const shown = state.layouts;
  $("layouts-run").textContent = `Layouts on 1 to ${layoutsLimit()} GPUs`;
  $("layouts-run").disabled = $("min-gpus-run").disabled = !state.q;
  const a = shown && (shown.exact || shown.formula);
  const table = $("layouts-table");
  table.hidden = !a;
  table.dataset.method = a ? a.method : "";
  $("layouts-copy").hidden = !shown;
  const errors = shown ? [shown.exact ? null : shown.formulaError, shown.exactError].filter(Boolean) : [];
  $("layouts-error").textContent = [...new Set(errors)].join(" ");
  if (!shown) { $("layouts-summary").textContent = ""; setLayoutsStatus(""); return; }
  $("layouts-cli").textContent = cliCommand(shown.q, a ? a.method : "formula");
  $("layouts-summary").textContent = a ? layoutsSummary(a, shown) : "";
  if (!a) return;
  const seconds = a === shown.exact ? shown.exactSeconds : shown.formulaSeconds;
  $("layouts-caption").textContent = `${a.method}${seconds == null ? "" : ` (${seconds.toFixed(2)} s)`}: one GPU's `
    + `bytes at batch ${a.batch_size} per data-parallel rank × ${a.seq_len} tokens, ${a.precision}, ${a.client}`
    + `${a.checkpointing ? ", checkpointing" : ""}, on ${gpuWords(a)} (${gib(a.device_total_bytes)})`
    + (shown.exact ? "" : shown.exactError ? "" : "; the exact simulation replaces it when it comes");
  const main = state.exact || state.formula;
  const asked = main && main.num_gpus > 1 ? layoutWords(main) : null;
  // while the exact rows stream in, each replaces the formula's of its layout (a layout the formula's search did
  // not reach comes after them)
  const streamed = !shown.exact && shown.progress ? shown.progress.rows : {};
  const rows = a.layouts.map((row) => streamed[row.layout] ? [streamed[row.layout], "exact"] : [row, a.method]);
  const listed = new Set(a.layouts.map((row) => row.layout));
  for (const row of Object.values(streamed)) if (!listed.has(row.layout)) rows.push([row, "exact"]);
  table.tBodies[0].replaceChildren(...rows.map(([row, method]) => layoutRow(row, a.layout, asked, method)));
  table.classList.toggle("no-why", !rows.some(([row]) => row.reason));
  if (shown.progress && !shown.exact && !shown.progress.finished) setLayoutsStatus(progressText(shown.progress));
}

function progressText(p) {
  const seconds = ((performance.now() - p.started) / 1000).toFixed(0);
  return `exact: ${p.done} of ${p.total ?? "?"} layouts simulated (the rest are the formula's)… ${seconds} s`;
}

function layoutsSummary(a, shown) {
  const fitting = a.layouts.filter((row) => row.fits);
  if (shown.kind === "layouts") {
    const fewest = fitting.length ? Math.min(...fitting.map((row) => row.num_gpus)) : 0;
    return fewest ? `${fitting.length} of ${a.layouts.length} layouts fit; the fewest GPUs that do: ${fewest} `
      + `(${a.method})` : `No layout fits on up to ${shown.q.num_gpus} GPUs (${a.method})`;
  }
  if (!a.min_gpus) return `No layout fits on up to ${shown.q.num_gpus} GPUs (${a.method})`;
  const rest = a.layout.layout.split(", ").slice(1).join(", ") || "one GPU, no sharding";
  return `${a.min_gpus} GPU${a.min_gpus > 1 ? "s" : ""}: ${rest}, ${gib(a.layout.headroom_bytes)} of headroom `
    + `per GPU (${a.method})`;
}

function layoutRow(row, best, asked, method) {
  const tr = document.createElement("tr");
  tr.dataset.fits = String(row.fits);
  tr.dataset.layout = row.layout;
  tr.dataset.method = method;
  if (best && best.layout === row.layout) tr.classList.add("best");
  if (row.layout === asked) {
    tr.classList.add("asked");
    tr.title = "the layout of the question above";
  }
  const simulated = row.peak_bytes != null;
  const fits = row.fits === true ? `yes, ${gib(row.headroom_bytes)} headroom`
    : row.fits === false ? (simulated ? `no, ${gib(-row.headroom_bytes)} short` : "no") : "?";
  const cells = [[row.layout], [simulated ? gib(row.peak_bytes) : "–", "num", row.peak_bytes],
    [simulated ? gib(row.peak_reserved_bytes) : "–", "num", row.peak_reserved_bytes], [fits, "fits"],
    [row.reason || "", "why"]];
  for (const [text, cls, bytes] of cells) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    if (bytes != null) td.dataset.bytes = String(bytes);
    tr.append(td);
  }
  return tr;
}

function readUpload(event, field) {
  const file = event.target.files[0];
  if (!file) return;
  if (file.size > MAX_UPLOAD) {
    clearErrors();
    showError(field, `${file.name} is over 1 MiB, the server's limit (such a file is a few kB)`);
    return;
  }
  const reader = new FileReader();
  reader.onload = () => { $(field).value = reader.result; changed(); };
  reader.readAsText(file);
}

document.addEventListener("DOMContentLoaded", () => {
  start().catch((e) => {
    $("verdict").textContent = `The page could not start: ${e.message}`;
  });
});
