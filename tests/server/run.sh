#!/usr/bin/env bash
# The server's integration tests (ctest label "server"): starts `cachet serve` on 127.0.0.1 (a free
# port: --port 0, read back from the startup line), drives it with the real openai npm client
# (client.mjs; installed once by setup.sh into tests/server/node_modules), then stops it with
# SIGTERM and requires a clean exit (so leak checkers in sanitizer builds get their say). The
# server is stopped on every exit path (trap), and every step is bounded in time.
#
# usage: tests/server/run.sh CACHET_BINARY WORK_DIR GROUP
#   GROUP: api (completions, chat, n, stop, logprobs, cached_tokens, tokenize, metrics),
#          stream (SSE shapes; then a server with --chat-template deepseek: reasoning_content),
#          errors (every bad input, 401, 503), load (concurrency,
#          disconnects), caches (/v1/caches with --disk-cache: caches.mjs, then a restarted
#          server finds the cache). Environment: THREADS (2), CLIENT_TIMEOUT (240 s).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cachet="${1:?usage: tests/server/run.sh CACHET_BINARY WORK_DIR GROUP}"
work="${2:?usage: tests/server/run.sh CACHET_BINARY WORK_DIR GROUP}"
group="${3:?usage: tests/server/run.sh CACHET_BINARY WORK_DIR GROUP}"
threads="${THREADS:-2}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"

"$here/setup.sh"

args=(-t "$threads" --host 127.0.0.1 --port 0)
case "$group" in
  # api: chats longer than the context get their history pressed (one check in client.mjs).
  api) args+=(-np 4 --on-full press:keydiff:0.5) ;;
  stream) args+=(-np 4) ;;
  # One running request and one waiting: the third is refused (503). A key on every endpoint.
  errors) args+=(-np 1 --max-waiting 1 --api-key test-key-1234) ;;
  load) args+=(-np 4) ;;
  caches)
    rm -rf "$work/disk-caches"
    args+=(-np 4 --disk-cache "$work/disk-caches")
    ;;
  *)
    echo "tests/server/run.sh: unknown group '$group' (api, stream, errors, load, caches)" >&2
    exit 2
    ;;
esac

log="$work/server-$group.log"
: >"$log"
pid=""

stop_server() {  # SIGTERM, then SIGKILL after 30 s
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 300); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  echo "tests/server/run.sh: the server did not stop within 30 s of SIGTERM; killing it" >&2
  kill -KILL "$pid" 2>/dev/null || true
}
cleanup() {
  local rc=$?
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then stop_server; fi
  if [ "$rc" -ne 0 ]; then
    echo "--- server log ($log), last lines:" >&2
    tail -n 40 "$log" >&2 || true
  fi
}
trap cleanup EXIT

# Starts the server (its log appended to $log) and sets $port.
start_server() {
  local from
  from="$(wc -l <"$log")"
  "$cachet" serve "${args[@]}" 2>>"$log" &
  pid=$!
  port=""
  for _ in $(seq 600); do  # 60 s for the model to load
    port="$(tail -n +"$((from + 1))" "$log" |
      sed -n 's|.*listening on http://127\.0\.0\.1:\([0-9]*\).*|\1|p' | head -n 1)"
    [ -n "$port" ] && break
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "tests/server/run.sh: the server exited before listening" >&2
      exit 1
    fi
    sleep 0.1
  done
  [ -n "$port" ] || { echo "tests/server/run.sh: no 'listening on' line within 60 s" >&2; exit 1; }
}

# A clean shutdown is part of the test: exit status 0 after SIGTERM.
stop_cleanly() {
  kill -TERM "$pid"
  local status=0
  for _ in $(seq 300); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "tests/server/run.sh: the server did not stop within 30 s of SIGTERM" >&2
    exit 1
  fi
  wait "$pid" || status=$?
  if [ "$status" -ne 0 ]; then
    echo "tests/server/run.sh: the server exited with status $status after SIGTERM" >&2
    exit 1
  fi
}

client() {  # client.mjs or caches.mjs GROUP, against the running server
  local script=client.mjs
  case "$1" in caches | caches_restart) script=caches.mjs ;; esac
  CACHET="$cachet" THREADS="$threads" API_KEY="test-key-1234" WORK="$work" \
    timeout "${CLIENT_TIMEOUT:-240}" node "$here/$script" "$1" "http://127.0.0.1:$port"
}

start_server
client "$group"
stop_cleanly
if [ "$group" = caches ]; then  # the same --disk-cache: the cache made before is found
  start_server
  client caches_restart
  stop_cleanly
fi
if [ "$group" = stream ]; then  # DeepSeek-R1's template: replies split into reasoning_content
  args+=(--chat-template deepseek)
  start_server
  client reasoning
  stop_cleanly
fi
echo "tests/server/run.sh: $group passed; the server stopped cleanly" >&2
