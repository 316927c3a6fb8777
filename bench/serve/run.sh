#!/usr/bin/env bash
# The serving benchmark (issue 14; docs/BENCHMARKS.md, "Serving: `cachet serve` vs llama-server"):
# `cachet serve` next to llama.cpp's own `llama-server` (built by bench/serve/setup.sh from the
# llama.cpp source bundled in node-llama-cpp 3.21.1) on the same GGUF, thread count, KV type
# (f16), KV capacity and load, on loopback. Not a unit test.
#
# usage: bench/serve/run.sh [--model kvtiny|tinyllama-q4k|PATH.gguf[,...]] [--clients 1,4,16,32]
#          [--engines cachet,llama] [--workloads shared,unique,short] [--requests N]
#          [--max-tokens N] [--prompt-tokens N] [--unique-tokens N] [--unique-requests N]
#          [--short-tokens N] [--threads N]
#          [--repeat C] [--time-limit S] [--grace S] [--pause S] [--out DIR]
#
# For each model and workload both servers are started afresh on free loopback ports (Cachet:
# `cachet serve -m GGUF --port 0 -np NP -c SLOT --kv-mem (NP*SLOT tokens) --ctk f16 --ctv f16
# -t T`; llama-server: `-m GGUF --port P -np NP -c NP*SLOT -t T --cont-batching -ctk f16 -ctv f16`,
# so both hold KV for NP sequences of SLOT tokens; NP = the largest client count, SLOT = the
# longest prompt + question + output + 128, in 256s), waited for (/health), warmed up with one
# request of the workload (for `shared`: the system prompt is in both servers' caches), and then
# driven by bench/serve/load.mjs at each client count in turn (each run with prompts of its own),
# the engines alternating which goes first, with --pause seconds before each run; then the
# --repeat client count once more, to see whether memory stays flat: RSS (VmRSS, /proc/PID/status)
# is sampled after the warm-up and before and after every run, and a server that leaked would grow
# in the repeat, which needs no more KV than the largest run before it (both servers' KV memory
# is touched as it is first used, so RSS rises until the largest run). Servers are stopped on
# every exit path.
#
# Options, and their defaults:
#   --model        kvtiny,tinyllama-q4k. kvtiny: models/kvtiny written to an f16 GGUF by
#                  `cachet convert`; tinyllama-q4k: the synthetic TinyLlama-1.1B-shaped q4_k GGUF
#                  of `cachet convert --synthetic tinyllama-1.1b --type q4_k --seed 1` (as
#                  bench/peers makes it); or a GGUF file
#   --clients 1,4,16,32   --engines cachet,llama
#   --workloads shared,unique,short   (bench/serve/load.mjs: a ~2k-token system prompt shared by
#                         every request + a distinct question; distinct prompts; distinct prompts
#                         of a few tokens, where a run is nearly all batched decode steps)
#   --requests N          per client, one after the other (2)
#   --max-tokens N        per request, ignore_eos (kvtiny 64, otherwise 32)
#   --prompt-tokens N     of the shared system prompt (2000)
#   --unique-tokens N     of each prompt of the unique workload (kvtiny: --prompt-tokens,
#                         otherwise 512: a 1.1B model prefills ~200-400 tok/s on 2 cores)
#   --unique-requests N   per client in the unique and short workloads (1)
#   --short-tokens N      of each prompt of the short workload (16)
#   --repeat C            the client count run again at the end (16; 0: none)
#   --threads N           both engines (nproc)
#   --time-limit S        per run: no request starts later (60)
#   --grace S             requests still running that much later are aborted and counted (20)
#   --pause S             before each run (3: llama.cpp's threads poll for a while after work)
#   --out DIR             build/serve
# Options given on the command line win over the per-model defaults above.
# Environment: CACHET (build/bin/cachet, built when missing), LLAMA_SERVER (a llama-server binary;
#   default: bench/serve/setup.sh builds one into build/serve-peer), SYNTH_DIR (build/synthetic:
#   where the synthetic GGUF is written once and reused), LLAMA_ENV (environment assignments for
#   llama-server only, e.g. "OMP_WAIT_POLICY=passive": its OpenMP threads spin at barriers by
#   default, which costs it dearly on a machine that other work keeps busy; recorded in the table).
# Writes OUT/runs.jsonl (one JSON line per run), the server logs, and OUT/table.md (printed).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

log() { echo "bench/serve: $*" >&2; }
die() {
  log "$*"
  exit 1
}

