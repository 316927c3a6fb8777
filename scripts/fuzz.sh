#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ (gguf: the GGUF parser; chat_template: chat template
# recognition and rendering; server_request: the server's request parsers and response writers;
# safetensors: the safetensors header and tensor table; tokenizer_json: the tokenizer.json loader,
# then encoding and decoding with what it loaded) with clang's libFuzzer, ASan and UBSan into
# build-fuzz/, and runs each for SECONDS (default 60) from generated seed files (some derived from
# models/kvtiny). Usage: scripts/fuzz.sh [SECONDS [TARGET...]]
# (default: every target), as many at once as there are cores. Exits non-zero on any crash,
# sanitizer report, leak, timeout or failed build. Needs clang, libclang-rt-14-dev and lld.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
out=build-fuzz
# Each target: tests/fuzz/<target>_fuzz.cc and the sources it needs.
declare -A srcs=(
  [gguf]="src/model/gguf.cc src/model/gguf_model.cc src/model/gguf_tokenizer.cc src/model/config.cc
          src/model/bpe_tokenizer.cc src/model/bpe_encode.cc src/model/tokenizer.cc
          src/model/sp_tokenizer.cc src/util/dtype.cc src/util/status.cc src/util/mmap_file.cc"
  [chat_template]="src/runtime/chat_template.cc src/util/status.cc"
  [server_request]="src/server/request.cc src/server/response.cc src/server/reasoning.cc
          src/runtime/json_constraint.cc
          src/runtime/chat_template.cc
          src/runtime/blend.cc src/kv/press/press_spec.cc src/kv/codecs/codec.cc src/util/dtype.cc src/util/status.cc"
  [safetensors]="src/model/safetensors.cc src/util/mmap_file.cc src/util/dtype.cc src/util/status.cc"
  [tokenizer_json]="src/model/bpe_tokenizer.cc src/model/bpe_encode.cc src/model/tokenizer.cc
          src/model/sp_tokenizer.cc src/model/gguf.cc src/model/gguf_model.cc
          src/model/gguf_tokenizer.cc src/model/config.cc src/util/dtype.cc src/util/status.cc
          src/util/mmap_file.cc"
)
# Link flags of a target. codec.cc holds the codec-name parser next to the codecs, which need the
# calibrated decoders and more: lld drops the functions nothing reaches, and what only they need
# (GNU ld keeps them all: libFuzzer's coverage tables point at every function).
declare -A ldflags=(
  [server_request]="-fuse-ld=lld -Wl,--gc-sections"
)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf chat_template server_request safetensors tokenizer_json)
for t in "${targets[@]}"; do
  [ -n "${srcs[$t]:-}" ] || { echo "fuzz: unknown target $t (known: ${!srcs[*]})" >&2; exit 2; }
done

# Every distinct source (the targets share most of theirs) is compiled once, as many at once as
# there are cores, then each target is linked: compiling each target's list in one clang call
# built the shared files twice and one after the other (gguf and tokenizer_json: 63 s each).
cflags=(-std=c++20 -O1 -g1 -fsanitize=address,undefined -fno-sanitize-recover=undefined
        -fno-omit-frame-pointer -ffunction-sections -fdata-sections -Isrc -Iinclude)
# shellcheck disable=SC2207
cflags+=($(pkg-config --cflags oniguruma sentencepiece))
mkdir -p "$out/obj"
obj_of() { local f=${1//\//_}; echo "$out/obj/${f%.cc}.o"; }
compile() {  # source, extra flags...: one object, its errors in the object's .log
  local src=$1 o
  o=$(obj_of "$src")
  shift
  clang++ "${cflags[@]}" "$@" -c "$src" -o "$o" >"$o.log" 2>&1 || { cat "$o.log" >&2; return 1; }
}
export -f compile obj_of
export out
declare -A all_srcs=()
for t in "${targets[@]}"; do
  for f in ${srcs[$t]}; do all_srcs[$f]=1; done
done
echo "fuzz: compiling ${#all_srcs[@]} sources and ${#targets[@]} targets" >&2
{
  printf '%s\n' "${!all_srcs[@]}" | sed 's/$/ -fsanitize=fuzzer-no-link/'
  for t in "${targets[@]}"; do echo "tests/fuzz/${t}_fuzz.cc -fsanitize=fuzzer"; done
} | CFLAGS_LIST="${cflags[*]}" xargs -P "$(nproc)" -L 1 bash -c \
  'cflags=($CFLAGS_LIST); compile "$@"' _ || { echo "fuzz: build FAILED" >&2; exit 1; }

# Links and runs one target; its output goes to $out/$t.log (the fuzzer's) and $out/$t.build.
fuzz_one() {
  local t=$1 objs=() f
  mkdir -p "$out/corpus-$t"
  for f in "tests/fuzz/${t}_fuzz.cc" ${srcs[$t]}; do objs+=("$(obj_of "$f")"); done
  # shellcheck disable=SC2046,SC2086
  clang++ -fsanitize=fuzzer,address,undefined "${objs[@]}" \
    $(pkg-config --libs oniguruma sentencepiece) ${ldflags[$t]:-} -o "$out/${t}_fuzz" \
    >"$out/$t.build" 2>&1 || return 1
  CACHET_FUZZ_SEED_DIR="$out/corpus-$t" "$out/${t}_fuzz" -max_total_time="$secs" -max_len=16384 \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$out/$t-" \
    "$out/corpus-$t" 2>"$out/$t.log"
}

# One target per core at a time (each fuzzer runs on one thread): CI's two cores fuzz two.
jobs=$(nproc)
declare -A target_of=()  # pid -> target
status=0
reap() {  # waits for whichever target ends first and reports it
  local pid t rc=0
  wait -n -p pid || rc=$?
  t=${target_of[$pid]}
  unset "target_of[$pid]"
  if [ "$rc" -eq 0 ]; then
    tail -n 12 "$out/$t.log" >&2
    echo "fuzz: $t OK" >&2
  else
    cat "$out/$t.build" >&2
    [ -f "$out/$t.log" ] && tail -n 60 "$out/$t.log" >&2
    echo "fuzz: $t FAILED (log: $out/$t.log)" >&2
    status=1
  fi
}
for t in "${targets[@]}"; do
  [ ${#target_of[@]} -lt "$jobs" ] || reap
  echo "fuzz: linking and running ${t}_fuzz for ${secs}s" >&2
  rm -f "$out/$t.log"
  fuzz_one "$t" &
  target_of[$!]=$t
done
while [ ${#target_of[@]} -gt 0 ]; do reap; done
exit "$status"
