#!/usr/bin/env bash
# Installs missing dependencies, builds, and runs a short demo on the embedded kvtiny model.
# Any arguments are passed to `cachet` instead of the demo (e.g. ./run.sh inspect).
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-deps.sh
scripts/build.sh build >&2
if [ $# -gt 0 ]; then
  exec build/bin/cachet "$@"
fi
echo "--- cachet run (kvtiny, greedy): In the beginning God created the heaven and the earth." >&2
exec build/bin/cachet run -p "In the beginning God created the heaven and the earth." -n 48 --temp 0
