// Integration checks of `cachet serve` through the real openai npm client (and plain fetch where
// the wire format itself is checked). Run by tests/server/run.sh, which starts the server:
//   node client.mjs GROUP BASE_URL   (GROUP: api, stream, errors, load)
// Environment: CACHET (the binary, to compare with `cachet run`), THREADS, API_KEY (errors group).
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { connect } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import OpenAI from "openai";
import { runChecks } from "./harness.mjs";

const [group, base] = process.argv.slice(2);
const apiKey = group === "errors" ? process.env.API_KEY : "unused";
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey, maxRetries: 0, timeout: 120_000 });
const authHeaders = { Authorization: `Bearer ${apiKey}` };

const PROMPT = "In the beginning God created the heaven and the earth.";
const PROMPTS = [
  PROMPT,
  "And the earth was without form, and void;",
  "The LORD is my shepherd; I shall not want.",
  "Blessed are the meek: for they shall inherit the earth.",
];
// ~150 tokens: several full KV pages (16 tokens each) for the prefix cache.
const LONG = Array.from({ length: 12 }, (_, i) => `Verse ${i}: ${PROMPTS[i % 4]}`).join(" ");

const checks = [];
const check = (name, fn) => checks.push({ name, fn });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function post(path, body, headers = authHeaders) {
  const res = await fetch(base + path, {
    method: "POST",
    headers: { "Content-Type": "application/json", ...headers },
    body: typeof body === "string" ? body : JSON.stringify(body),
  });
  const text = await res.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: res.status, headers: res.headers, text, json };
}

async function get(path, headers = authHeaders) {
  const res = await fetch(base + path, { headers });
  return { status: res.status, headers: res.headers, text: await res.text() };
}

// /metrics as {name{labels}: value}; value(name) sums a family's samples.
async function metrics() {
  const { status, text } = await get("/metrics", {});
  assert.equal(status, 200);
  const samples = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const at = line.lastIndexOf(" ");
    samples[line.slice(0, at)] = Number(line.slice(at + 1));
  }
  const value = (name) =>
    Object.entries(samples)
      .filter(([k]) => k.startsWith(`cachet:${name}{`))
      .reduce((s, [, v]) => s + v, 0);
  return { samples, value, text };
}

// Pages that requests (not the prefix cache) hold.
const pagesInUse = (m) => m.value("kv_pages_used") - m.value("kv_pages_reclaimable");

async function waitFor(what, predicate, ms = 15_000) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await predicate();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(50);
  }
}

let model = null;
async function modelId() {
  if (!model) model = (await client.models.list()).data[0].id;
  return model;
}

async function greedy(prompt, max_tokens = 16, extra = {}) {
  return client.completions.create({
    model: await modelId(),
    prompt,
    max_tokens,
    temperature: 0,
    ...extra,
  });
}

async function chatGreedy(content, max_tokens = 16, extra = {}) {
  return client.chat.completions.create({
    model: await modelId(),
    messages: [{ role: "user", content }],
    max_tokens,
    temperature: 0,
    ...extra,
  });
}

// Concatenated text of a streamed completion (or chat completion), per choice.
async function collect(stream) {
  const texts = {};
  const finish = {};
  const chunks = [];
  for await (const chunk of stream) {
    chunks.push(chunk);
    for (const c of chunk.choices) {
      const piece = c.text ?? c.delta?.content ?? "";
      texts[c.index] = (texts[c.index] ?? "") + piece;
      if (c.finish_reason) finish[c.index] = c.finish_reason;
    }
  }
  return { texts, finish, chunks };
}

function assertUsage(usage, { completion } = {}) {
  assert.equal(typeof usage.prompt_tokens, "number");
  assert.ok(usage.prompt_tokens > 0);
  assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
  assert.equal(typeof usage.prompt_tokens_details?.cached_tokens, "number");
  if (completion !== undefined) assert.equal(usage.completion_tokens, completion);
}

// A stop string that first occurs at index >= 4 of text: [stop, text before it].
function pickStop(text) {
  for (let a = 4; a + 3 <= text.length; ++a) {
    const s = text.slice(a, a + 3);
    if (s.trim().length === 3 && text.indexOf(s) === a) return [s, text.slice(0, a)];
  }
  throw new Error(`no stop string to pick in ${JSON.stringify(text)}`);
}

// ---------------------------------------------------------------- api

