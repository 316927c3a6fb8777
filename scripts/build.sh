#!/usr/bin/env bash
# Configures and builds one build directory. Usage: scripts/build.sh [BUILD_DIR [cmake args...]]
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-build}"
shift || true
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# A configure that failed (a missing package) leaves a cache but no build files: configure again.
if [ ! -f "$dir/build.ninja" ] && [ ! -f "$dir/Makefile" ]; then
  cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
fi
cmake --build "$dir" -j "$(nproc)"
