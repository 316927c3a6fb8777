// Kept caches of `cachet serve` (/v1/caches, cache_id), against a server run.sh started with
// --disk-cache $WORK/disk-caches:
//   node caches.mjs caches BASE_URL          a cache's shape, completions and chat on it (equal to
//                                            `cachet run --cache` of its file), its pages held
//                                            once, errors, delete; leaves one cache for:
//   node caches.mjs caches_restart BASE_URL  the restarted server finds that cache on disk.
// Environment: CACHET (the binary), THREADS, WORK (run.sh's work directory).
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { promisify } from "node:util";
import OpenAI from "openai";
import { runChecks } from "./harness.mjs";

const [group, base] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });
const work = process.env.WORK;
const cacheDir = `${work}/disk-caches/caches`;
const stateFile = `${work}/caches-state.json`;
const run = promisify(execFile);

const VERSES = [
  "In the beginning God created the heaven and the earth.",
  "And the earth was without form, and void; and darkness was upon the face of the deep.",
  "And the Spirit of God moved upon the face of the waters.",
  "And God said, Let there be light: and there was light.",
];
// ~600 tokens: the cache's pages far outnumber what a request on it adds.
const CONTEXT = Array.from({ length: 24 }, (_, i) => `Verse ${i}: ${VERSES[i % 4]}`).join(" ");
const QUESTION = " And God saw the light, that it was";
const PRESS = { name: "snapkv", ratio: 0.5 };