parse() {  # options -> variables
  while [ $# -gt 0 ]; do
    [ $# -ge 2 ] || [ "$1" = -h ] || [ "$1" = --help ] || die "option '$1' needs a value"
    case "$1" in
      --model | --models) models="$2" ;;
      --clients) clients="$2" ;;
      --engines) engines="$2" ;;
      --workloads) workloads="$2" ;;
      --requests) requests="$2" ;;
      --max-tokens) max_tokens="$2" ;;
      --prompt-tokens) prompt_tokens="$2" ;;
      --unique-tokens) unique_tokens="$2" ;;
      --unique-requests) unique_requests="$2" ;;
      --short-tokens) short_tokens="$2" ;;
      --repeat) repeat="$2" ;;
      --threads) threads="$2" ;;
      --time-limit) time_limit="$2" ;;
      --grace) grace="$2" ;;
      --pause) pause="$2" ;;
      --out) out="$2" ;;
      -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
      *) die "unknown option '$1' (--help lists them)" ;;
    esac
    shift 2
  done
}
defaults() {  # model name: the defaults, then the model's, then the command line's
  models="kvtiny,tinyllama-q4k"
  clients="1,4,16,32"
  engines="cachet,llama"
  workloads="shared,unique,short"
  requests=2
  max_tokens=32
  prompt_tokens=2000
  unique_tokens=""
  unique_requests=1
  short_tokens=16
  repeat=16
  threads="$(nproc)"
  time_limit=60
  grace=20
  pause=3
  out="$root/build/serve"
  case "${1:-}" in
    "") ;;
    kvtiny) max_tokens=64 ;;
    *) unique_tokens=512 ;;
  esac
  parse "${cli[@]}"
  unique_tokens="${unique_tokens:-$prompt_tokens}"
}
cli=("$@")
defaults ""
mkdir -p "$out"
out="$(cd "$out" && pwd)"
out_dir="$out"  # defaults() resets $out: the absolute path stays here
command -v node >/dev/null || die "node (Node.js >= 18) is missing: apt-get install nodejs"
command -v curl >/dev/null || die "curl is missing: apt-get install curl"

cachet="${CACHET:-$root/build/bin/cachet}"
if [ ! -x "$cachet" ]; then
  log "building Cachet (scripts/build.sh)"
  "$root/scripts/build.sh" >&2 || die "building Cachet failed"
fi
llama=""
if [[ ",$engines," == *,llama,* ]]; then
  llama="${LLAMA_SERVER:-}"
  if [ -z "$llama" ]; then
    llama="$("$here/setup.sh" "$root/build/serve-peer")" || die "bench/serve/setup.sh failed"
  fi
  [ -x "$llama" ] || die "llama-server '$llama' is not executable"
fi

synth="${SYNTH_DIR:-$root/build/synthetic}"
model_path() {  # name -> GGUF path (written on first use)
  local f
  case "$1" in
    kvtiny)
      f="$out/kvtiny-f16.gguf"
      if [ ! -f "$f" ]; then
        log "writing $f (cachet convert models/kvtiny --type f16)"
        "$cachet" convert "$root/models/kvtiny" "$f.tmp" --type f16 >/dev/null ||
          die "cachet convert of models/kvtiny failed"
        mv "$f.tmp" "$f"
      fi
      ;;
    tinyllama-q4k)
      f="$synth/tinyllama-1.1b-q4_k.gguf"
      if [ ! -f "$f" ]; then
        mkdir -p "$synth"
        log "writing $f (cachet convert --synthetic tinyllama-1.1b --type q4_k --seed 1)"
        "$cachet" convert --synthetic tinyllama-1.1b "$f.tmp" --type q4_k --seed 1 >&2 ||
          die "cachet convert --synthetic tinyllama-1.1b failed"
        mv "$f.tmp" "$f"
      fi
      ;;
    *)
      f="$1"
      [ -f "$f" ] || die "model '$1': not kvtiny, tinyllama-q4k or a GGUF file"
      ;;
  esac
  echo "$f"
}

free_port() {
  node -e 'const s = require("net").createServer();
    s.listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); });'
}
cpu_ticks() {  # pid -> user + system CPU time in clock ticks
  awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null || echo 0
}
# Waits until process $1 is idle (under 5% of a core over a second; 300 s at most) and prints the
# seconds waited: a server still working on requests whose clients gave up (a run's time limit)
# must not run into the next measurement.
wait_idle() {
  local t0=$SECONDS hz a b
  hz="$(getconf CLK_TCK)"
  while :; do
    a="$(cpu_ticks "$1")"
    sleep 1
    b="$(cpu_ticks "$1")"
    [ $((b - a)) -le $((hz / 20)) ] && break
    if [ $((SECONDS - t0)) -ge 300 ]; then
      log "pid $1 still busy after 300 s; going on"
      break
    fi
  done
  echo $((SECONDS - t0))
}
rss_kib() {  # pid -> VmRSS in KiB (0 when the process is gone)
  local v
  v="$(awk '$1 == "VmRSS:" { print $2 }' "/proc/$1/status" 2>/dev/null)"
  echo "${v:-0}"
}