if (group === "api") {
  check("GET /health", async () => {
    const r = await get("/health");
    assert.equal(r.status, 200);
    assert.deepEqual(JSON.parse(r.text), { status: "ok" });
  });

  check("models.list and models.retrieve", async () => {
    const list = await client.models.list();
    assert.equal(list.data.length, 1);
    const m = list.data[0];
    assert.equal(m.object, "model");
    assert.equal(typeof m.id, "string");
    assert.equal(m.owned_by, "cachet");
    assert.ok(m.max_model_len > 0);
    const one = await client.models.retrieve(m.id);
    assert.equal(one.id, m.id);
  });

  check("completion: greedy, the shape, the same text as `cachet run`", async () => {
    const r = await greedy(PROMPT, 16);
    assert.match(r.id, /^cmpl-/);
    assert.equal(r.object, "text_completion");
    assert.equal(r.model, await modelId());
    assert.equal(typeof r.created, "number");
    assert.equal(r.choices.length, 1);
    const c = r.choices[0];
    assert.equal(c.index, 0);
    assert.equal(c.logprobs, null);
    assert.equal(typeof c.text, "string");
    assert.ok(c.text.length > 0);
    if (c.finish_reason === "length") assertUsage(r.usage, { completion: 16 });
    else assert.equal(c.finish_reason, "stop");
    const again = await greedy(PROMPT, 16);
    assert.equal(again.choices[0].text, c.text);
    // Not execFileSync: a blocked event loop keeps fetch's idle keep-alive sockets past the
    // server's keep-alive timeout (5 s; a sanitizer build's `cachet run` takes longer), and the
    // next request fails on a socket the server has closed.
    const { stdout: cli } = await promisify(execFile)(
      process.env.CACHET,
      ["run", "-q", "-t", process.env.THREADS ?? "2", "--temp", "0", "-n", "16", "-p", PROMPT],
      { encoding: "utf8" },
    );
    assert.equal(c.text, cli.replace(/\n$/, ""), "the server and `cachet run` disagree");
  });

  check("logit_bias and presence / frequency penalties: as `cachet run`'s flags", async () => {
    const plain = await greedy(PROMPT, 16, { ignore_eos: true });
    const tok = await post("/tokenize", { content: plain.choices[0].text, add_special: false });
    const banned = tok.json.tokens[0];
    const sampling = { logit_bias: { [String(banned)]: -100 }, frequency_penalty: 1.5,
                       presence_penalty: 0.5 };
    const biased = await greedy(PROMPT, 16, { ignore_eos: true, ...sampling });
    assert.notEqual(biased.choices[0].text, plain.choices[0].text);
    const { stdout: cli } = await promisify(execFile)(
      process.env.CACHET,
      ["run", "-q", "-t", process.env.THREADS ?? "2", "--temp", "0", "-n", "16", "--ignore-eos",
       "--logit-bias", `${banned}-100`, "--frequency-penalty", "1.5", "--presence-penalty", "0.5",
       "-p", PROMPT],
      { encoding: "utf8" },
    );
    assert.equal(biased.choices[0].text, cli.replace(/\n$/, ""), "the server and `cachet run` disagree");
    // +100 on one token: every token of a greedy completion is that one.
    const forced = await greedy(PROMPT, 6, { ignore_eos: true, logprobs: 1,
                                            logit_bias: { [String(banned)]: 100 } });
    const toks = forced.choices[0].logprobs.tokens;
    assert.equal(toks.length, 6);
    assert.ok(toks.every((t) => t === toks[0]), JSON.stringify(toks));
    const bad = await post("/v1/completions", { prompt: "x", logit_bias: { "99999999": 1 } });
    assert.equal(bad.status, 400);
    assert.equal(bad.json.error.param, "logit_bias");
  });

  check("response_format json_object: replies are JSON objects, as `cachet run` writes them", async () => {
    let closed = 0;
    for (let seed = 1; seed <= 8; ++seed) {
      const r = await client.chat.completions.create({
        model: await modelId(),
        messages: [{ role: "user", content: "Reply in JSON." }],
        max_tokens: 120,
        temperature: 1.2,
        seed,
        response_format: { type: "json_object" },
      });
      const { message, finish_reason } = r.choices[0];
      assert.ok(message.content.startsWith("{"), message.content);
      if (finish_reason !== "stop") continue;
      ++closed;
      const value = JSON.parse(message.content);
      assert.ok(value !== null && typeof value === "object" && !Array.isArray(value));
    }
    assert.ok(closed >= 2, `only ${closed} of 8 replies closed their object`);
    const served = await greedy(PROMPT, 64, { response_format: { type: "json_object" } });
    const { stdout: cli } = await promisify(execFile)(
      process.env.CACHET,
      ["run", "-q", "-t", process.env.THREADS ?? "2", "--temp", "0", "-n", "64",
       "--response-format", "json_object", "-p", PROMPT],
      { encoding: "utf8" },
    );
    assert.equal(served.choices[0].text, cli.replace(/\n$/, ""));
    const bad = await post("/v1/chat/completions", {
      messages: [{ role: "user", content: "x" }],
      response_format: { type: "json_schema", json_schema: { name: "x", schema: {} } },
    });
    assert.equal(bad.status, 400);
    assert.equal(bad.json.error.param, "response_format");
  });

  check("a prompt of token ids gives the text prompt's completion", async () => {
    const tok = await post("/tokenize", { content: PROMPT, add_special: true });
    assert.equal(tok.status, 200);
    assert.ok(Array.isArray(tok.json.tokens) && tok.json.tokens.length > 3);
    const byIds = await greedy(tok.json.tokens, 12);
    const byText = await greedy(PROMPT, 12);
    assert.equal(byIds.choices[0].text, byText.choices[0].text);
    assert.equal(byIds.usage.prompt_tokens, tok.json.tokens.length);
  });

  check("chat completion: the shape", async () => {
    const r = await chatGreedy("Hello, who are you?", 12);
    assert.match(r.id, /^chatcmpl-/);
    assert.equal(r.object, "chat.completion");
    assert.equal(r.choices.length, 1);
    const c = r.choices[0];
    assert.equal(c.message.role, "assistant");
    assert.equal(typeof c.message.content, "string");
    assert.ok(["stop", "length"].includes(c.finish_reason));
    assert.equal(c.logprobs, null);
    assertUsage(r.usage);
    const with_system = await client.chat.completions.create({
      model: await modelId(),
      messages: [
        { role: "system", content: "You answer briefly." },
        { role: "user", content: [{ type: "text", text: "Hello" }] },
      ],
      max_completion_tokens: 8,
      temperature: 0,
    });
    assert.ok(with_system.usage.completion_tokens <= 8);
  });

  check("n = 3: three choices indexed 0..2; greedy choices agree", async () => {
    const r = await client.completions.create({
      model: await modelId(),
      prompt: PROMPT,
      max_tokens: 8,
      n: 3,
      temperature: 0.9,
      seed: 7,
    });
    assert.deepEqual(
      r.choices.map((c) => c.index),
      [0, 1, 2],
    );
    const total = r.choices.length;
    assert.equal(total, 3);
    assert.ok(r.usage.completion_tokens <= 24 && r.usage.completion_tokens >= 3);
    const same = await greedy(PROMPT, 8, { n: 2 });
    assert.equal(same.choices.length, 2);
    assert.equal(same.choices[0].text, same.choices[1].text);
    const chat = await chatGreedy("Hello", 6, { n: 2 });
    assert.deepEqual(
      chat.choices.map((c) => c.index),
      [0, 1],
    );
    // Seeded sampling is reproducible.
    const a = await greedy(PROMPT, 8, { temperature: 1, seed: 1234 });
    const b = await greedy(PROMPT, 8, { temperature: 1, seed: 1234 });
    assert.equal(a.choices[0].text, b.choices[0].text);
  });

  check("stop strings end the text before them (completions and chat)", async () => {
    const full = (await greedy(PROMPT, 24, { ignore_eos: true })).choices[0].text;
    const [stop, before] = pickStop(full);
    const r = await greedy(PROMPT, 24, { stop: [stop, "never-there"], ignore_eos: true });
    assert.equal(r.choices[0].text, before);
    assert.equal(r.choices[0].finish_reason, "stop");
    const one = await greedy(PROMPT, 24, { stop, ignore_eos: true });
    assert.equal(one.choices[0].text, before);
    const chatFull = (await chatGreedy("Tell me a story.", 24, { ignore_eos: true })).choices[0]
      .message.content;
    if (chatFull.length >= 8) {
      const [cstop, cbefore] = pickStop(chatFull);
      const c = await chatGreedy("Tell me a story.", 24, { stop: cstop, ignore_eos: true });
      assert.equal(c.choices[0].message.content, cbefore);
      assert.equal(c.choices[0].finish_reason, "stop");
    }
  });

  check("a repeated prompt reports cached_tokens > 0; another cache_salt reports 0", async () => {
    const first = await greedy(LONG, 4, { cache_salt: "tenant-a" });
    const second = await greedy(LONG, 4, { cache_salt: "tenant-a" });
    assert.ok(second.usage.prompt_tokens >= 32, `prompt of ${second.usage.prompt_tokens} tokens`);
    assert.ok(
      second.usage.prompt_tokens_details.cached_tokens > 0,
      JSON.stringify(second.usage),
    );
    assert.ok(second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens);
    assert.equal(first.choices[0].text, second.choices[0].text);
    const other = await greedy(LONG, 4, { cache_salt: "tenant-b" });
    assert.equal(other.usage.prompt_tokens_details.cached_tokens, 0);
    assert.equal(other.choices[0].text, first.choices[0].text);
    const chat1 = await chatGreedy(LONG, 2);
    const chat2 = await chatGreedy(LONG, 2);
    assert.ok(chat2.usage.prompt_tokens_details.cached_tokens > 0);
    assert.equal(chat1.choices[0].message.content, chat2.choices[0].message.content);
  });

  check("POST /v1/cache/reset empties the prefix cache", async () => {
    await greedy(LONG, 2, { cache_salt: "reset" });
    const r = await post("/v1/cache/reset", {});
    assert.equal(r.status, 200);
    const after = await greedy(LONG, 2, { cache_salt: "reset" });
    assert.equal(after.usage.prompt_tokens_details.cached_tokens, 0);
  });

  check("logprobs: completions (integer) and chat (boolean + top_logprobs)", async () => {
    const r = await greedy(PROMPT, 6, { logprobs: 2, ignore_eos: true });
    const lp = r.choices[0].logprobs;
    assert.equal(lp.tokens.length, 6);
    assert.equal(lp.token_logprobs.length, 6);
    assert.equal(lp.top_logprobs.length, 6);
    assert.equal(lp.text_offset.length, 6);
    for (let i = 0; i < 6; ++i) {
      // text_offset: where the token's text starts in the choice's text, in characters.
      const chars = [...r.choices[0].text];
      assert.equal(chars.slice(lp.text_offset[i]).join("").startsWith(lp.tokens[i]), true, i);
      assert.ok(lp.token_logprobs[i] <= 0);
      const alts = Object.values(lp.top_logprobs[i]);
      assert.ok(alts.length >= 1 && alts.length <= 2);
      // Greedy: the chosen token is the most likely one.
      assert.ok(Math.abs(Math.max(...alts) - lp.token_logprobs[i]) < 1e-4);
    }
    const c = await chatGreedy("Hello", 5, { logprobs: true, top_logprobs: 3, ignore_eos: true });
    const content = c.choices[0].logprobs.content;
    assert.equal(content.length, 5);
    for (const t of content) {
      assert.equal(typeof t.token, "string");
      assert.ok(t.logprob <= 0);
      assert.ok(Array.isArray(t.bytes));
      assert.equal(t.top_logprobs.length, 3);
      assert.ok(Math.abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4);
    }
  });

  check("kv_press: a press named per request", async () => {
    const r = await greedy(LONG, 8, { kv_press: { name: "snapkv", ratio: 0.5 } });
    assert.equal(r.choices.length, 1);
    assert.equal(typeof r.choices[0].text, "string");
    const q = await greedy(LONG, 4, { kv_press: { name: "knorm+max", budget: 32 } });
    assert.equal(q.choices.length, 1);
  });

  check("chunks: documents reused at any position, as `cachet run --chunk-file` computes them", async () => {
    const docA = "Once upon a time, there was a little girl named Lily. She had a red ball.\n\n";
    const docB = "The pass key is 52817. Remember it. 52817 is the pass key.\n\n";
    const question = "Question: What is the pass key?\nAnswer:";
    const first = await greedy(docA + docB + question, 6, { chunks: [docA, docB], blend: "cacheblend:0.3" });
    assert.equal(first.choices[0].text.trim(), "52817");
    // The other order: both documents come from the chunk cache.
    const second = await greedy(docB + docA + question, 6, { chunks: [docA, docB] });
    assert.equal(second.choices[0].text.trim(), "52817");
    assert.ok(second.usage.prompt_tokens_details?.cached_tokens >= 30, JSON.stringify(second.usage));
    const dir = mkdtempSync(join(tmpdir(), "chunks-"));
    let cli;
    try {
      writeFileSync(join(dir, "a.txt"), docA);
      writeFileSync(join(dir, "b.txt"), docB);
      ({ stdout: cli } = await promisify(execFile)(
        process.env.CACHET,
        ["run", "-q", "-t", process.env.THREADS ?? "2", "--temp", "0", "-n", "6",
         "--chunk-file", join(dir, "a.txt"), "--chunk-file", join(dir, "b.txt"),
         "--blend", "cacheblend:0.3", "-p", question],
        { encoding: "utf8" },
      ));
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
    assert.equal(first.choices[0].text, cli.replace(/\n$/, ""), "the server and `cachet run` disagree");
    const bad = await post("/v1/completions", { prompt: "x", chunks: ["y"] });
    assert.equal(bad.status, 400);
    assert.equal(bad.json.error.param, "chunks[0]");
  });

  check("POST /tokenize and /detokenize (llama.cpp shapes)", async () => {
    const t = await post("/tokenize", { content: "Hello world" });
    assert.equal(t.status, 200);
    const d = await post("/detokenize", { tokens: t.json.tokens });
    assert.equal(d.status, 200);
    assert.equal(d.json.content, "Hello world");
    const p = await post("/tokenize", { content: "Hello world", with_pieces: true });
    assert.equal(p.json.tokens.map((x) => x.piece).join(""), "Hello world");
    assert.deepEqual(
      p.json.tokens.map((x) => x.id),
      t.json.tokens,
    );
  });

  check("GET /metrics counts what was served", async () => {
    const m = await metrics();
    for (const name of [
      "kv_cache_usage_perc",
      "prefix_cache_queries_total",
      "prefix_cache_hits_total",
      "num_requests_running",
      "num_requests_waiting",
      "num_preemptions_total",
      "prompt_tokens_total",
      "generation_tokens_total",
      "kv_evicted_tokens_total",
      "time_to_first_token_seconds",
      "inter_token_latency_seconds",
      "e2e_request_latency_seconds",
      "kv_bytes",
    ]) {
      assert.ok(m.text.includes(`# TYPE cachet:${name} `), name);
    }
    assert.ok(m.value("generation_tokens_total") > 0);
    assert.ok(m.value("prompt_tokens_total") > 0);
    assert.ok(m.value("prefix_cache_hits_total") > 0);
    assert.ok(m.value("time_to_first_token_seconds_count") > 0);
    assert.equal(m.value("num_requests_running"), 0);
    assert.match(m.text, /cachet:kv_bytes\{model_name="[^"]+",codec="[^"]+"\} \d+/);
  });

  // run.sh serves this group with --on-full press:keydiff:0.5 (the context: kvtiny's 4096).
  check("a chat longer than the context is served with its history pressed", async () => {
    const messages = [{ role: "system", content: "The pass key is 52817. Remember it." }];
    for (let i = 0; i < 40; ++i) {
      messages.push({ role: "user", content: LONG }, { role: "assistant", content: `Part ${i}.` });
    }
    messages.push({ role: "user", content: "What is the pass key?" });
    const before = await metrics();
    const { data, response } = await client.chat.completions
      .create({ model: await modelId(), messages, max_tokens: 8, temperature: 0 })
      .withResponse();
    assert.equal(response.headers.get("x-cachet-history-pressed"), "true");
    assert.ok(data.usage.prompt_tokens > 4096, `prompt_tokens ${data.usage.prompt_tokens}`);
    assert.ok(data.usage.completion_tokens >= 1);
    const after = await metrics();
    assert.equal(after.value("fit_requests_total") - before.value("fit_requests_total"), 1);
    assert.ok(after.value("fit_pressed_tokens_total") > data.usage.prompt_tokens - 4096);
    // A chat that fits is not pressed.
    const short = await client.chat.completions
      .create({ model: await modelId(), messages: messages.slice(-3), max_tokens: 4 })
      .withResponse();
    assert.equal(short.response.headers.get("x-cachet-history-pressed"), null);
  });
}

// ---------------------------------------------------------------- stream

if (group === "stream") {
  check("completions stream: the chunks add up to the non-streamed text", async () => {
    const whole = await greedy(PROMPT, 20);
    const stream = await greedy(PROMPT, 20, { stream: true });
    const { texts, finish, chunks } = await collect(stream);
    assert.equal(texts[0], whole.choices[0].text);
    assert.equal(finish[0], whole.choices[0].finish_reason);
    assert.ok(chunks.length >= 2);
    for (const c of chunks) {
      assert.equal(c.object, "text_completion");
      assert.equal(c.id, chunks[0].id);
      assert.ok(!("usage" in c), "usage only with stream_options.include_usage");
    }
    assert.equal(chunks.at(-1).choices[0].finish_reason, finish[0]);
  });

  check("chat stream: role first, content deltas, finish_reason last", async () => {
    const whole = await chatGreedy("Hello there", 16);
    const stream = await chatGreedy("Hello there", 16, { stream: true });
    const { texts, finish, chunks } = await collect(stream);
    assert.equal(chunks[0].object, "chat.completion.chunk");
    assert.equal(chunks[0].choices[0].delta.role, "assistant");
    assert.equal(texts[0], whole.choices[0].message.content);
    assert.equal(finish[0], whole.choices[0].finish_reason);
    const last = chunks.at(-1).choices[0];
    assert.deepEqual(last.delta, {});
    assert.ok(["stop", "length"].includes(last.finish_reason));
  });

  check("stream_options.include_usage: a last chunk with usage and no choices", async () => {
    const stream = await chatGreedy("Hello", 8, {
      stream: true,
      stream_options: { include_usage: true },
      ignore_eos: true,
    });
    const { chunks } = await collect(stream);
    const last = chunks.at(-1);
    assert.deepEqual(last.choices, []);
    assertUsage(last.usage, { completion: 8 });
    for (const c of chunks.slice(0, -1)) assert.equal(c.usage, null);
    const comp = await greedy(PROMPT, 5, {
      stream: true,
      stream_options: { include_usage: true },
      ignore_eos: true,
    });
    const got = await collect(comp);
    assertUsage(got.chunks.at(-1).usage, { completion: 5 });
  });

  check("n = 2 streamed: both choices, each finished", async () => {
    const stream = await greedy(PROMPT, 10, { stream: true, n: 2, ignore_eos: true });
    const { texts, finish } = await collect(stream);
    assert.deepEqual(Object.keys(texts).sort(), ["0", "1"]);
    assert.equal(texts[0], texts[1]);
    assert.equal(finish[0], "length");
    assert.equal(finish[1], "length");
    const chat = await chatGreedy("Hi", 6, { stream: true, n: 2 });
    const c = await collect(chat);
    assert.deepEqual(Object.keys(c.finish).sort(), ["0", "1"]);
  });

  check("a stop string in a stream", async () => {
    const full = (await greedy(PROMPT, 24, { ignore_eos: true })).choices[0].text;
    const [stop, before] = pickStop(full);
    const stream = await greedy(PROMPT, 24, { stream: true, stop, ignore_eos: true });
    const { texts, finish } = await collect(stream);
    assert.equal(texts[0] ?? "", before);
    assert.equal(finish[0], "stop");
  });

  check("streamed logprobs", async () => {
    const stream = await chatGreedy("Hello", 5, {
      stream: true,
      logprobs: true,
      top_logprobs: 2,
      ignore_eos: true,
    });
    const { chunks } = await collect(stream);
    const tokens = chunks.flatMap((c) => c.choices.flatMap((x) => x.logprobs?.content ?? []));
    assert.equal(tokens.length, 5);
    for (const t of tokens) assert.equal(t.top_logprobs.length, 2);
    const comp = await greedy(PROMPT, 4, { stream: true, logprobs: 1, ignore_eos: true });
    const got = await collect(comp);
    const n = got.chunks.reduce((s, c) => s + (c.choices[0]?.logprobs?.tokens?.length ?? 0), 0);
    assert.equal(n, 4);
  });

  check("the wire: text/event-stream, data: lines, data: [DONE] last", async () => {
    const res = await fetch(`${base}/v1/completions`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt: PROMPT, max_tokens: 4, temperature: 0, stream: true }),
    });
    assert.equal(res.status, 200);
    assert.match(res.headers.get("content-type"), /^text\/event-stream/);
    const body = await res.text();
    assert.ok(body.endsWith("data: [DONE]\n\n"), JSON.stringify(body.slice(-40)));
    const events = body.split("\n\n").filter((e) => e.length > 0);
    for (const e of events) {
      assert.ok(e.startsWith("data: ") || e.startsWith(":"), e);
      if (e.startsWith("data: {")) JSON.parse(e.slice(6));
    }
  });
}

