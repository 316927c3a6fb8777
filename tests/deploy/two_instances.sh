#!/usr/bin/env bash
# docs/DEPLOY.md, tested: two `cachet serve` instances behind haproxy, sharing one Redis, on
# loopback. A long prompt sent through haproxy is computed by the instance that gets it; sent
# again, haproxy's round robin gives it to the other instance, which loads the prompt's KV from
# Redis instead of computing it (its /metrics say so) and answers the same text. A saved cache
# made on one instance (POST /v1/caches) answers a request on the other the same way.
# usage: two_instances.sh CACHET_BINARY WORK_DIR
set -euo pipefail
cachet="$1"
work="$2"
rm -rf "$work"
mkdir -p "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
die() {
  echo "two_instances: $*" >&2
  for f in "$work"/*.log; do
    echo "--- $f" >&2
    tail -n 20 "$f" >&2
  done
  exit 1
}
for tool in redis-server haproxy curl; do
  command -v "$tool" >/dev/null || die "$tool is missing: run scripts/install-deps.sh"
done

# A port nothing listens on (bash's /dev/tcp connects or fails at once on loopback), below the
# kernel's ephemeral range: a port there may be bound by some client's outgoing connection, which
# no connect sees but a listener's bind fails on ("Address already in use": it failed a run so).
free_port() {
  local p low=32768
  read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  [ "$low" -gt 11000 ] || low=32768
  for _ in $(seq 1 200); do
    p=$((10000 + RANDOM % (low - 10000)))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "$p"
      return
    fi
  done
  die "no free port"
}
wait_for() {  # wait_for SECONDS COMMAND...: until the command succeeds
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

redis_port="$(free_port)"
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$work" --maxmemory 256mb --maxmemory-policy allkeys-lru >"$work/redis.log" 2>&1 &
pids+=($!)
wait_for 10 bash -c "exec 3<>/dev/tcp/127.0.0.1/$redis_port" || die "redis-server did not start"

ports=()
for i in 0 1; do
  log="$work/cachet$i.log"
  "$cachet" serve --host 127.0.0.1 --port 0 -t 1 --redis "redis://127.0.0.1:$redis_port" \
    >"$log" 2>&1 &
  pids+=($!)
  wait_for 60 grep -q "listening on http://127.0.0.1:" "$log" || die "cachet serve $i did not start"
  ports+=("$(sed -n 's|.*listening on http://127\.0\.0\.1:\([0-9]*\).*|\1|p' "$log" | head -n 1)")
done

lb_port="$(free_port)"
cat >"$work/haproxy.cfg" <<EOF
global
  maxconn 256
defaults
  mode http
  timeout connect 2s
  timeout client 60s
  timeout server 60s
frontend cachet
  bind 127.0.0.1:$lb_port
  default_backend servers
backend servers
  balance roundrobin
  option httpchk GET /health
  server a 127.0.0.1:${ports[0]} check inter 500ms
  server b 127.0.0.1:${ports[1]} check inter 500ms
EOF
haproxy -db -f "$work/haproxy.cfg" >"$work/haproxy.log" 2>&1 &
pids+=($!)
wait_for 20 curl -sf "http://127.0.0.1:$lb_port/health" || die "haproxy did not start"

# ~700 tokens: a few whole runs of 256 tokens (what the tiers store).
prompt=""
for i in $(seq 1 60); do prompt+="Lily went to the park on day $i and saw a red ball. "; done
body="{\"prompt\": \"$prompt\", \"max_tokens\": 8, \"temperature\": 0}"
ask() { curl -sf "http://127.0.0.1:$lb_port/v1/completions" -H 'content-type: application/json' \
  -d "$body" | sed -n 's/.*"text":"\([^"]*\)".*/\1/p'; }
metric() {  # metric PORT NAME_AND_LABELS: the value, 0 if absent
  curl -sf "http://127.0.0.1:$1/metrics" | grep -F "$2" | grep -v '^#' | awk '{s += $2} END {print s + 0}'
}
served() { metric "$1" "cachet:requests_finished_total"; }

first="$(ask)" || die "the first request failed"
[ -n "$first" ] || die "the first request returned no text"
# The instance that served it writes the prompt's runs to Redis in the background.
a=""
for i in 0 1; do [ "$(served "${ports[$i]}")" = "1" ] && a="$i"; done
[ -n "$a" ] || die "no instance reports the first request"
b=$((1 - a))
wait_for 20 bash -c "[ \"\$(curl -sf http://127.0.0.1:${ports[$a]}/metrics | grep -F 'kv_tier_bytes_written_total{' | grep -F 'redis' | awk '{s += \$2} END {print s + 0}')\" != 0 ]" ||
  die "instance $a wrote nothing to Redis"

second="$(ask)" || die "the second request failed"
[ "$(served "${ports[$b]}")" = "1" ] || die "haproxy did not send the second request to the other instance"
from_redis="$(curl -sf "http://127.0.0.1:${ports[$b]}/metrics" | grep -F 'prompt_tokens_by_source_total{' |
  grep -F 'source="redis"' | awk '{print $2}')"
computed="$(curl -sf "http://127.0.0.1:${ports[$b]}/metrics" | grep -F 'prompt_tokens_by_source_total{' |
  grep -F 'source="compute"' | awk '{print $2}')"
[ "${from_redis:-0}" -ge 512 ] || die "instance $b took ${from_redis:-0} prompt tokens from Redis, expected >= 512"
[ "${computed:-0}" -lt 256 ] || die "instance $b computed ${computed} prompt tokens"
[ "$first" = "$second" ] || die "the answers differ: '$first' vs '$second'"
# A saved cache made on one instance answers on the other: stored in the shared Redis.
cache_id="$(curl -sf "http://127.0.0.1:${ports[$a]}/v1/caches" -H 'content-type: application/json' \
  -d "{\"prompt\": \"$prompt\", \"kv_press\": {\"name\": \"snapkv\", \"ratio\": 0.5}}" |
  sed -n 's/.*"id":"\(kvc-[0-9a-f]*\)".*/\1/p')"
[ -n "$cache_id" ] || die "POST /v1/caches on instance $a made no cache"
on_cache() { curl -sf "http://127.0.0.1:$1/v1/completions" -H 'content-type: application/json' \
  -d "{\"cache_id\": \"$cache_id\", \"prompt\": \" Where did Lily go?\", \"max_tokens\": 8, \"temperature\": 0}" |
  sed -n 's/.*"text":"\([^"]*\)".*/\1/p'; }
on_a="$(on_cache "${ports[$a]}")" || die "a request on the cache failed on instance $a"
on_b="$(on_cache "${ports[$b]}")" || die "instance $b did not find the cache $cache_id in Redis"
[ -n "$on_a" ] && [ "$on_a" = "$on_b" ] || die "the answers on the cache differ: '$on_a' vs '$on_b'"
echo "two_instances: instance $a computed the prompt; instance $b loaded $from_redis of its tokens from Redis and computed $computed; same answer: '$first'; the cache $cache_id made on $a answered '$on_b' on $b"
