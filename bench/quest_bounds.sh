#!/usr/bin/env bash
# Quest against the full f16 cache, two builds alternated in one run (docs/BENCHMARKS.md, "Quest's
# page bounds in f16"): decode and prefill tok/s of each configuration, ROUNDS rounds (default 2).
# usage: bench/quest_bounds.sh BASE_CACHET NEW_CACHET MODEL.gguf [CTX (16384)]
set -euo pipefail
base="${1:?usage: bench/quest_bounds.sh BASE_CACHET NEW_CACHET MODEL.gguf [CTX]}"
new="${2:?usage: bench/quest_bounds.sh BASE_CACHET NEW_CACHET MODEL.gguf [CTX]}"
model="${3:?usage: bench/quest_bounds.sh BASE_CACHET NEW_CACHET MODEL.gguf [CTX]}"
ctx="${4:-16384}"
for round in $(seq "${ROUNDS:-2}"); do
  for which in base new; do
    bin=$new
    [ "$which" = base ] && bin=$base
    for cfg in full quest; do
      extra=()
      [ "$cfg" = quest ] && extra=(--press quest --ratio 0.875)
      out=$("$bin" bench -m "$model" -t 2 --ctx "$ctx" --reps 1 --n-decode 64 --json \
        --no-roofline --ctk f16 --ctv f16 "${extra[@]}" 2>/dev/null)
      tok=$(echo "$out" | python3 -c "import json,sys; d=json.load(sys.stdin)
print(round(d['decode_tok_s']['$ctx'], 1), round(d['prefill_tok_s']['$ctx'], 1))")
      echo "round $round $which $cfg: decode, prefill tok/s: $tok"
    done
  done
done
