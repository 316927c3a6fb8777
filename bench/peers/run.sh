#!/usr/bin/env bash
# Peer harness (work in progress, see docs/PEERS.md): installs node-llama-cpp 3.21.1 (llama.cpp's
# prebuilt CPU binaries) into bench/peers/node_modules, converts kvtiny to GGUF with
# `cachet convert`, and compares greedy continuations of both engines on the same token ids.
# usage: bench/peers/run.sh [MODEL.gguf] [THREADS]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cachet="$root/build/bin/cachet"
[ -x "$cachet" ] || "$root/scripts/build.sh"
if [ ! -d "$here/node_modules/node-llama-cpp" ]; then
  (cd "$here" && npm i -E node-llama-cpp@3.21.1 --no-audit --no-fund)
fi
model="${1:-}"
threads="${2:-2}"
if [ -z "$model" ]; then
  model="$root/build/kvtiny-f16.gguf"
  [ -f "$model" ] || "$cachet" convert "$root/models/kvtiny" "$model" --type f16
fi
ids='[0, 806, 268, 4160, 856, 1847, 268, 2497, 299, 268, 1968, 16]'
echo "llama.cpp (node-llama-cpp 3.21.1), $threads threads, greedy 24 tokens after $ids:"
node "$here/llama_peer.mjs" greedy "$model" "$threads" 24 "$ids"
echo "cachet:"
"$cachet" run -m "$model" --no-prefix-cache -t "$threads" -n 24 --temp 0 \
  -p "In the beginning God created the heaven and the earth."
echo
