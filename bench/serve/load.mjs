// Load generator of the serving benchmark (bench/serve/run.sh; docs/BENCHMARKS.md, "Serving").
// Node >= 18, no npm dependencies: node:http (one connection per request) and a small SSE parser.
//
//   node bench/serve/load.mjs --url http://127.0.0.1:PORT --clients C [options]
//
// C clients each send --requests streaming POST /v1/completions, one after the other (a closed
// loop), all at temperature 0 with ignore_eos (so every request generates --max-tokens tokens,
// as both cachet serve and llama-server honour it) and stream_options.include_usage. Workloads:
//   shared: every prompt is one common system prompt of about --prompt-tokens tokens followed by
//           a short distinct question (about --question-tokens tokens): the prefix-cache case;
//   unique: every prompt is distinct words of about --unique-tokens tokens (default
//           --prompt-tokens), the first ones drawn per request, so no two share a prefix;
//   short:  the same with --short-tokens tokens (16): next to nothing to prefill or attend to,
//           so the run is decode steps, batched as the server batches them.
// Prompts are random words from a fixed list drawn by a seeded generator (--seed), so every engine
// gets the same text; their length in tokens is calibrated once against the server's own
// POST /tokenize (cachet serve and llama-server both have it), and each request's real count
// comes back in usage.prompt_tokens.
//
// Per request: TTFT (sending to the first chunk that carries a token), inter-token latencies
// (gaps between successive token chunks: both servers send one chunk per token, and a closing
// chunk with only finish_reason, which is not counted), tokens
// (usage.completion_tokens; the number of choice chunks when a server sends no usage), cached
// prompt tokens (usage.prompt_tokens_details.cached_tokens where given), errors (a status other
// than 200, an error event, a broken connection, no [DONE]). Bounded: no request starts after
// --time-limit seconds, and requests still running at --time-limit + --grace are aborted (counted
// as `aborted`, not as errors).
//
// Prints one JSON object on stdout: the configuration, and
//   agg_tok_s     completion tokens of all requests (those of a request that failed or was
//                 aborted after some tokens included) / wall time of the run;
//   decode_tok_s  tokens after each request's first / the time during which at least one request
//                 was between its first and last token (the union of those intervals);
//   ttft_ms, itl_ms {p50, p99, mean, n} over every request that delivered tokens (TTFT also over
//   those that ended without a token, with the time they ended as a lower bound: then `censored`
//   counts them, and p50_lb / p99_lb say that the percentile is only a lower bound); e2e_ms over
//   completed ones; requests, completed, errors, aborted, prompt_tokens and cached_tokens (means
//   over completed requests), completion_tokens (total), error_samples (distinct messages).
// A one-line summary goes to stderr.
// Request r of client c gets prompt number --first-prompt + c * --requests + r (default 1), so
// that successive runs against one server can be given prompts none of them repeats.
// --warmup sends one request of the workload (question 0 / prompt 0) and prints its JSON only.
import { setMaxListeners } from "node:events";
import http from "node:http";

const args = parseArgs(process.argv.slice(2));
const url = new URL(args.url ?? die("--url is required"));
const clients = int("clients", 1);
const requests = int("requests", 2);
const maxTokens = int("max-tokens", 32);
const workload = args.workload ?? "shared";
if (!["shared", "unique", "short"].includes(workload)) {
  die(`--workload: shared, unique or short, not ${workload}`);
}
const promptTokens = int("prompt-tokens", 2000);
const uniqueTokens =
  workload === "short" ? int("short-tokens", 16) : int("unique-tokens", promptTokens);
const questionTokens = int("question-tokens", 24);
const timeLimit = num("time-limit", 120);
const grace = num("grace", 30);
const seed = int("seed", 1);
const firstPrompt = int("first-prompt", 1);
const model = args.model;  // optional: the "model" field
const label = args.label ?? "";

