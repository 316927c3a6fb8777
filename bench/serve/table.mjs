// Markdown tables of bench/serve/run.sh's runs.jsonl: one per model and workload, one row per
// client count, each cell "Cachet / llama-server (Cachet / llama-server)"; then the issue's
// targets. Usage: node bench/serve/table.mjs RUNS.jsonl [RUNS.jsonl ...]
import { readFileSync } from "node:fs";

const runs = process.argv
  .slice(2)
  .flatMap((f) => readFileSync(f, "utf8").split("\n").filter(Boolean))
  .map((l) => JSON.parse(l));
const key = (r) => `${r.model}\t${r.workload}`;
const groups = [...new Set(runs.map(key))];

const fmt = (v) => {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 10) return v.toFixed(1);
  return v.toFixed(2);
};
const mib = (kib) => (kib ? Math.round(kib / 1024) : "-");

// A measurement: its value and whether it is only a lower bound (a TTFT percentile that requests
// without a first token reach).
const val = (value, lb = false) => ({ value, lb });
const show = (m) => (m ? `${m.lb ? ">=" : ""}${fmt(m.value)}` : "-");
// a / b, and what kind of bound the ratio is: a lower bound on b makes it an upper bound.
function ratioOf(a, b) {
  if (!a || !b || a.value == null || b.value == null) return null;
  if (b.value === 0) return a.value > 0 && !b.lb ? { r: Infinity, sign: "" } : null;
  if (!a.value) return null;
  if (a.lb && b.lb) return { r: a.value / b.value, sign: "?" };
  return { r: a.value / b.value, sign: a.lb ? ">=" : b.lb ? "<=" : "" };
}
const showRatio = (q) => (q.r === Infinity ? "inf" : `${q.sign}${q.r.toFixed(2)}x`);
const cell = (a, b) => {
  if (!a || !b) return show(a ?? b);
  const q = ratioOf(a, b);
  return `${show(a)} / ${show(b)}${q ? ` (${showRatio(q)})` : ""}`;
};

