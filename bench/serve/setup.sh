#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (CPU only, Release) from the llama.cpp source that
# node-llama-cpp 3.21.1 bundles (the source bench/peers compares against) and prints its path on
# stdout (progress on stderr). Used by bench/serve/run.sh.
#
# usage: bench/serve/setup.sh [OUT_DIR]        (default: build/serve-peer)
# Installs what is missing: cmake, g++, git, nodejs and npm through apt (as root); node-llama-cpp
# 3.21.1 into bench/peers/node_modules (npm, NPM_TIMEOUT seconds at most, 600 by default); clones
# the bundled source (node_modules/node-llama-cpp/llama/gitRelease.bundle) into OUT_DIR/llama.cpp,
# or copies it from $CACHET_LLAMA_SRC when that names a clone already made (saves the npm step);
# configures OUT_DIR/llama.cpp/build with cmake and builds only the llama-server target with
# -j$(nproc). Each step is skipped when its result is already there; a lock on OUT_DIR keeps two
# runs from racing. Every failure exits non-zero with a message naming the step.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/build/serve-peer}"
mkdir -p "$out" || { echo "bench/serve/setup.sh: mkdir $out failed" >&2; exit 1; }
out="$(cd "$out" && pwd)"

die() {
  echo "bench/serve/setup.sh: $*" >&2
  exit 1
}

need() {  # command, Debian package
  command -v "$1" >/dev/null && return
  [ "$(id -u)" = 0 ] || die "'$1' is missing; install the Debian package '$2' (needs root)"
  echo "bench/serve/setup.sh: installing $2 (apt)" >&2
  timeout 600 apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq "$2" >/dev/null ||
    die "apt-get install $2 failed"
}
need cmake cmake
need g++ g++
need make make
need git git
need flock util-linux

exec 9>"$out/.setup.lock"
flock 9

src="$out/llama.cpp"
server="$src/build/bin/llama-server"
if [ -x "$server" ]; then
  echo "$server"
  exit 0
fi

if [ ! -f "$src/include/llama.h" ]; then
  rm -rf "$src"
  if [ -n "${CACHET_LLAMA_SRC:-}" ] && [ -f "$CACHET_LLAMA_SRC/include/llama.h" ]; then
    echo "bench/serve/setup.sh: copying the llama.cpp source from $CACHET_LLAMA_SRC" >&2
    cp -r "$CACHET_LLAMA_SRC" "$src.tmp" || die "copying $CACHET_LLAMA_SRC failed"
    rm -rf "$src.tmp/build"
    mv "$src.tmp" "$src"
  else
    need node nodejs
    need npm npm
    peers="$root/bench/peers"
    if [ ! -f "$peers/node_modules/node-llama-cpp/llama/gitRelease.bundle" ]; then
      echo "bench/serve/setup.sh: npm i node-llama-cpp@3.21.1 (into $peers/node_modules)" >&2
      (cd "$peers" && timeout "${NPM_TIMEOUT:-600}" npm i -E node-llama-cpp@3.21.1 --no-audit \
        --no-fund --loglevel=error >&2) || die "npm install of node-llama-cpp@3.21.1 failed"
    fi
    echo "bench/serve/setup.sh: cloning the bundled llama.cpp source into $src" >&2
    git clone -q "$peers/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$src" 2>/dev/null ||
      die "git clone of node-llama-cpp/llama/gitRelease.bundle failed"
  fi
fi

# CPU only, no network at build time: no curl, no OpenSSL, no web UI (neither npm nor the
# prebuilt download), no tests or examples.
echo "bench/serve/setup.sh: configuring llama.cpp (cmake, Release, CPU)" >&2
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_NATIVE=ON \
  >"$out/cmake-configure.log" 2>&1 ||
  die "cmake configure failed (log: $out/cmake-configure.log)"
echo "bench/serve/setup.sh: building llama-server (-j$(nproc); several minutes)" >&2
cmake --build "$src/build" --config Release --target llama-server -j"$(nproc)" \
  >"$out/cmake-build.log" 2>&1 ||
  die "cmake build of llama-server failed (log: $out/cmake-build.log)"
[ -x "$server" ] || die "the build finished but $server is missing"
echo "$server"