function parseArgs(argv) {
  const out = {};
  for (let i = 0; i < argv.length; ++i) {
    if (!argv[i].startsWith("--")) die(`unexpected argument ${argv[i]}`);
    const key = argv[i].slice(2);
    if (key === "warmup") out.warmup = true;
    else out[key] = argv[++i];
  }
  return out;
}
function die(msg) {
  console.error(`bench/serve/load.mjs: ${msg}`);
  process.exit(2);
}
function int(name, def) {
  const v = args[name] === undefined ? def : Number(args[name]);
  if (!Number.isInteger(v) || v < 0) die(`--${name}: a non-negative integer, not ${args[name]}`);
  return v;
}
function num(name, def) {
  const v = args[name] === undefined ? def : Number(args[name]);
  if (!(v > 0)) die(`--${name}: a positive number, not ${args[name]}`);
  return v;
}

// --- Prompts -------------------------------------------------------------------------------------

const WORDS = (
  "the of and to in is was that for on with as by at from his her they this be are not or which " +
  "one all were when there an their has had have more will would about out up into after other " +
  "time people year way day man thing woman life child world school state family student group " +
  "country problem hand part place case week company system program question work government " +
  "number night point home water room mother area money story fact month lot right study book " +
  "eye job word business issue side kind head house service friend father power hour game line " +
  "end member law car city community name president team minute idea kid body information back " +
  "parent face others level office door health person art war history party result change " +
  "morning reason research girl guy moment air teacher force education river garden stone light " +
  "king land sea field mountain bread wine silver gold fire wind voice heart spirit truth " +
  "green blue red white black small large early young old long great little good new first last"
).split(" ");

