// Prints the speed tables (markdown) of one shape from the runs.jsonl bench/peers/synthetic.sh
// wrote: one line per measurement, {table, weights, threads, kv, engine, round, result}, where
// result is `cachet bench --json` or `llama_peer speed` output (engine "roofline": a short
// `cachet bench` run whose bandwidth and bytes per token give Cachet's decode roofline).
// usage: node synthetic_table.mjs RUNS.jsonl SHAPE
import {readFileSync} from "node:fs";

const [file, shape] = process.argv.slice(2);
const runs = readFileSync(file, "utf8").split("\n").filter(Boolean).map(JSON.parse);
const median = (v) => {
  const s = v.filter((x) => x !== undefined && x !== null && !Number.isNaN(x)).sort((a, b) => a - b);
  const n = s.length;
  if (n === 0) return undefined;
  return n % 2 ? s[(n - 1) / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
};
const num = (x) => (x === undefined ? "-" : x >= 100 ? x.toFixed(0) : x.toFixed(1));
const ratio = (x) => (x === undefined ? "" : ` (${x.toFixed(2)}x)`);
const mib = (r) => r.peak_rss_bytes / 2 ** 20;
const out = [];

// The rounds of one configuration, by round number.
const rounds = (table, weights, threads, kv, engine) => {
  const m = new Map();
  for (const r of runs) {
    if (r.table === table && r.weights === weights && r.threads === threads && r.kv === kv &&
        r.engine === engine) {
      m.set(r.round, r.result);
    }
  }
  return m;
};
// Cell "Cachet / llama.cpp (median of per-round ratios)"; "Cachet (ratio to base)" without a peer.
const cell = (c, l, get, base) => {
  const cv = median([...c.values()].map(get));
  if (l && l.size) {
    const lv = median([...l.values()].map(get));
    const x = median([...c.keys()].filter((k) => l.has(k)).map((k) => get(c.get(k)) / get(l.get(k))));
    return `${num(cv)} / ${num(lv)}${ratio(x)}`;
  }
  if (base && base.size) {
    const x = median([...c.keys()].filter((k) => base.has(k)).map((k) => get(c.get(k)) / get(base.get(k))));
    return `${num(cv)}${ratio(x)}`;
  }
  return num(cv);
};
const unique = (v) => [...new Set(v)];
const ctxOf = (rs) => unique(rs.flatMap((r) => Object.keys(r.result.prefill_tok_s ?? {}))).map(Number)
  .sort((a, b) => a - b);

out.push(`## ${shape} (synthetic GGUF, seed 1)`, "");

const w = runs.filter((r) => r.table === "weights" && r.engine !== "roofline");
if (w.length) {
  const ctx = ctxOf(w);
  const nRounds = Math.max(...w.map((r) => r.round));
  out.push(`Weights, KV f16 on both engines; cells: Cachet / llama.cpp tok/s (Cachet / llama.cpp, ` +
           `median of ${nRounds} rounds' ratios).`, "");
  out.push(`| weights | threads | ${ctx.map((n) => `prefill ${n}`).join(" | ")} | ` +
           `${ctx.map((n) => `decode @${n}`).join(" | ")} | peak RSS MiB | Cachet decode @${ctx[0]} / roofline | weights in 2 MiB pages |`);
  out.push(`| --- | ---: | ${ctx.map(() => "---:").join(" | ")} | ${ctx.map(() => "---:").join(" | ")} | ---: | ---: | ---: |`);
  for (const weights of unique(w.map((r) => r.weights))) {
    for (const t of unique(w.filter((r) => r.weights === weights).map((r) => r.threads))) {
      const c = rounds("weights", weights, t, "f16", "cachet");
      const l = rounds("weights", weights, t, "f16", "llama");
      const cells = [
        ...ctx.map((n) => cell(c, l, (r) => r.prefill_tok_s[n])),
        ...ctx.map((n) => cell(c, l, (r) => r.decode_tok_s[n])),
        cell(c, l, mib),
      ];
      const rf = rounds("weights", weights, t, "f16", "roofline").get(0);
      let roof = "-", huge = "-";
      if (rf?.weights_resident_bytes) {
        huge = `${((100 * rf.weights_huge_page_bytes) / rf.weights_resident_bytes).toFixed(0)}%`;
      }
      if (rf) {
        const tok = (rf.read_bandwidth_gb_s * 1e9) /
                    (rf.weight_bytes_per_token + rf.kv_bytes_per_context_token * ctx[0]);
        const d = median([...c.values()].map((r) => r.decode_tok_s[ctx[0]]));
        roof = `${((100 * d) / tok).toFixed(0)}% of ${num(tok)}`;
      }
      out.push(`| ${weights} | ${t} | ${cells.join(" | ")} | ${roof} | ${huge} |`);
    }
  }
  out.push("");
}

const k = runs.filter((r) => r.table === "kv");
if (k.length) {
  const ctx = ctxOf(k);
  const weights = k[0].weights;
  const nRounds = Math.max(...k.map((r) => r.round));
  for (const t of unique(k.map((r) => r.threads))) {
    out.push(`KV cache, ${weights} weights, ${t} thread(s), ${nRounds} round(s); cells: Cachet / ` +
             `llama.cpp tok/s (ratio), or for Cachet's own codecs Cachet tok/s (ratio to Cachet's ` +
             `f16 KV); last column: Cachet's decode @${ctx.at(-1)} / Cachet's f16 KV.`, "");
    out.push(`| KV (K:V) | ${ctx.map((n) => `prefill ${n}`).join(" | ")} | ` +
             `${ctx.map((n) => `decode @${n}`).join(" | ")} | peak RSS MiB | vs f16 KV @${ctx.at(-1)} |`);
    out.push(`| --- | ${ctx.map(() => "---:").join(" | ")} | ${ctx.map(() => "---:").join(" | ")} | ---: | ---: |`);
    const base = rounds("kv", weights, t, "f16", "cachet");
    for (const kv of unique(k.filter((r) => r.threads === t).map((r) => r.kv))) {
      const c = rounds("kv", weights, t, kv, "cachet");
      const l = rounds("kv", weights, t, kv, "llama");
      const own = kv === "f16" ? null : base;
      const cells = [
        ...ctx.map((n) => cell(c, l, (r) => r.prefill_tok_s[n], own)),
        ...ctx.map((n) => cell(c, l, (r) => r.decode_tok_s[n], own)),
        cell(c, l, mib, own),
      ];
      const last = ctx.at(-1);
      const vs = median([...c.keys()].filter((i) => base.has(i))
        .map((i) => c.get(i).decode_tok_s[last] / base.get(i).decode_tok_s[last]));
      const name = (l.size ? kv : `${kv} (Cachet)`).replace(/@(\d+)/, ", window $1");
      out.push(`| ${name} | ${cells.join(" | ")} | ${vs === undefined ? "-" : vs.toFixed(2) + "x"} |`);
    }
    out.push("");
  }
}
console.log(out.join("\n"));