const out = [];
const targets = [];
for (const g of groups) {
  const [model, workload] = g.split("\t");
  const rows = runs.filter((r) => key(r) === g && !r.end);
  const ends = runs.filter((r) => key(r) === g && r.end);
  const engines = [...new Set(rows.map((r) => r.engine))];
  const clients = [...new Set(rows.filter((r) => !r.repeat).map((r) => r.clients))].sort(
    (a, b) => a - b,
  );
  const repeats = [...new Set(rows.filter((r) => r.repeat).map((r) => r.clients))];
  const get = (engine, c, repeat = false) =>
    rows.find((r) => r.engine === engine && r.clients === c && !!r.repeat === repeat);
  const first = rows[0];
  const res = first.result;
  const tokensOf = rows.find((r) => r.result.prompt_tokens_mean)?.result.prompt_tokens_mean;
  const desc =
    workload === "shared"
      ? `prompts of ~${tokensOf ?? "?"} tokens: one shared system prompt + a distinct question`
      : `distinct prompts of ~${tokensOf ?? "?"} tokens, no shared prefix`;
  const llamaEnv =
    first.llama_env && engines.includes("llama")
      ? ` llama-server ran with ${first.llama_env}.`
      : "";
  out.push(`### ${model}, ${workload} workload`);
  out.push("");
  out.push(
    `${desc}; ${res.requests_per_client} requests per client, ${res.max_tokens} tokens each ` +
      `(ignore_eos); ${first.threads} threads; KV for ${first.np} sequences of ${first.slot} ` +
      `tokens, f16 (Cachet's pool: ${first.kv_mib} MiB); ${res.time_limit_s} s per run at ` +
      `most. Cells: ${engines.join(" / ")}` +
      (engines.length > 1 ? ` (ratio ${engines[0]} / ${engines[1]})` : "") +
      "." +
      llamaEnv,
  );
  out.push("");
  out.push(
    "| clients | done | agg tok/s | decode tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms " +
      "| ITL p99 ms | errors | cached prompt tokens | RSS MiB before -> after | load |",
  );
  out.push("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
  const lines = [...clients.map((c) => [c, false]), ...repeats.map((c) => [c, true])];
  for (const [c, repeat] of lines) {
    const rs = engines.map((e) => get(e, c, repeat));
    const pair = (f) => cell(...rs.map((r) => (r ? f(r) : undefined)));
    const join = (f) => rs.map((r) => (r ? f(r) : "-")).join(" / ");
    const t = (r) => r.result.ttft_ms;
    out.push(
      `| ${c}${repeat ? " again" : ""} ` +
        `| ${join((r) => `${r.result.completed}/${r.planned ?? r.result.requests}`)} ` +
        `| ${pair((r) => val(r.result.agg_tok_s))} | ${pair((r) => val(r.result.decode_tok_s))} ` +
        `| ${pair((r) => val(t(r).p50, t(r).p50_lb))} ` +
        `| ${pair((r) => val(t(r).p99, t(r).p99_lb))} ` +
        `| ${pair((r) => val(r.result.itl_ms.p50))} | ${pair((r) => val(r.result.itl_ms.p99))} ` +
        `| ${join((r) => r.result.errors)} ` +
        `| ${join((r) => r.result.cached_tokens_mean ?? "-")} ` +
        `| ${join((r) => `${mib(r.rss_before_kib)} -> ${mib(r.rss_after_kib)}`)} ` +
        `| ${join((r) => r.loadavg)} |`,
    );
  }
  out.push("");
  const notes = [];
  const rssLine = ends
    .map((e) => `${e.engine} ${mib(e.rss_start_kib)} -> ${mib(e.rss_end_kib)} MiB`)
    .join(", ");
  if (rssLine) notes.push(`RSS after the warm-up -> after the last run: ${rssLine}.`);
  for (const r of rows) {
    const x = r.result;
    const what = [];
    if (x.aborted) what.push(`${x.aborted} aborted at the time limit`);
    if (x.requests < (r.planned ?? x.requests)) {
      what.push(`${r.planned - x.requests} not started within the time limit`);
    }
    if (x.ttft_ms.censored) what.push(`${x.ttft_ms.censored} without a first token`);
    if (x.errors) what.push(`errors: ${x.error_samples.join("; ")}`);
    if (r.idle_wait_s > 1) what.push(`busy for ${r.idle_wait_s} s after the run`);
    if (what.length) {
      const run = `${r.engine}, ${r.clients} clients${r.repeat ? " again" : ""}`;
      notes.push(`${run}: ${what.join(", ")}.`);
    }
  }
  out.push(...notes.map((n) => `- ${n}`));
  out.push("");

  // Targets (issue 14): at 16 clients, aggregate decode >= 1.5x llama-server's and >= 3x
  // Cachet's own single-stream; shared-prefix TTFT p50 <= 0.5x llama-server's.
  const c16 = get("cachet", 16);
  const l16 = get("llama", 16);
  const c1 = get("cachet", 1);
  const line = (measure, target, q, met) =>
    targets.push(
      `| ${model} | ${workload} | ${measure} | ${target} | ` +
        `${q ? showRatio(q) : "-"} | ${q && met(q) ? "met" : "not met"}` +
        `${q?.r === Infinity ? " (llama-server: none)" : ""} |`,
    );
  for (const [name, f] of [
    ["agg tok/s", (r) => val(r.result.agg_tok_s)],
    ["decode tok/s", (r) => val(r.result.decode_tok_s)],
  ]) {
    if (c16 && l16) {
      const q = ratioOf(f(c16), f(l16));
      line(`${name} at 16 clients / llama-server's`, ">= 1.5x", q, (x) => x.r >= 1.5);
    }
    if (c16 && c1) {
      line(
        `${name} at 16 clients / Cachet's 1-client decode tok/s`,
        ">= 3x",
        ratioOf(f(c16), val(c1.result.decode_tok_s)),
        (q) => q.r >= 3,
      );
    }
  }
  if (workload === "shared") {
    for (const c of clients) {
      const a = get("cachet", c);
      const b = get("llama", c);
      if (!a || !b) continue;
      const t = (r) => val(r.result.ttft_ms.p50, r.result.ttft_ms.p50_lb);
      line(`TTFT p50 at ${c} clients / llama-server's`, "<= 0.5x", ratioOf(t(a), t(b)), (q) =>
        q.r <= 0.5 && q.sign !== ">=" && q.sign !== "?",
      );
    }
  }
}
if (targets.length) {
  out.push("### Targets");
  out.push("");
  out.push("| model | workload | measure | target | Cachet | |");
  out.push("| --- | --- | --- | ---: | ---: | --- |");
  out.push(...targets);
  out.push("");
}
console.log(out.join("\n"));