// mulberry32: a small seeded generator, so that every engine gets the same prompts.
function rng(s) {
  let a = s >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
function words(s, n) {
  const r = rng(s);
  const out = [];
  for (let i = 0; i < n; ++i) out.push(WORDS[Math.floor(r() * WORDS.length)]);
  return out.join(" ");
}

// A fresh connection per request: a kept-alive socket that the server closed after a stream
// (llama-server does) would fail the next request with "socket hang up".
const agent = new http.Agent({ keepAlive: false, maxSockets: Infinity });

function request(path, body, onData, signal) {
  return new Promise((resolve, reject) => {
    const data = Buffer.from(JSON.stringify(body));
    const req = http.request(
      {
        host: url.hostname,
        port: url.port,
        path,
        method: "POST",
        agent,
        signal,
        headers: { "Content-Type": "application/json", "Content-Length": data.length },
      },
      (res) => {
        res.setEncoding("utf8");
        let text = "";
        res.on("data", (chunk) => {
          if (onData && res.statusCode === 200) onData(chunk);
          else text += chunk;
        });
        res.on("end", () => resolve({ status: res.statusCode, text }));
        res.on("error", reject);
        res.on("aborted", () => reject(new Error("response aborted")));
      },
    );
    req.on("error", reject);
    req.end(data);
  });
}

async function countTokens(text) {
  const r = await request("/tokenize", { content: text, add_special: false });
  if (r.status !== 200) throw new Error(`/tokenize: HTTP ${r.status}: ${r.text.slice(0, 200)}`);
  return JSON.parse(r.text).tokens.length;
}

// The number of words whose text is about `target` tokens (within a few), by /tokenize.
async function wordsFor(s, target) {
  if (target <= 0) return 0;
  let n = Math.max(1, Math.round(target / 1.3));
  for (let i = 0; i < 6; ++i) {
    const t = await countTokens(words(s, n));
    if (Math.abs(t - target) <= Math.max(2, target * 0.005)) break;
    n = Math.max(1, Math.round((n * target) / Math.max(1, t)));
  }
  return n;
}

// --- Requests ------------------------------------------------------------------------------------

function percentile(xs, p) {
  if (xs.length === 0) return null;
  const s = [...xs].sort((a, b) => a - b);
  const rank = (p / 100) * (s.length - 1);
  const lo = Math.floor(rank);
  const hi = Math.ceil(rank);
  return s[lo] + (s[hi] - s[lo]) * (rank - lo);
}
// censored: samples that are only lower bounds (a request that never got its first token);
// a percentile at or above the smallest of them is itself only a lower bound (p50_lb, p99_lb).
function summary(xs, censored = []) {
  const round = (v) => (v === null ? null : Math.round(v * 100) / 100);
  const all = [...xs, ...censored];
  const p50 = percentile(all, 50);
  const p99 = percentile(all, 99);
  const floor = censored.length ? Math.min(...censored) : Infinity;
  const out = {
    p50: round(p50),
    p99: round(p99),
    mean: round(all.length ? all.reduce((a, b) => a + b, 0) / all.length : null),
    n: all.length,
  };
  if (censored.length) {
    out.censored = censored.length;
    out.p50_lb = p50 >= floor;
    out.p99_lb = p99 >= floor;
  }
  return out;
}

// One streaming completion; resolves to its measurements (never rejects).
async function completion(prompt, signal) {
  const body = {
    prompt,
    max_tokens: maxTokens,
    temperature: 0,
    ignore_eos: true,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (model) body.model = model;
  const m = { start: performance.now(), chunks: [], usage: null, error: null, done: false };
  let buffer = "";
  const onData = (chunk) => {
    const now = performance.now();
    buffer += chunk;
    let at;
    while ((at = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, at);
      buffer = buffer.slice(at + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;  // ": keep-alive" comments, event names
        const data = line.slice(5).trim();
        if (data === "[DONE]") {
          m.done = true;
          continue;
        }
        let j;
        try {
          j = JSON.parse(data);
        } catch {
          m.error ??= `unparsable event: ${data.slice(0, 120)}`;
          continue;
        }
        if (j.error) m.error ??= `error event: ${JSON.stringify(j.error).slice(0, 200)}`;
        if (j.usage) m.usage = j.usage;
        // A token's chunk; not the closing one that only carries finish_reason.
        const c = Array.isArray(j.choices) ? j.choices[0] : undefined;
        if (c && (c.finish_reason == null || (c.text ?? c.delta?.content ?? "") !== "")) {
          m.chunks.push(now);
        }
      }
    }
  };
  try {
    const r = await request("/v1/completions", body, onData, signal);
    if (r.status !== 200) m.error ??= `HTTP ${r.status}: ${r.text.slice(0, 200)}`;
    else if (!m.done) m.error ??= "the stream ended without [DONE]";
  } catch (e) {
    if (signal?.aborted) m.aborted = true;
    else m.error ??= `connection: ${e.message}`;
  }
  m.end = performance.now();
  return m;
}

async function main() {
  const t0 = performance.now();
  // Calibrate the prompt lengths on this server's tokenizer.
  const systemWords = workload === "shared" ? await wordsFor(seed, promptTokens) : 0;
  const questionWords = workload === "shared" ? await wordsFor(seed + 7, questionTokens) : 0;
  const uniqueWords = workload !== "shared" ? await wordsFor(seed + 11, uniqueTokens) : 0;
  const notes = words(seed, systemWords);
  const system = `You are a helpful assistant. Read the notes and answer.\nNotes: ${notes}\n`;
  const promptOf = (k) =>
    workload === "shared"
      ? `${system}Question ${k}: ${words(seed * 1000003 + k + 1, questionWords)}?\nAnswer:`
      : `${words(seed * 7919 + k + 1, uniqueWords)}\nContinue:`;
  const calibrate_s = (performance.now() - t0) / 1000;

  if (args.warmup) {
    const m = await completion(promptOf(0));
    console.log(JSON.stringify({ warmup: true, error: m.error, usage: m.usage, calibrate_s }));
    process.exit(m.error ? 1 : 0);
  }

  const controller = new AbortController();
  setMaxListeners(0, controller.signal);  // one listener per request in flight
  const start = performance.now();
  const deadline = start + timeLimit * 1000;
  const killer = setTimeout(() => controller.abort(), (timeLimit + grace) * 1000);
  const results = [];
  await Promise.all(
    Array.from({ length: clients }, async (_, c) => {
      for (let r = 0; r < requests && performance.now() < deadline; ++r) {
        // Prompt 0 is the warm-up's; every measured request has its own question / prompt
        // (--first-prompt keeps runs against one server from repeating each other's).
        results.push(await completion(promptOf(firstPrompt + c * requests + r), controller.signal));
      }
    }),
  );
  clearTimeout(killer);
  const wall = (performance.now() - start) / 1000;

  const ttft = [];
  const ttftCensored = [];  // requests that ended (aborted, failed) before their first token
  const itl = [];
  const e2e = [];
  const spans = [];
  let tokens = 0;
  let afterFirst = 0;
  let prompt = 0;
  let cached = 0;
  let completed = 0;
  const errors = [];
  for (const m of results) {
    if (m.error) errors.push(m.error);
    if (!m.aborted && !m.error) {
      ++completed;
      prompt += m.usage?.prompt_tokens ?? 0;
      cached += m.usage?.prompt_tokens_details?.cached_tokens ?? 0;
      e2e.push(m.end - m.start);
    }
    // Tokens a request delivered count even when it then failed or was aborted: they were
    // generated within the wall time.
    const n = m.usage?.completion_tokens ?? m.chunks.length;
    tokens += n;
    if (m.chunks.length === 0) {
      ttftCensored.push(m.end - m.start);
      continue;
    }
    ttft.push(m.chunks[0] - m.start);
    for (let i = 1; i < m.chunks.length; ++i) itl.push(m.chunks[i] - m.chunks[i - 1]);
    afterFirst += n - 1;
    spans.push([m.chunks[0], m.chunks[m.chunks.length - 1]]);
  }
  spans.sort((a, b) => a[0] - b[0]);
  let decodeTime = 0;
  let cur = null;
  for (const s of spans) {
    if (cur && s[0] <= cur[1]) cur[1] = Math.max(cur[1], s[1]);
    else {
      if (cur) decodeTime += cur[1] - cur[0];
      cur = [...s];
    }
  }
  if (cur) decodeTime += cur[1] - cur[0];
  const r1 = (v) => Math.round(v * 10) / 10;
  const result = {
    label,
    workload,
    clients,
    requests_per_client: requests,
    max_tokens: maxTokens,
    time_limit_s: timeLimit,
    requests: results.length,
    completed,
    errors: errors.length,
    aborted: results.filter((m) => m.aborted).length,
    wall_s: Math.round(wall * 1000) / 1000,
    completion_tokens: tokens,
    agg_tok_s: r1(tokens / wall),
    decode_tok_s: decodeTime > 0 ? r1(afterFirst / (decodeTime / 1000)) : null,
    ttft_ms: summary(ttft, ttftCensored),
    itl_ms: summary(itl),
    e2e_ms: summary(e2e),
    prompt_tokens_mean: completed ? Math.round(prompt / completed) : null,
    cached_tokens_mean: completed ? Math.round(cached / completed) : null,
    calibrate_s: Math.round(calibrate_s * 100) / 100,
    error_samples: [...new Set(errors)].slice(0, 3),
  };
  console.log(JSON.stringify(result));
  console.error(
    `bench/serve/load.mjs: ${label ? `${label}, ` : ""}${workload}, ${clients} clients: ` +
      `${result.agg_tok_s} tok/s, decode ${result.decode_tok_s} tok/s, TTFT p50 ` +
      `${result.ttft_ms.p50} ms, ITL p50 ${result.itl_ms.p50} ms, ${result.completed} done, ` +
      `${result.errors} errors, ${result.aborted} aborted, ${result.wall_s} s`,
  );
  process.exit(0);
}

main().catch((e) => die(e.stack ?? String(e)));
