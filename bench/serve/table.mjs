// Markdown tables of bench/serve/run.sh's runs.jsonl: one per model and workload, one row per
// client count, each cell "Cachet / llama-server (Cachet / llama-server)"; then the issue's
// targets. Usage: node bench/serve/table.mjs OUT/runs.jsonl
import { readFileSync } from "node:fs";

const lines = readFileSync(process.argv[2], "utf8").split("\n").filter(Boolean);
const runs = lines.map((l) => JSON.parse(l));
const key = (r) => `${r.model}\t${r.workload}`;
const groups = [...new Set(runs.map(key))];

const fmt = (v) => {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 10) return v.toFixed(1);
  return v.toFixed(2);
};
const mib = (kib) => (kib ? Math.round(kib / 1024) : "-");
const ratio = (a, b) => (a && b ? a / b : null);
const cell = (c, l) => {
  if (c === undefined && l === undefined) return "-";
  if (l === undefined) return fmt(c);
  if (c === undefined) return fmt(l);
  const r = ratio(c, l);
  return `${fmt(c)} / ${fmt(l)}${r ? ` (${r.toFixed(2)}x)` : ""}`;
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
  const desc =
    workload === "shared"
      ? `prompts of ~${res.prompt_tokens_mean ?? "?"} tokens: one shared system prompt + a ` +
        "distinct question"
      : `distinct prompts of ~${res.prompt_tokens_mean ?? "?"} tokens, no shared prefix`;
  out.push(`### ${model}, ${workload} workload`);
  out.push("");
  out.push(
    `${desc}; ${res.requests_per_client} requests per client, ${res.max_tokens} tokens each ` +
      `(ignore_eos); ${first.threads} threads; KV for ${first.np} sequences of ${first.slot} ` +
      `tokens, f16 (Cachet's pool: ${first.kv_mib} MiB). Cells: ${engines.join(" / ")}` +
      (engines.length > 1 ? ` (ratio ${engines[0]} / ${engines[1]})` : "") +
      "." +
      (first.llama_env && engines.includes("llama") ? ` llama-server ran with ${first.llama_env}.` : ""),
  );
  out.push("");
  out.push(
    "| clients | agg tok/s | decode tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms " +
      "| errors | aborted | cached prompt tokens | RSS MiB before -> after | load |",
  );
  out.push("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
  const lines = [...clients.map((c) => [c, false]), ...repeats.map((c) => [c, true])];
  for (const [c, repeat] of lines) {
    const rs = engines.map((e) => get(e, c, repeat));
    const v = (f) => rs.map((r) => (r ? f(r) : undefined));
    const pair = (f) => {
      const [a, b] = v(f);
      return cell(a, b);
    };
    const join = (f) => v(f).map((x) => (x === undefined ? "-" : x)).join(" / ");
    out.push(
      `| ${c}${repeat ? " again" : ""} | ${pair((r) => r.result.agg_tok_s)} | ${pair((r) => r.result.decode_tok_s)} ` +
        `| ${pair((r) => r.result.ttft_ms.p50)} | ${pair((r) => r.result.ttft_ms.p99)} ` +
        `| ${pair((r) => r.result.itl_ms.p50)} | ${pair((r) => r.result.itl_ms.p99)} ` +
        `| ${join((r) => r.result.errors)} | ${join((r) => r.result.aborted)} ` +
        `| ${join((r) => r.result.cached_tokens_mean ?? "-")} ` +
        `| ${join((r) => `${mib(r.rss_before_kib)} -> ${mib(r.rss_after_kib)}`)} ` +
        `| ${join((r) => r.loadavg)} |`,
    );
  }
  out.push("");
  const rssLine = ends
    .map((e) => `${e.engine} ${mib(e.rss_start_kib)} -> ${mib(e.rss_end_kib)} MiB`)
    .join(", ");
  out.push(`RSS after the warm-up -> after the last run: ${rssLine}.`);
  out.push("");

  // Targets (issue 14): at 16 clients, aggregate decode >= 1.5x llama-server's and >= 3x
  // Cachet's own single-stream; shared-prefix TTFT p50 <= 0.5x llama-server's.
  const c16 = get("cachet", 16);
  const l16 = get("llama", 16);
  const c1 = get("cachet", 1);
  if (c16 && l16) {
    for (const [name, f] of [
      ["agg tok/s", (r) => r.result.agg_tok_s],
      ["decode tok/s", (r) => r.result.decode_tok_s],
    ]) {
      const r = ratio(f(c16), f(l16));
      targets.push(
        `| ${model} | ${workload} | ${name} at 16 clients vs llama-server's | >= 1.5x | ` +
          `${r ? r.toFixed(2) : "-"}x | ${r >= 1.5 ? "met" : "not met"} |`,
      );
    }
  }
  if (c16 && c1) {
    for (const [name, f] of [
      ["agg tok/s", (r) => r.result.agg_tok_s],
      ["decode tok/s", (r) => r.result.decode_tok_s],
    ]) {
      const r = ratio(f(c16), c1.result.decode_tok_s);
      targets.push(
        `| ${model} | ${workload} | ${name} at 16 clients vs Cachet's single-stream decode | ` +
          `>= 3x | ${r ? r.toFixed(2) : "-"}x | ${r >= 3 ? "met" : "not met"} |`,
      );
    }
  }
  if (workload === "shared") {
    for (const c of clients) {
      const a = get("cachet", c);
      const b = get("llama", c);
      if (!a || !b) continue;
      const r = ratio(a.result.ttft_ms.p50, b.result.ttft_ms.p50);
      targets.push(
        `| ${model} | ${workload} | TTFT p50 at ${c} clients vs llama-server's | <= 0.5x | ` +
          `${r ? r.toFixed(2) : "-"}x | ${r !== null && r <= 0.5 ? "met" : "not met"} |`,
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
