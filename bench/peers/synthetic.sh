#!/usr/bin/env bash
# Speed of Cachet next to llama.cpp on synthetic models of real shapes (models/shapes, issue 13):
# `bench/peers/run.sh --synthetic SHAPE[,SHAPE..]` runs this. Each shape's GGUFs (seed 1) are
# written once by `cachet convert --synthetic` and cached in SYNTH_DIR; then, per shape, two
# tables (docs/PEERS.md):
#   weights: every weight type x thread count, KV f16 on both engines, prefill and decode at the
#     POINTS context lengths, peak RSS, and Cachet's decode at the first point as a fraction of
#     the roofline `cachet bench` measures, and the share of its weights it found in 2 MiB pages
#     (each file is dropped from the page cache first, so that both engines map it so);
#   KV: at one weight type (KV_WEIGHTS) and LONG_THREADS threads, the KV types both engines have
#     (KVS) and Cachet's own codecs (CACHET_KVS) at POINTS plus the LONG context lengths.
# Each round runs every configuration of a group once, one process each, llama.cpp then Cachet,
# so that the load of the shared machine hits both alike; tables give medians over rounds and the
# median of the per-round ratios.
#
# environment (defaults):
#   WEIGHTS ("f16 q8_0 q4_0 q4_k"; any `cachet convert --type`, q4_k_m included), THREADS ("1 2"),
#   POINTS ("512 2048"), REPS (3),
#   N_DECODE (32 decode steps after each prefill),
#   KV_WEIGHTS (weights of the KV table: f16 on mha-85m, q4_0 on the others), KVS ("f16 q8_0 q4_0"),
#   CACHET_KVS ("kivi4 rot3@32 q4_0:rot3@32": K[:V] codecs, @N = --kv-window N), LONG ("8192";
#   "8192 16384" on mha-85m), LONG_THREADS ("2"), REPS_LONG (1), KV_TABLE (1; 0 skips it),
#   QUICK=1: the ~5-minute subset on tinyllama-1.1b (q4_0 weights, 2 threads, 512 and 2048
#     tokens, KV f16, 5 rounds, no KV table), unless the knobs above are set,
#   SYNTH_DIR (build/synthetic), OUT (build/peers/synthetic; llama_peer is built in its parent
#   directory), CACHET (build/bin/cachet).
# Writes OUT/SHAPE/runs.jsonl (every measurement) and OUT/table.md (printed at the end).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
shapes="${1:?usage: bench/peers/synthetic.sh SHAPE[,SHAPE..]}"
if [ "${QUICK:-0}" = 1 ]; then
  : "${WEIGHTS:=q4_0}" "${THREADS:=2}" "${POINTS:=512 2048}" "${REPS:=5}" "${KV_TABLE:=0}"
fi
weights="${WEIGHTS:-f16 q8_0 q4_0 q4_k}"
threads="${THREADS:-1 2}"
points="${POINTS:-512 2048}"
reps="${REPS:-3}"
n_decode="${N_DECODE:-32}"
kvs="${KVS:-f16 q8_0 q4_0}"
cachet_kvs="${CACHET_KVS:-kivi4 rot3@32 q4_0:rot3@32}"
long_threads="${LONG_THREADS:-2}"
reps_long="${REPS_LONG:-1}"
kv_table="${KV_TABLE:-1}"
synth="${SYNTH_DIR:-$root/build/synthetic}"
out="${OUT:-$root/build/peers/synthetic}"
cachet="${CACHET:-$root/build/bin/cachet}"
mkdir -p "$synth" "$out"
[ -x "$cachet" ] || "$root/scripts/build.sh"
peer="$("$here/setup.sh" "$(dirname "$out")")"  # build/peers, as run.sh's

log() { echo "bench/peers/synthetic: $*" >&2; }
csv() { echo "$*" | tr ' ' ','; }

# The GGUF of a shape at a weight type, written on first use.
model_of() {
  local f
  f="$synth/$(basename "$1" .json)-$2.gguf"
  if [ ! -f "$f" ]; then
    log "writing $f"
    "$cachet" convert --synthetic "$1" "$f.tmp" --type "$2" --seed 1 >&2
    mv "$f.tmp" "$f"
  fi
  echo "$f"
}

