#!/usr/bin/env bash
# Builds the llama.cpp side of the peer harness and prints the path of the `llama_peer` binary on
# stdout (progress on stderr). Used by bench/peers/run.sh and tests/peer_agreement.sh.
#
# usage: bench/peers/setup.sh OUT_DIR
# Installs what is missing: nodejs, npm, git and g++ through apt (as root), node-llama-cpp 3.21.1
# into bench/peers/node_modules (npm, NPM_TIMEOUT seconds at most, 600 by default); clones the
# llama.cpp source the package bundles into OUT_DIR/llama.cpp for its headers and compiles
# llama_peer.cc against the package's prebuilt CPU libraries into OUT_DIR/llama_peer. Each step is
# skipped when its result is already there; a lock on OUT_DIR keeps two runs from racing.
# Every failure exits non-zero with a message naming the step.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: bench/peers/setup.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

die() {
  echo "bench/peers/setup.sh: $*" >&2
  exit 1
}

need() {  # command, Debian package
  command -v "$1" >/dev/null && return
  [ "$(id -u)" = 0 ] || die "'$1' is missing; install the Debian package '$2' (needs root)"
  echo "bench/peers/setup.sh: installing $2 (apt)" >&2
  timeout 600 apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq "$2" >/dev/null ||
    die "apt-get install $2 failed"
}
need node nodejs
need npm npm
need git git
need g++ g++
need flock util-linux

exec 9>"$out/.setup.lock"
flock 9

if [ ! -d "$here/node_modules/node-llama-cpp" ]; then
  echo "bench/peers/setup.sh: npm i node-llama-cpp@3.21.1 (into $here/node_modules)" >&2
  (cd "$here" && timeout "${NPM_TIMEOUT:-600}" npm i -E node-llama-cpp@3.21.1 --no-audit \
    --no-fund --loglevel=error >&2) || die "npm install of node-llama-cpp@3.21.1 failed"
fi
bins="$here/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64"
[ -f "$bins/libllama.v0.4.0.so" ] || die "$bins/libllama.v0.4.0.so is missing after npm install"

src="$out/llama.cpp"
if [ ! -f "$src/include/llama.h" ]; then
  echo "bench/peers/setup.sh: cloning the bundled llama.cpp source into $src" >&2
  rm -rf "$src"
  git clone -q "$here/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$src" 2>/dev/null ||
    die "git clone of node-llama-cpp/llama/gitRelease.bundle failed"
fi

peer="$out/llama_peer"
if [ ! -x "$peer" ] || [ "$here/llama_peer.cc" -nt "$peer" ] || [ "$0" -nt "$peer" ]; then
  echo "bench/peers/setup.sh: compiling $peer" >&2
  # The backends directory is compiled in (LLAMA_PEER_BACKENDS overrides it): the package's CPU
  # backends are separate libraries, one per x86 level, loaded at run time.
  g++ -O2 -std=c++17 -Wall -Wextra "$here/llama_peer.cc" -I"$src/include" -I"$src/ggml/include" \
    -DLLAMA_PEER_BACKENDS_DIR="\"$bins\"" -L"$bins" -l:libllama.v0.4.0.so -l:libggml.v0.4.0.so \
    -l:libggml-base.so -Wl,-rpath,"$bins" -o "$peer.tmp" || die "compiling llama_peer.cc failed"
  mv "$peer.tmp" "$peer"
fi
echo "$peer"