# Running servers: engine -> pid, port.
declare -A pid_of port_of
stop_server() {  # engine: SIGTERM, then SIGKILL after 30 s
  local p="${pid_of[$1]:-}"
  [ -n "$p" ] || return 0
  unset "pid_of[$1]"
  kill -TERM "$p" 2>/dev/null || return 0
  for _ in $(seq 300); do
    kill -0 "$p" 2>/dev/null || { wait "$p" 2>/dev/null || true; return 0; }
    sleep 0.1
  done
  log "$1 (pid $p) did not stop within 30 s of SIGTERM; killing it"
  kill -KILL "$p" 2>/dev/null || true
  wait "$p" 2>/dev/null || true
}
cleanup() {
  local e
  for e in "${!pid_of[@]}"; do stop_server "$e"; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Starts engine $1 on model $2 with NP sequences of SLOT tokens; sets pid_of / port_of.
start_server() {
  local engine="$1" model="$2" np="$3" slot="$4" logf="$5" port=""
  : >"$logf"
  case "$engine" in
    cachet)
      "$cachet" serve -m "$model" --host 127.0.0.1 --port 0 -np "$np" -c "$slot" \
        --kv-mem "$kv_mib" --ctk f16 --ctv f16 -t "$threads" 2>"$logf" &
      pid_of[$engine]=$!
      for _ in $(seq 1200); do  # 120 s to load
        port="$(sed -n 's|.*listening on http://127\.0\.0\.1:\([0-9]*\).*|\1|p' "$logf")"
        [ -n "$port" ] && break
        kill -0 "${pid_of[$engine]}" 2>/dev/null || break
        sleep 0.1
      done
      [ -n "$port" ] || { tail -n 20 "$logf" >&2; die "cachet serve did not start (log: $logf)"; }
      ;;
    llama)
      port="$(free_port)"
      # shellcheck disable=SC2086  # LLAMA_ENV: words of VAR=VALUE
      env ${LLAMA_ENV:-} "$llama" -m "$model" --host 127.0.0.1 --port "$port" -np "$np" \
        -c $((np * slot)) -t "$threads" --cont-batching -ctk f16 -ctv f16 >"$logf" 2>&1 &
      pid_of[$engine]=$!
      ;;
    *) die "unknown engine '$engine' (cachet, llama)" ;;
  esac
  port_of[$engine]="$port"
  for _ in $(seq 1200); do  # /health answers 200 once the model is loaded
    if ! kill -0 "${pid_of[$engine]}" 2>/dev/null; then
      tail -n 20 "$logf" >&2
      die "$engine exited before it was ready (log: $logf)"
    fi
    curl -sf -o /dev/null "http://127.0.0.1:$port/health" && return 0
    sleep 0.1
  done
  die "$engine: /health did not answer 200 within 120 s (log: $logf)"
}

