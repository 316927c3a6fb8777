#!/usr/bin/env bash
# Installs what the server's integration tests need: the openai npm client (the version pinned in
# package.json and package-lock.json) into tests/server/node_modules (git-ignored). Runs npm only
# when the package is missing; a lock keeps parallel ctest runs from installing twice. Needs node
# (>= 18: the client uses its fetch) and npm, and the npm registry the first time.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

die() {
  echo "tests/server/setup.sh: $*" >&2
  exit 1
}

command -v node >/dev/null || die "node is missing: Node.js >= 18 (scripts/install-deps.sh)"
command -v npm >/dev/null || die "npm is missing (scripts/install-deps.sh)"
major="$(node -p 'process.versions.node.split(".")[0]')"
[ "$major" -ge 18 ] || die "node $(node --version) is too old: the openai client needs >= 18"
command -v flock >/dev/null || die "flock is missing (Debian package util-linux)"

# The lock lives beside node_modules, not in it: npm ci removes node_modules first, and with it a
# lock file there, which let a second test in parallel take a fresh lock and install at once.
exec 9>"$here/.setup.lock"
flock 9
if [ ! -f "$here/node_modules/openai/package.json" ]; then
  echo "tests/server/setup.sh: npm ci (openai, into $here/node_modules)" >&2
  (cd "$here" && timeout "${NPM_TIMEOUT:-300}" npm ci --no-audit --no-fund --loglevel=error >&2) ||
    die "npm ci failed (is the npm registry reachable?)"
fi
[ -f "$here/node_modules/openai/package.json" ] || die "openai is missing after npm ci"