// ---------------------------------------------------------------- errors

// The server started with --chat-template deepseek (R1's: the generation prompt opens <think>).
if (group === "reasoning") {
  // What --reasoning-format deepseek makes of a raw reply: thinking up to the first </think>,
  // then the answer past the white space after it.
  const split = (raw) => {
    const end = raw.indexOf("</think>");
    if (end < 0) return { reasoning: raw, content: "" };
    return { reasoning: raw.slice(0, end), content: raw.slice(end + 8).replace(/^\s+/, "") };
  };

  check("chat: the reply's thinking in reasoning_content, as the raw reply splits", async () => {
    const raw = await chatGreedy("Hello there", 24, { reasoning_format: "none" });
    const msg = (await chatGreedy("Hello there", 24)).choices[0].message;
    assert.ok(raw.choices[0].message.content.length > 0);
    assert.ok(!("reasoning_content" in raw.choices[0].message));
    const want = split(raw.choices[0].message.content);
    assert.equal(msg.reasoning_content, want.reasoning);
    assert.equal(msg.content, want.content);
  });

  check("chat stream: reasoning_content deltas add up to the non-streamed split", async () => {
    const whole = (await chatGreedy("Tell me more", 24)).choices[0].message;
    const stream = await chatGreedy("Tell me more", 24, { stream: true });
    let reasoning = "";
    let content = "";
    let pieces = 0;
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        if (c.delta?.reasoning_content) ++pieces;
        reasoning += c.delta?.reasoning_content ?? "";
        content += c.delta?.content ?? "";
      }
    }
    assert.ok(pieces >= 2, "thinking streams as it is generated");
    assert.equal(reasoning, whole.reasoning_content);
    assert.equal(content, whole.content);
  });

  check("completions are never split; a bad reasoning_format is a 400", async () => {
    const c = await greedy("<think>", 8);
    assert.ok(!("reasoning_content" in c.choices[0]));
    await expectError(
      "/v1/chat/completions",
      { messages: [{ role: "user", content: "x" }], reasoning_format: "xml" },
      400,
      { param: "reasoning_format", contains: "not a reasoning format" },
    );
  });
}

