#!/usr/bin/env bash
# Installs missing dependencies, builds, and runs the whole test suite (ctest).
# CACHET_SANITIZE=1 ./test.sh also builds and tests an ASan+UBSan configuration in build-asan/.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-deps.sh
scripts/build.sh build
(cd build && ctest --output-on-failure -j "$(nproc)")
if [ "${CACHET_SANITIZE:-0}" = "1" ]; then
  scripts/build.sh build-asan -DCACHET_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
     ctest --output-on-failure -j "$(nproc)")
fi