runs="$out/runs.jsonl"
: >"$runs"
record() {  # KEY=VALUE...: one line of runs.jsonl (a VALUE that is not JSON is a string)
  node -e 'const o = {};
    for (const a of process.argv.slice(1)) {
      const k = a.slice(0, a.indexOf("="));
      const v = a.slice(a.indexOf("=") + 1);
      try { o[k] = JSON.parse(v); } catch { o[k] = v; }
    }
    console.log(JSON.stringify(o));' "$@" >>"$runs"
}
IFS=',' read -r -a model_list <<<"$models"
cpu="$(lscpu | sed -n 's/^Model name: *//p')"
log "$(nproc) cores ($cpu), load $(cut -d' ' -f1-3 /proc/loadavg)"
log "cachet: $cachet; llama-server: ${llama:-(not run)}"
for name in "${model_list[@]}"; do
  defaults "$name"
  out="$out_dir"
  IFS=',' read -r -a client_list <<<"$clients"
  IFS=',' read -r -a engine_list <<<"$engines"
  IFS=',' read -r -a workload_list <<<"$workloads"
  np=1
  for c in "${client_list[@]}"; do [ "$c" -gt "$np" ] && np="$c"; done
  model="$(model_path "$name")"
  # Bytes per token of Cachet's f16 pool, from `cachet inspect`: K and V of every layer and KV
  # head, plus each page's 4-byte token positions (one per token and (layer, KV head) table).
  inspect="$("$cachet" inspect -m "$model" 2>/dev/null)" || die "cachet inspect -m $model failed"
  kvb="$(sed -n 's/^KV bytes\/token.* f16\/bf16 \([0-9][0-9]*\).*/\1/p' <<<"$inspect")"
  n_layers="$(sed -n 's/^layers  *\([0-9][0-9]*\).*/\1/p' <<<"$inspect")"
  n_kv="$(sed -n 's/^heads (q \/ kv)  *[0-9][0-9]* \/ \([0-9][0-9]*\).*/\1/p' <<<"$inspect")"
  if [ -z "$kvb" ] || [ -z "$n_layers" ] || [ -z "$n_kv" ]; then
    die "cannot read the KV bytes per token, layers and KV heads of $model from cachet inspect"
  fi
  kv_bytes_f16=$((kvb + 4 * n_layers * n_kv))
  # A sequence: the longer prompt, the question, the output and a margin, in 256-token steps.
  longest=$((prompt_tokens > unique_tokens ? prompt_tokens : unique_tokens))
  slot=$(((longest + 64 + max_tokens + 128 + 255) / 256 * 256))
  # Cachet's pool: NP sequences of SLOT tokens in f16, as llama-server's KV cache.
  kv_mib=$(((np * slot * kv_bytes_f16 + (1 << 20) - 1) >> 20))
  for workload in "${workload_list[@]}"; do
    mname="$(basename "$name" .gguf)"
    tag="$mname-$workload"
    n_req="$requests"
    [ "$workload" != shared ] && n_req="$unique_requests"
    log "$tag: $model; NP $np, $slot tokens per sequence; clients $clients; ${n_req} requests" \
      "per client, $max_tokens tokens each; prompts ~$prompt_tokens (shared) / ~$unique_tokens" \
      "(unique) / ~$short_tokens (short) tokens; $threads threads"
    declare -A rss_start=()
    for e in "${engine_list[@]}"; do
      start_server "$e" "$model" "$np" "$slot" "$out/$tag-$e.log"
    done
    load=(--workload "$workload" --requests "$n_req" --max-tokens "$max_tokens"
      --prompt-tokens "$prompt_tokens" --unique-tokens "$unique_tokens"
      --short-tokens "$short_tokens"
      --time-limit "$time_limit" --grace "$grace")
    for e in "${engine_list[@]}"; do
      w="$(timeout 600 node "$here/load.mjs" --url "http://127.0.0.1:${port_of[$e]}" \
        --clients 1 --warmup "${load[@]}")" || die "$tag: the warm-up of $e failed: $w"
      log "$tag: $e warmed up: $w"
      wait_idle "${pid_of[$e]}" >/dev/null
      rss_start[$e]="$(rss_kib "${pid_of[$e]}")"
    done
    i=0
    first=1  # prompt numbers: every run of this server gets its own (the warm-up's is 0)
    runs_of=("${client_list[@]}")
    [ "$repeat" -gt 0 ] && runs_of+=("$repeat")
    for c in "${runs_of[@]}"; do
      order=("${engine_list[@]}")
      if [ $((i % 2)) = 1 ]; then  # alternate which engine goes first
        order=()
        for ((k = ${#engine_list[@]} - 1; k >= 0; --k)); do order+=("${engine_list[$k]}"); done
      fi
      for e in "${order[@]}"; do
        sleep "$pause"
        before="$(rss_kib "${pid_of[$e]}")"
        loadavg="$(cut -d' ' -f1 /proc/loadavg)"
        r="$(timeout $((time_limit + grace + 60)) node "$here/load.mjs" --url \
          "http://127.0.0.1:${port_of[$e]}" --clients "$c" --label "$e" --first-prompt "$first" \
          "${load[@]}")" ||
          die "$tag: load.mjs failed against $e at $c clients"
        kill -0 "${pid_of[$e]}" 2>/dev/null ||
          die "$tag: $e died during the run (log: $out/$tag-$e.log)"
        idle="$(wait_idle "${pid_of[$e]}")"
        [ "$idle" -gt 1 ] && log "$tag: $e was busy for $idle s after the run"
        record model="$mname" workload="$workload" engine="$e" clients="$c" threads="$threads" \
          np="$np" slot="$slot" kv_mib="$kv_mib" repeat="$((i >= ${#client_list[@]}))" \
          loadavg="$loadavg" llama_env="${LLAMA_ENV:-}" idle_wait_s="$idle" \
          planned=$((c * n_req)) rss_start_kib="${rss_start[$e]}" \
          rss_before_kib="$before" rss_after_kib="$(rss_kib "${pid_of[$e]}")" result="$r"
      done
      i=$((i + 1))
      first=$((first + c * n_req))
    done
    for e in "${engine_list[@]}"; do
      record model="$mname" workload="$workload" engine="$e" end=true \
        rss_start_kib="${rss_start[$e]}" rss_end_kib="$(rss_kib "${pid_of[$e]}")"
      stop_server "$e"
    done
  done
done

node "$here/table.mjs" "$runs" >"$out/table.md"
cat "$out/table.md"
