#!/usr/bin/env bash
# Builds the GGUF parser fuzz target (tests/fuzz/gguf_fuzz.cc) with clang's libFuzzer, ASan and
# UBSan into build-fuzz/, and runs it for SECONDS (default 60) from generated seed files. Exits
# non-zero on any crash, sanitizer report, leak or timeout. Needs clang and libclang-rt-14-dev.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
out=build-fuzz
mkdir -p "$out/corpus"
srcs=(tests/fuzz/gguf_fuzz.cc
      src/model/gguf.cc src/model/gguf_model.cc src/model/gguf_tokenizer.cc src/model/config.cc
      src/model/bpe_tokenizer.cc src/model/tokenizer.cc src/model/sp_tokenizer.cc
      src/util/dtype.cc src/util/status.cc src/util/mmap_file.cc)
# shellcheck disable=SC2046
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -fno-omit-frame-pointer -Isrc -Iinclude $(pkg-config --cflags oniguruma sentencepiece) \
  "${srcs[@]}" $(pkg-config --libs oniguruma sentencepiece) -o "$out/gguf_fuzz"
echo "fuzz: running gguf_fuzz for ${secs}s" >&2
CACHET_FUZZ_SEED_DIR="$out/corpus" "$out/gguf_fuzz" -max_total_time="$secs" -max_len=16384 \
  -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$out/corpus" 2>"$out/fuzz.log" || {
  tail -n 60 "$out/fuzz.log" >&2
  echo "fuzz: FAILED (log: $out/fuzz.log)" >&2
  exit 1
}
tail -n 12 "$out/fuzz.log" >&2
echo "fuzz: OK" >&2