async function expectError(path, body, status, { param, code, headers, contains } = {}) {
  const r = await post(path, body, headers);
  assert.equal(r.status, status, `${path} ${String(body).slice(0, 80)} -> ${r.text}`);
  assert.ok(r.json && r.json.error, r.text);
  const e = r.json.error;
  for (const k of ["message", "type", "param", "code"]) assert.ok(k in e, `${k} in ${r.text}`);
  assert.equal(typeof e.message, "string");
  if (param !== undefined) assert.equal(e.param, param, r.text);
  if (code !== undefined) assert.equal(e.code, code, r.text);
  if (contains !== undefined) assert.ok(e.message.includes(contains), r.text);
  return r;
}

if (group === "errors") {
  let baseline = null;
  check("baseline metrics", async () => {
    await post("/v1/cache/reset", {});
    baseline = await metrics();
    assert.equal(baseline.value("num_requests_running"), 0);
  });

  check("401: no key, a wrong key (fetch and the openai client)", async () => {
    const body = { prompt: "x" };
    await expectError("/v1/completions", body, 401, { code: "invalid_api_key", headers: {} });
    await expectError("/v1/completions", body, 401, {
      code: "invalid_api_key",
      headers: { Authorization: "Bearer wrong" },
    });
    const r = await get("/v1/models", {});
    assert.equal(r.status, 401);
    const bad = new OpenAI({ baseURL: `${base}/v1`, apiKey: "wrong", maxRetries: 0 });
    await assert.rejects(
      bad.completions.create({ prompt: "x", max_tokens: 1, model: "x" }),
      (e) =>
        e instanceof OpenAI.AuthenticationError && e.status === 401 && e.code === "invalid_api_key",
    );
    // /health and /metrics stay open (probes, Prometheus).
    assert.equal((await get("/health", {})).status, 200);
    assert.equal((await get("/metrics", {})).status, 200);
  });

  // 400s naming a field, on completions and chat.
  const bad = (body, param, more = {}) =>
    expectError("/v1/completions", body, 400, { param, ...more });
  const chatMessages = [{ role: "user", content: "x" }];
  const badChat = (body, param, more = {}) =>
    expectError("/v1/chat/completions", { messages: chatMessages, ...body }, 400, {
      param,
      ...more,
    });

  check("400: malformed JSON, wrong types", async () => {
    await bad('{"prompt": ', null, { contains: "malformed JSON" });
    await bad('{"prompt": [1e999]}', null, { contains: "malformed JSON" });
    await bad("[]", null);
    await bad({ prompt: 5 }, "prompt");
    await bad({ prompt: "x", max_tokens: "5" }, "max_tokens");
    await bad({ prompt: "x", temperature: "hot" }, "temperature");
    await bad({ prompt: "x", stop: 3 }, "stop");
    await bad({ prompt: "x", n: 0 }, "n");
    await bad({ prompt: [1, "a"] }, "prompt[1]");
    await bad({ prompt: [999999] }, "prompt[0]");
    await badChat({ messages: [{ role: "robot", content: "x" }] }, "messages[0].role");
    await badChat({ messages: "hi" }, "messages");
    await badChat({ top_logprobs: 2 }, "top_logprobs");
    await expectError("/tokenize", { content: 3 }, 400, { param: "content" });
    await expectError("/detokenize", { tokens: [-1] }, 400, { param: "tokens[0]" });
  });

  check("the openai client sees the error's status, param and message", async () => {
    await assert.rejects(
      client.completions.create({ model: await modelId(), prompt: "x", max_tokens: 0 }),
      (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === "max_tokens",
    );
    await assert.rejects(
      client.completions.create({ model: "no-such-model", prompt: "x" }),
      (e) =>
        e instanceof OpenAI.NotFoundError && e.code === "model_not_found" && e.param === "model",
    );
    await assert.rejects(
      client.chat.completions.create({ model: await modelId(), messages: [], stream: true }),
      (e) => e.status === 400 && e.param === "messages",
    );
  });

  check("404 unknown model, 400 empty prompt, max_tokens < 1, unknown press", async () => {
    await expectError("/v1/completions", { model: "gpt-4", prompt: "x" }, 404, {
      param: "model",
      code: "model_not_found",
    });
    await bad({ prompt: "" }, "prompt", { contains: "empty" });
    await bad({ prompt: [] }, "prompt");
    await badChat({ messages: [] }, "messages");
    await bad({ prompt: "x", max_tokens: 0 }, "max_tokens");
    await bad({ prompt: "x", max_tokens: -3 }, "max_tokens");
    await badChat({ max_completion_tokens: 0 }, "max_completion_tokens");
    await bad({ prompt: "x", kv_press: { name: "squeeze", ratio: 0.5 } }, "kv_press.name", {
      contains: "unknown press",
    });
    await bad({ prompt: "x", kv_press: { name: "snapkv", ratio: 2 } }, "kv_press.ratio");
    await bad({ prompt: "x", echo: true }, "echo");
  });

  check("400 context_length_exceeded: a prompt longer than the context", async () => {
    const n_ctx = (await client.models.list()).data[0].max_model_len;
    const long = "word ".repeat(n_ctx + 10);
    await expectError("/v1/completions", { prompt: long, max_tokens: 1 }, 400, {
      param: "prompt",
      code: "context_length_exceeded",
    });
    await expectError(
      "/v1/chat/completions",
      { messages: [{ role: "user", content: long }], max_tokens: 1 },
      400,
      { param: "messages", code: "context_length_exceeded" },
    );
    const ids = Array.from({ length: n_ctx }, () => 5);
    await expectError("/v1/completions", { prompt: ids }, 400, { code: "context_length_exceeded" });
    // --on-full error: a chat's reply of max_tokens must fit after its messages (as OpenAI).
    await expectError(
      "/v1/chat/completions",
      { messages: [{ role: "user", content: "Hi" }], max_tokens: n_ctx },
      400,
      { param: "messages", code: "context_length_exceeded", contains: "max_tokens" },
    );
  });

  check("400 for n above -np + --max-waiting (its choices could never all be taken)", async () => {
    await bad({ prompt: "x", n: 3 }, "n", { contains: "-np + --max-waiting" });
  });

  // What the server answers a raw request (head lines, then body), on a connection of its own.
  async function raw(head, body = "") {
    const { hostname, port } = new URL(base);
    return new Promise((resolve, reject) => {
      const s = connect(Number(port), hostname, () => {
        s.write(
          `${head}\r\nHost: ${hostname}\r\nAuthorization: Bearer ${apiKey}\r\n` +
            `Connection: close\r\n\r\n${body}`,
        );
      });
      let got = "";
      s.on("data", (d) => (got += d));
      s.on("end", () => resolve(got));
      s.on("error", reject);
    });
  }

  check("a POST with neither a length nor chunks has an empty body, answered at once", async () => {
    // curl -X POST without -d sends no Content-Length (RFC 7230: no body). httplib waited 5 s for
    // the connection to close, then refused it; /v1/cache/reset takes no body at all.
    const t0 = Date.now();
    const text = await raw("POST /v1/completions HTTP/1.1");
    assert.ok(text.startsWith("HTTP/1.1 400"), text);
    assert.ok(text.includes("a POST needs a JSON body"), text);
    const reset = await raw("POST /v1/cache/reset HTTP/1.1");
    assert.ok(reset.startsWith("HTTP/1.1 200"), reset);
    assert.ok(Date.now() - t0 < 2000, `${Date.now() - t0} ms`);
  });

  check("400 for a Content-Length that is not a byte count", async () => {
    for (const length of ["-1", "99999999999999999999", "12abc"]) {
      const text = await raw(`POST /v1/completions HTTP/1.1\r\nContent-Length: ${length}`, "{}");
      assert.ok(text.startsWith("HTTP/1.1 400"), text);
      assert.ok(text.includes(`Content-Length '${length}' is not a byte count`), text);
    }
  });

  check("413 for a chunked body over 16 MiB (the limit held only with a Content-Length)", async () => {
    const piece = new TextEncoder().encode(" ".repeat(1 << 20));
    let sent = 0;
    const body = new ReadableStream({
      pull(controller) {
        if (sent++ < 20) controller.enqueue(piece);
        else controller.close();
      },
    });
    const r = await fetch(base + "/v1/completions", {
      method: "POST",
      headers: { ...authHeaders, "Content-Type": "application/json" },
      body,
      duplex: "half",
    }).catch((e) => e);
    assert.ok(!(r instanceof Error), String(r?.cause ?? r));
    assert.equal(r.status, 413, await r.text());
  });

  check("405 + Allow for a known path asked with another method", async () => {
    const g = await get("/v1/completions");
    assert.equal(g.status, 405, g.text);
    assert.equal(g.headers.get("allow"), "POST");
    assert.ok(JSON.parse(g.text).error.message.includes("takes POST"), g.text);
    const p = await post("/v1/models", {});
    assert.equal(p.status, 405, p.text);
    assert.equal(p.headers.get("allow"), "GET");
    for (const method of ["PUT", "PATCH", "OPTIONS"]) {  // were 404 "no such endpoint"
      const r = await fetch(base + "/v1/chat/completions", { method, headers: authHeaders });
      assert.equal(r.status, 405, `${method}: ${await r.text()}`);
      assert.equal(r.headers.get("allow"), "POST");
    }
  });

  check("a user message needs content; the auth scheme is case-insensitive", async () => {
    await badChat({ messages: [{ role: "user" }] }, "messages[0].content");
    await badChat({ messages: [{ role: "user", content: null }] }, "messages[0].content");
    const r = await post(
      "/v1/chat/completions",
      {
        messages: [
          { role: "system", content: "Be brief." },
          { role: "assistant" },
          { role: "user", content: "Hi" },
        ],
        max_tokens: 1,
      },
      { Authorization: `bearer ${apiKey}` },
    );
    assert.equal(r.status, 200, r.text);
  });

  check("404 JSON for an unknown endpoint; 413 for a body over the limit", async () => {
    const r = await post("/v1/nothing", {});
    assert.equal(r.status, 404);
    assert.ok(r.json?.error?.message.includes("/v1/nothing"), r.text);
    const big = await post("/v1/completions", JSON.stringify({ prompt: "x".repeat(17 << 20) }));
    assert.equal(big.status, 413);
    assert.ok(big.json?.error, big.text);
    // `curl -d` sends JSON as form-urlencoded: past 8 KiB httplib refused it with a 413 of its own.
    const form = await post(
      "/v1/completions",
      JSON.stringify({ prompt: "word ".repeat(2000), max_tokens: 1 }),
      { ...authHeaders, "Content-Type": "application/x-www-form-urlencoded" },
    );
    assert.equal(form.status, 200, form.text);
  });

  check("503 + Retry-After when the queue is full (-np 1 --max-waiting 1)", async () => {
    // A: running (long); B: waiting; C: refused.
    const a = await client.completions.create({
      model: await modelId(),
      prompt: PROMPT,
      max_tokens: 3000,
      ignore_eos: true,
      temperature: 0,
      stream: true,
    });
    const it = a[Symbol.asyncIterator]();
    await it.next();  // A is running
    const b = post("/v1/completions", { prompt: PROMPT, max_tokens: 2, temperature: 0 });
    await waitFor("B to wait", async () => (await metrics()).value("num_requests_waiting") === 1);
    const c = await post("/v1/completions", { prompt: PROMPT, max_tokens: 2 });
    assert.equal(c.status, 503, c.text);
    assert.ok(Number(c.headers.get("retry-after")) >= 1, "Retry-After");
    assert.ok(c.json?.error?.message, c.text);
    await assert.rejects(
      client.completions.create({ model: await modelId(), prompt: PROMPT, max_tokens: 2 }),
      (e) => e.status === 503,
    );
    a.controller.abort();  // the client leaves: A is cancelled, B runs
    const done = await b;
    assert.equal(done.status, 200, done.text);
  });

  check("after all of it: no request left, no page held", async () => {
    const m = await waitFor("requests to drain", async () => {
      const m = await metrics();
      return m.value("num_requests_running") === 0 && m.value("num_requests_waiting") === 0 && m;
    });
    assert.equal(pagesInUse(m), pagesInUse(baseline));
    await post("/v1/cache/reset", {});
    const after = await waitFor("the cache reset to show", async () => {
      const m = await metrics();
      return m.value("kv_cache_usage_perc") === baseline.value("kv_cache_usage_perc") && m;
    });
    assert.equal(after.value("kv_pages_used"), baseline.value("kv_pages_used"));
  });
}

// ---------------------------------------------------------------- load

// After a client left a request of max_tokens: the request finishes (cancelled, well short of
// max_tokens) and every page it held is back.
async function expectCancelled(baseline, max_tokens) {
  const finished = baseline.value("requests_finished_total");
  const m = await waitFor("the abandoned request to be cancelled", async () => {
    const m = await metrics();
    const idle = m.value("num_requests_running") === 0;
    return idle && m.value("requests_finished_total") > finished && m;
  });
  const generated = m.value("generation_tokens_total") - baseline.value("generation_tokens_total");
  assert.ok(generated < max_tokens, `${generated} tokens generated: the request was not cancelled`);
  assert.equal(pagesInUse(m), pagesInUse(baseline));
}

if (group === "load") {
  check("concurrent clients get the same greedy text as alone", async () => {
    const alone = [];
    const opts = { ignore_eos: true };
    for (const p of PROMPTS) alone.push((await greedy(p, 24, opts)).choices[0].text);
    for (let round = 0; round < 2; ++round) {
      const together = await Promise.all(
        [...PROMPTS, ...PROMPTS].map((p) => greedy(p, 24, opts)),
      );
      together.forEach((r, i) => assert.equal(r.choices[0].text, alone[i % 4], `prompt ${i % 4}`));
    }
    const streamed = await Promise.all(
      PROMPTS.map(async (p) => {
        const { texts } = await collect(await greedy(p, 24, { ...opts, stream: true }));
        return texts[0];
      }),
    );
    streamed.forEach((t, i) => assert.equal(t, alone[i], `streamed prompt ${i}`));
  });

  check("16 streaming clients over -np 4: all complete, no errors", async () => {
    const opts = { stream: true, ignore_eos: true, stream_options: { include_usage: true } };
    const results = await Promise.all(
      Array.from({ length: 16 }, (_, i) =>
        (i % 2
          ? chatGreedy(`${PROMPTS[i % 4]} (${i})`, 16, opts)
          : greedy(`${PROMPTS[i % 4]} (${i})`, 16, opts)
        ).then(collect),
      ),
    );
    results.forEach((r, i) => {
      const usage = r.chunks.at(-1).usage;
      if (i % 2) {
        // Chat stops at the template's end-of-turn strings too.
        assert.ok(["stop", "length"].includes(r.finish[0]), `client ${i}: ${r.finish[0]}`);
        assert.ok(usage.completion_tokens >= 1 && usage.completion_tokens <= 16);
      } else {
        assert.equal(r.finish[0], "length", `client ${i}`);
        assert.equal(usage.completion_tokens, 16, `client ${i}`);
      }
    });
  });

  check("a client that disconnects mid-stream frees its pages", async () => {
    await post("/v1/cache/reset", {});
    const baseline = await metrics();
    const finished = baseline.value("requests_finished_total");
    const stream = await greedy(LONG, 3000, { stream: true, ignore_eos: true });
    let seen = 0;
    for await (const chunk of stream) {
      if (++seen === 5) break;  // leaving the loop aborts the HTTP request
    }
    const during = await metrics();
    assert.ok(during.value("requests_finished_total") >= finished);
    await expectCancelled(baseline, 3000);
    await post("/v1/cache/reset", {});
    await waitFor("kv usage back to baseline", async () => {
      const m = await metrics();
      return m.value("kv_cache_usage_perc") === baseline.value("kv_cache_usage_perc");
    });
  });
}

if (group === "load") {
  check("a non-streaming client that disconnects frees its pages", async () => {
    await post("/v1/cache/reset", {});
    const baseline = await metrics();
    const controller = new AbortController();
    const pending = fetch(base + "/v1/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders },
      body: JSON.stringify({ prompt: LONG, max_tokens: 3000, ignore_eos: true, temperature: 0 }),
      signal: controller.signal,
    }).catch((e) => e);
    await waitFor("the request to run", async () => {
      const m = await metrics();
      return m.value("generation_tokens_total") > baseline.value("generation_tokens_total");
    });
    controller.abort();  // closes the connection while the server is still generating
    assert.equal((await pending).name, "AbortError");
    await expectCancelled(baseline, 3000);
  });
}

// ---------------------------------------------------------------- run

await runChecks("client.mjs", group, checks);
