// llama.cpp side of the peer harness, through node-llama-cpp 3.21.1 (prebuilt CPU binaries).
// usage: node llama_peer.mjs greedy MODEL.gguf THREADS N_TOKENS TOKEN_IDS_JSON
// prints one JSON line: {"tokens": [...], "prefill_ms": ..., "decode_ms": ...}
import {getLlama} from "node-llama-cpp";

const [mode, modelPath, threadsArg, nArg, idsArg] = process.argv.slice(2);
const llama = await getLlama({gpu: false, logLevel: "error"});
const model = await llama.loadModel({modelPath});
const threads = Number(threadsArg);
if (mode === "greedy") {
  const ids = JSON.parse(idsArg);
  const ctx = await model.createContext({contextSize: 4096, threads, batchSize: 512});
  const seq = ctx.getSequence();
  const out = [];
  const t0 = performance.now();
  let t1 = 0;
  for await (const tok of seq.evaluate(ids, {temperature: 0})) {
    if (out.length === 0) t1 = performance.now();
    out.push(tok);
    if (out.length >= Number(nArg)) break;
  }
  const t2 = performance.now();
  console.log(JSON.stringify({tokens: out, prefill_ms: t1 - t0, decode_ms: t2 - t1,
                              tokenized: model.tokenize("In the beginning God created the heaven and the earth.")}));
}
await model.dispose();