# One measurement, appended to runs.jsonl: table, weights, threads, kv, engine, round, result.
record() {
  local json
  json="$(cat)"
  [ -n "$json" ] || { log "no result from $5 ($2, kv $4, $3 threads)"; exit 1; }
  printf '{"table":"%s","weights":"%s","threads":%s,"kv":"%s","engine":"%s","round":%s,"result":%s}\n' \
    "$1" "$2" "$3" "$4" "$5" "$6" "$json" >>"$runs"
}

run_llama() {  # model threads ctx_csv kv
  "$peer" speed "$1" "$2" "$3" 1 "$n_decode" "$4"
}
run_cachet() {  # model threads ctx_csv K[:V][@window]
  local spec="$4" window=0
  if [[ "$spec" == *@* ]]; then
    window="${spec#*@}"
    spec="${spec%@*}"
  fi
  local k="${spec%%:*}" v="${spec#*:}"
  "$cachet" bench -m "$1" -t "$2" --ctk "$k" --ctv "$v" --kv-window "$window" --ctx "$3" \
    --reps 1 --n-decode "$n_decode" --json --no-roofline 2>/dev/null
}

: >"$out/table.md"
IFS=',' read -r -a shape_list <<<"$shapes"
for shape in "${shape_list[@]}"; do
  name="$(basename "$shape" .json)"  # a shipped shape's name, or a shape file's
  mkdir -p "$out/$name"
  runs="$out/$name/runs.jsonl"
  : >"$runs"
  long="${LONG:-8192}"
  kv_weights="${KV_WEIGHTS:-q4_0}"
  if [ "$name" = mha-85m ]; then
    long="${LONG:-8192 16384}"
    kv_weights="${KV_WEIGHTS:-f16}"
  fi
  log "$shape: weights {$weights} x threads {$threads}, KV f16, ctx {$points}, $reps rounds"
  for w in $weights; do
    model="$(model_of "$shape" "$w")"
    # Out of the page cache, so that its first reader fills it from disk in 2 MiB folios, which both
    # engines then map as huge pages (README, "Huge pages"): one state, whatever ran before.
    dd if="$model" iflag=nocache count=0 status=none
    for t in $threads; do
      # Roofline inputs (bandwidth, weight and KV bytes per token): a short run, its own process,
      # so that the 512 MiB bandwidth buffer stays out of the measured peak RSS.
      "$cachet" bench -m "$model" -t "$t" --ctk f16 --ctv f16 --ctx 16 --reps 1 --n-decode 1 \
        --json 2>/dev/null | record weights "$w" "$t" f16 roofline 0
      for r in $(seq "$reps"); do
        log "$shape $w, $t thread(s), round $r/$reps"
        run_llama "$model" "$t" "$(csv $points)" f16 | record weights "$w" "$t" f16 llama "$r"
        run_cachet "$model" "$t" "$(csv $points)" f16 | record weights "$w" "$t" f16 cachet "$r"
      done
    done
  done
  if [ "$kv_table" = 1 ]; then
    model="$(model_of "$shape" "$kv_weights")"
    ctx="$(csv $points $long)"
    log "$shape: KV {$kvs} + Cachet {$cachet_kvs}, $kv_weights weights, ctx $ctx, $reps_long rounds"
    for t in $long_threads; do
      for r in $(seq "$reps_long"); do
        for kv in $kvs; do
          log "$shape KV $kv, $t thread(s), round $r/$reps_long"
          run_llama "$model" "$t" "$ctx" "$kv" | record kv "$kv_weights" "$t" "$kv" llama "$r"
          run_cachet "$model" "$t" "$ctx" "$kv" | record kv "$kv_weights" "$t" "$kv" cachet "$r"
        done
        for kv in $cachet_kvs; do
          log "$shape Cachet KV $kv, $t thread(s), round $r/$reps_long"
          run_cachet "$model" "$t" "$ctx" "$kv" | record kv "$kv_weights" "$t" "$kv" cachet "$r"
        done
      done
    done
  fi
  node "$here/synthetic_table.mjs" "$runs" "$name" >>"$out/table.md"
done
cat "$out/table.md"