const checks = [];
const check = (name, fn) => checks.push({ name, fn });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function call(method, path, body) {
  const res = await fetch(base + path, {
    method,
    headers: { "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: res.status, text, json };
}

async function createCache(body) {
  const r = await call("POST", "/v1/caches", body);
  assert.equal(r.status, 200, r.text);
  return r.json;
}

// /metrics: value(name) sums a family's samples.
async function metrics() {
  const res = await fetch(base + "/metrics");
  const text = await res.text();
  const value = (name) =>
    text
      .split("\n")
      .filter((l) => l.startsWith(`cachet:${name}{`))
      .reduce((s, l) => s + Number(l.slice(l.lastIndexOf(" ") + 1)), 0);
  return { value, text };
}
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

async function onCache(id, extra = {}) {
  const r = await call("POST", "/v1/completions", {
    prompt: QUESTION,
    cache_id: id,
    max_tokens: 16,
    temperature: 0,
    ...extra,
  });
  assert.equal(r.status, 200, r.text);
  return r.json;
}

async function cli(args) {
  const { stdout } = await run(process.env.CACHET, [
    ...args,
    "-q",
    "-t",
    process.env.THREADS ?? "2",
  ]);
  return stdout.replace(/\n$/, "");
}

if (group === "caches") {
  let pressed = null;
  let baseline = null;  // before any cache

  check("POST /v1/caches: a pressed context, its shape and its file", async () => {
    const before = await metrics();
    baseline = before;
    pressed = await createCache({ prompt: CONTEXT, kv_press: PRESS });
    assert.match(pressed.id, /^kvc-[0-9a-f]{32}$/);
    assert.equal(pressed.object, "kv_cache");
    assert.equal(typeof pressed.created, "number");
    assert.equal(pressed.compression, "snapkv ratio 0.500");
    assert.ok(pressed.tokens > 400, `${pressed.tokens} tokens`);
    assert.ok(pressed.bytes > 0);
    const plain = await createCache({ prompt: CONTEXT });
    assert.equal(plain.compression, "none");
    assert.equal(plain.tokens, pressed.tokens);
    assert.notEqual(plain.id, pressed.id);
    // About half the rows (the press keeps its window and sinks besides).
    assert.ok(pressed.held_rows < 0.6 * plain.held_rows, `${pressed.held_rows} ${plain.held_rows}`);
    assert.ok(existsSync(`${cacheDir}/${pressed.id}.ckv`));
    const m = await metrics();
    assert.equal(m.value("kv_caches"), before.value("kv_caches") + 2);
    assert.equal(m.value("kv_cache_bytes"), pressed.bytes + plain.bytes);
    const list = await call("GET", "/v1/caches");
    assert.deepEqual(list.json.data.map((c) => c.id).sort(), [pressed.id, plain.id].sort());
    assert.deepEqual((await call("GET", `/v1/caches/${pressed.id}`)).json, pressed);
    // Deleted: its pages, its metric and its file go.
    const del = await call("DELETE", `/v1/caches/${plain.id}`);
    assert.deepEqual(del.json, { id: plain.id, object: "kv_cache.deleted", deleted: true });
    assert.equal((await call("GET", `/v1/caches/${plain.id}`)).status, 404);
    assert.equal((await call("DELETE", `/v1/caches/${plain.id}`)).status, 404);
    assert.ok(!existsSync(`${cacheDir}/${plain.id}.ckv`));
    const after = await metrics();
    assert.equal(after.value("kv_caches"), before.value("kv_caches") + 1);
    assert.equal(after.value("kv_cache_bytes"), pressed.bytes);
  });

  check("completions on it equal `cachet run --cache` of its file, and differ without it", async () => {
    const [a, b] = await Promise.all([onCache(pressed.id), onCache(pressed.id)]);
    const text = a.choices[0].text;
    assert.ok(text.length > 0);
    assert.equal(b.choices[0].text, text);
    assert.ok(a.usage.prompt_tokens > pressed.tokens, `${a.usage.prompt_tokens} prompt tokens`);
    assert.equal(a.usage.prompt_tokens_details.cached_tokens, pressed.tokens);
    const file = `${cacheDir}/${pressed.id}.ckv`;
    const common = ["--temp", "0", "-n", "16", "-p", QUESTION];
    assert.equal(await cli(["run", "--cache", file, ...common]), text, "server vs its file");
    // The same context pressed by `cachet cache save` in another process.
    const saved = `${work}/cli-cache.ckv`;
    await run(process.env.CACHET, [
      ...["cache", "save", "-t", process.env.THREADS ?? "2", "-p", CONTEXT],
      ...["--press", "snapkv", "--ratio", "0.5", "-o", saved],
    ]);
    assert.equal(await cli(["run", "--cache", saved, ...common]), text, "server vs cache save");
    const alone = await call("POST", "/v1/completions", {
      prompt: QUESTION.trim(),
      max_tokens: 16,
      temperature: 0,
    });
    assert.notEqual(alone.json.choices[0].text, text);
    // n = 2: both choices fork the cache.
    const two = await onCache(pressed.id, { n: 2 });
    assert.deepEqual(
      two.choices.map((c) => c.text),
      [text, text],
    );
  });

  check("requests on a cache hold its pages once", async () => {
    const withCache = await waitFor("no request running", async () => {
      const m = await metrics();
      return m.value("num_requests_running") === 0 && m;
    });
    const cachePages = pagesInUse(withCache) - pagesInUse(baseline);
    assert.ok(cachePages > 100, `${cachePages} pages in use with the cache`);
    const streams = await Promise.all(
      [0, 1, 2].map(() =>
        client.completions.create({
          model: "kvtiny",
          prompt: QUESTION,
          // Long enough to be running when the metrics are read, short enough that the three
          // and the caches fit in the pool together (4096 tokens over 16 tables: no preemption).
          max_tokens: 400,
          ignore_eos: true,
          temperature: 0,
          stream: true,
          cache_id: pressed.id,
        }),
      ),
    );
    for (const s of streams) await s[Symbol.asyncIterator]().next();
    // The snapshot follows the scheduler's steps: under a sanitizer it can lag the first events.
    const during = await waitFor("the three requests running", async () => {
      const m = await metrics();
      return m.value("num_requests_running") === 3 && m;
    });
    // Each fork holds its own tokens' pages and a copy of each table's partly filled last page,
    // never the context's: at most (2 + its tokens / 16) pages per table (kvtiny: 8 layers x 2
    // KV heads), counted from the same /metrics snapshot, so it holds however late that is read.
    // One copy of the cache would add cachePages more.
    const tables = 16;
    const generated =
      during.value("generation_tokens_total") - withCache.value("generation_tokens_total");
    const bound = tables * (3 * 2 + Math.ceil(generated / 16));
    const added = pagesInUse(during) - pagesInUse(withCache);
    assert.ok(added > 0, `${added} pages added`);
    assert.ok(added <= bound, `${added} pages added by 3 requests (${generated} tokens); bound ${bound}`);
    assert.ok(bound < 3 * cachePages || generated > 640, `${generated} tokens before the check`);
    for (const s of streams) s.controller.abort();
    await waitFor("the requests' pages back", async () => {
      const m = await metrics();
      return m.value("num_requests_running") === 0 && pagesInUse(m) === pagesInUse(withCache);
    });
  });

  check("chat on a cache made from messages continues its conversation", async () => {
    const system = { role: "system", content: CONTEXT };
    const user = { role: "user", content: "What did God say?" };
    const cache = await createCache({ messages: [system], cache_salt: "tenant-chat" });
    const body = { max_tokens: 12, temperature: 0 };
    const onIt = await call("POST", "/v1/chat/completions", {
      ...body,
      messages: [user],
      cache_id: cache.id,
      cache_salt: "tenant-chat",
    });
    assert.equal(onIt.status, 200, onIt.text);
    assert.equal(onIt.json.usage.prompt_tokens_details.cached_tokens, cache.tokens);
    // kvtiny's template is plain: the cache holds the context's text (with BOS), the request
    // adds "\nUser: ...\nAssistant:" (tokenized on its own: at the seam the tokens may differ
    // from the whole text's). The same ids as one completion give the same reply (greedy).
    const tokenize = async (content, add_special) =>
      (await call("POST", "/tokenize", { content, add_special })).json.tokens;
    const ids = [
      ...(await tokenize(CONTEXT, true)),
      ...(await tokenize(`\nUser: ${user.content}\nAssistant:`, false)),
    ];
    assert.equal(onIt.json.usage.prompt_tokens, ids.length);
    const whole = await call("POST", "/v1/completions", { ...body, prompt: ids, stop: ["\nUser:", "\n\n"] });
    assert.equal(whole.status, 200, whole.text);
    assert.equal(onIt.json.choices[0].message.content, whole.json.choices[0].text);
    // Only with its salt.
    const other = await call("POST", "/v1/chat/completions", {
      ...body,
      messages: [user],
      cache_id: cache.id,
    });
    assert.equal(other.status, 404, other.text);
    assert.equal((await call("GET", `/v1/caches/${cache.id}`)).status, 404);
    assert.ok(!(await call("GET", "/v1/caches")).json.data.some((c) => c.id === cache.id));
    const salted = await call("GET", `/v1/caches/${cache.id}?cache_salt=tenant-chat`);
    assert.equal(salted.status, 200, salted.text);
    assert.equal((await call("DELETE", `/v1/caches/${cache.id}`)).status, 404);
    assert.equal((await call("DELETE", `/v1/caches/${cache.id}?cache_salt=tenant-chat`)).status, 200);
  });

  check("errors: unknown ids, cache_id with kv_press, bad bodies", async () => {
    const caches = (await metrics()).value("kv_caches");
    const unknown = "kvc-0123456789abcdef0123456789abcdef";
    for (const path of ["/v1/completions", "/v1/chat/completions"]) {
      const r = await call("POST", path, {
        prompt: QUESTION,
        messages: [{ role: "user", content: "Hi" }],
        cache_id: unknown,
      });
      assert.equal(r.status, 404, r.text);
      assert.equal(r.json.error.code, "cache_not_found");
      assert.equal(r.json.error.param, "cache_id");
      assert.ok(r.json.error.message.includes(unknown), r.text);
    }
    await assert.rejects(
      client.completions.create({ model: "kvtiny", prompt: "x", cache_id: unknown }),
      (e) => e.status === 404,
    );
    const both = await call("POST", "/v1/completions", {
      prompt: QUESTION,
      cache_id: pressed.id,
      kv_press: PRESS,
    });
    assert.equal(both.status, 400, both.text);
    assert.equal(both.json.error.param, "kv_press");
    assert.equal((await call("GET", `/v1/caches/${unknown}`)).status, 404);
    assert.equal((await call("GET", "/v1/caches/..%2F..%2Fetc")).status, 404);
    assert.equal((await call("DELETE", `/v1/caches/${unknown}`)).status, 404);
    for (const [body, param] of [
      [{}, "prompt"],
      [{ prompt: "a", messages: [{ role: "user", content: "b" }] }, "messages"],
      [{ prompt: "a", kv_press: { name: "nope" } }, "kv_press.name"],
      [{ messages: [{ role: "robot", content: "b" }] }, "messages[0].role"],
      [{ prompt: "x".repeat(40_000) }, "prompt"],
    ]) {
      const r = await call("POST", "/v1/caches", body);
      assert.equal(r.status, 400, `${JSON.stringify(body).slice(0, 80)}: ${r.text}`);
      assert.equal(r.json.error.param, param, r.text);
    }
    assert.equal((await metrics()).value("kv_caches"), caches);  // none of them made one
  });

  check("the pressed cache is left for the restarted server", async () => {
    const r = await onCache(pressed.id);
    writeFileSync(stateFile, JSON.stringify({ id: pressed.id, text: r.choices[0].text }));
  });
}

if (group === "caches_restart") {
  check("a restarted server finds the cache on disk and continues it the same", async () => {
    const { id, text } = JSON.parse(readFileSync(stateFile, "utf8"));
    assert.deepEqual((await call("GET", "/v1/caches")).json.data, []);  // not resident yet
    const r = await onCache(id);  // loaded on first use
    assert.equal(r.choices[0].text, text);
    const m = await metrics();
    assert.equal(m.value("kv_caches"), 1);
    const got = await call("GET", `/v1/caches/${id}`);
    assert.equal(got.status, 200, got.text);
    assert.equal(got.json.compression, "snapkv ratio 0.500");
    assert.equal(m.value("kv_cache_bytes"), got.json.bytes);
    assert.equal((await call("DELETE", `/v1/caches/${id}`)).status, 200);
    assert.ok(!existsSync(`${cacheDir}/${id}.ckv`));
    assert.equal((await metrics()).value("kv_caches"), 0);
  });
}

await runChecks("caches.mjs", group, checks);
