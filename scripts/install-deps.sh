#!/usr/bin/env bash
# Installs the Debian packages Cachet builds and tests with. Idempotent: installs only what is
# missing, and runs apt-get only when something is.
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ pkg-config git
  libhwy-dev nlohmann-json3-dev libonig-dev libsentencepiece-dev libcli11-dev libxxhash-dev
  libzstd-dev
  libcpp-httplib-dev
  libhiredis-dev redis-server haproxy
  libgtest-dev libgmock-dev libbenchmark-dev
  gnuplot-nox
  clang libclang-rt-14-dev lld
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# node and npm (the llama.cpp peer test) by command: a Node.js from elsewhere (NodeSource's
# nodejs bundles npm and conflicts with Debian's npm package) serves as well.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present" >&2
  exit 0
fi

echo "install-deps: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done" >&2
