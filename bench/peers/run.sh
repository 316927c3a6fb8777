#!/usr/bin/env bash
# Cachet next to llama.cpp on one GGUF: same machine, thread counts, prompts and text windows, in
# one run (docs/PEERS.md). llama.cpp is the prebuilt CPU build that the npm package
# node-llama-cpp 3.21.1 ships, driven by a small native program (llama_peer.cc) compiled against
# it with the headers of the llama.cpp source bundled in the same package (bench/peers/setup.sh).
#
# usage: bench/peers/run.sh [MODEL.gguf]      (default: kvtiny converted to f16 by cachet convert)
#        bench/peers/run.sh --synthetic SHAPE[,SHAPE..]   speed only, on synthetic models of real
#                                                         shapes (bench/peers/synthetic.sh)
# environment: THREADS ("1 2"), REPS (rounds, 7), N_DECODE (64), WINDOWS (8), N_PREDICT (64),
#   CODECS, CODECS_P64 (Cachet's codecs for the KL table, with 16- and 64-token pages),
#   OUT (build/peers), CACHET (the cachet binary, build/bin/cachet: built when missing)
# Writes OUT/table.md (printed at the end) and the raw JSON of every measurement next to it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
if [ "${1:-}" = "--synthetic" ]; then
  exec "$here/synthetic.sh" "${2:?usage: bench/peers/run.sh --synthetic SHAPE[,SHAPE..]}"
fi
out="${OUT:-$root/build/peers}"
threads="${THREADS:-1 2}"
reps="${REPS:-7}"
n_decode="${N_DECODE:-64}"
windows="${WINDOWS:-8}"
n_predict="${N_PREDICT:-64}"
codecs="${CODECS:-f32,f16,q8_0,int8,q4_0,kivi4,rot4,q8_0:q4_0}"
# Per-channel KIVI keys carry a min and scale per channel and page: 64-token pages bring their
# cost to 0.5 bit/value, so kivi4 keys with q4_0 values store 4.5 bits like llama.cpp's q4_0.
codecs_p64="${CODECS_P64:-f32,kivi4:q4_0,kivi4}"
mkdir -p "$out"

cachet="${CACHET:-$root/build/bin/cachet}"
[ -x "$cachet" ] || "$root/scripts/build.sh"
peer="$("$here/setup.sh" "$out")"

model="${1:-}"
if [ -z "$model" ]; then
  model="$out/kvtiny-f16.gguf"
  [ -f "$model" ] || "$cachet" convert "$root/models/kvtiny" "$model" --type f16 >/dev/null
fi
echo "bench/peers: $model; threads: $threads; $(nproc) cores: $(lscpu | sed -n 's/^Model name: *//p')" >&2

# Speed: REPS rounds of one run of each engine (each in its own process), so that the load of a
# shared machine hits both alike; the table gives medians over rounds and of per-round ratios.
for t in $threads; do
  echo "bench/peers: speed, $t thread(s), $reps rounds" >&2
  : >"$out/llama_speed_t$t.jsonl"
  : >"$out/cachet_speed_t$t.jsonl"
  for _ in $(seq "$reps"); do
    "$peer" speed "$model" "$t" 512,4096 1 "$n_decode" f16 >>"$out/llama_speed_t$t.jsonl"
    "$cachet" bench -m "$model" -t "$t" --ctk f16 --ctv f16 --ctx 512,4096 --reps 1 \
      --n-decode "$n_decode" --json --no-roofline 2>/dev/null >>"$out/cachet_speed_t$t.jsonl"
  done
done

# Greedy continuations of the same prompts (f16 KV on both sides).
echo "bench/peers: greedy, $n_predict tokens" >&2
prompts=("In the beginning God created the heaven and the earth."
  "The standard library contains built-in modules"
  "def fibonacci(n):"
  "And it came to pass, when men began to multiply on the face of the earth,")
: >"$out/greedy.jsonl"
for p in "${prompts[@]}"; do
  c=$("$cachet" run -m "$model" -t 2 --ctk f16 --ctv f16 --no-prefix-cache --temp 0 \
    -n "$n_predict" --ids -q -p "$p")
  l=$("$peer" greedy "$model" 2 "$n_predict" f16 "$p")
  echo "{\"cachet\":$c,\"llama\":$l}" >>"$out/greedy.jsonl"
done

# KV fidelity: Cachet writes its text windows, llama.cpp scores the same token ids.
echo "bench/peers: KL on $windows text windows" >&2
"$cachet" eval -m "$model" -t 2 --kl --windows "$windows" --codec "$codecs" --no-progress \
  --dump-windows "$out/windows.jsonl" --json "$out/cachet_kl.jsonl" >/dev/null
"$cachet" eval -m "$model" -t 2 --kl --windows "$windows" --codec "$codecs_p64" --page-tokens 64 \
  --no-progress --json "$out/cachet_kl_pt64.jsonl" >/dev/null
"$peer" kl "$model" 2 "$out/windows.jsonl" f16,q8_0,q4_0 >"$out/llama_kl.json"

node "$here/table.mjs" "$out" "$model" "$threads" >"$out/table.md"
cat "$out/table.md"
