#!/usr/bin/env bash
# The long-context configurations of issue 13 on one model, alternated within each round
# (docs/BENCHMARKS.md, "Every long-context configuration"): full f16 KV, q4_0 KV, snapkv+max at
# 0.75 and Quest reading 1/8 of the pages. Prints decode and prefill tok/s per round.
# usage: bench/long_context.sh CACHET MODEL.gguf [CTX (16384)]   environment: ROUNDS (2), N_DECODE (64)
set -euo pipefail
bin="${1:?usage: bench/long_context.sh CACHET MODEL.gguf [CTX]}"
model="${2:?usage: bench/long_context.sh CACHET MODEL.gguf [CTX]}"
ctx="${3:-16384}"
for round in $(seq "${ROUNDS:-2}"); do
  for cfg in f16 q4_0 snapkv quest; do
    args=(--ctk f16 --ctv f16)
    case $cfg in
      q4_0) args=(--ctk q4_0 --ctv q4_0) ;;
      snapkv) args+=(--press snapkv+max --ratio 0.75) ;;
      quest) args+=(--press quest --ratio 0.875) ;;
    esac
    out=$("$bin" bench -m "$model" -t 2 --ctx "$ctx" --reps 1 --n-decode "${N_DECODE:-64}" --json \
      --no-roofline "${args[@]}" 2>/dev/null)
    tok=$(echo "$out" | python3 -c "import json,sys; d=json.load(sys.stdin)
print(round(d['decode_tok_s']['$ctx'], 1), round(d['prefill_tok_s']['$ctx'], 1))")
    echo "round $round $cfg: decode, prefill tok/s: $tok"
  done
done
