// llama.cpp side of the peer harness: a small native driver linked against the prebuilt libllama
// that node-llama-cpp 3.21.1 ships (headers from the llama.cpp source bundled in the same
// package), so timings carry no JavaScript per-token overhead. Each mode mirrors what the matching
// Cachet command measures and prints one JSON object on stdout.
//
//   llama_peer speed  MODEL THREADS CTX[,CTX..] REPS N_DECODE KV_TYPE
//       like `cachet bench`: the same pseudo-random prompt (mt19937(1234), ids in [3, vocab)),
//       prefill in 512-token ubatches, then N_DECODE single-token steps; medians over REPS.
//   llama_peer greedy MODEL THREADS N_PREDICT KV_TYPE PROMPT_TEXT
//       greedy continuation (argmax of the logits, as `cachet run --temp 0`).
//   llama_peer kl MODEL THREADS WINDOWS.jsonl KV_TYPE[,KV_TYPE..]
//       the windows `cachet eval --kl --dump-windows` wrote; KL(f32 KV without flash attention ||
//       KV_TYPE) per scored position, with the same scoring rule and statistics as Cachet's
//       KlAccumulator.
//   llama_peer logits MODEL THREADS IDS.json KV_TYPE
//       the token ids of IDS.json (one JSON array) evaluated as one sequence from position 0 (no
//       BOS added); for each position the argmax of its logits and the top-2 margin (largest
//       logit minus the second largest), as `cachet run --logits-of IDS.json` prints them:
//       {"n":N,"argmax":[...],"margin":[...]}.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "llama.h"

namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "llama_peer: %s\n", what.c_str());
  std::exit(1);
}

void Quiet(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

ggml_type KvType(const std::string& name) {
  if (name == "f32") return GGML_TYPE_F32;
  if (name == "f16") return GGML_TYPE_F16;
  if (name == "bf16") return GGML_TYPE_BF16;
  if (name == "q8_0") return GGML_TYPE_Q8_0;
  if (name == "q4_0") return GGML_TYPE_Q4_0;
  Die("unknown KV type '" + name + "' (f32, f16, bf16, q8_0, q4_0)");
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double PeakRssBytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) * 1024.0;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Peer {
  llama_model* model = nullptr;
  const llama_vocab* vocab = nullptr;
  int n_vocab = 0;

  explicit Peer(const char* path) {
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = [](float, void*) { return true; };  // no dots on stderr
    model = llama_model_load_from_file(path, mp);
    if (!model) Die(std::string(path) + ": llama.cpp could not load the model");
    vocab = llama_model_get_vocab(model);
    n_vocab = llama_vocab_n_tokens(vocab);
  }
  ~Peer() { llama_model_free(model); }

  llama_context* Context(int threads, int n_ctx, ggml_type kv, bool flash = true) const {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    // Flash attention: llama.cpp needs it for a quantized V cache, so it is on for every KV type
    // alike; the KL reference turns it off (its CPU kernel rounds K/V and Q to f16 even when the
    // cache holds f32, which would make the f16 cache identical to the reference).
    cp.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = kv;
    cp.type_v = kv;
    cp.no_perf = true;
    llama_context* ctx = llama_init_from_model(model, cp);
    if (!ctx) Die("llama.cpp could not create a context");
    return ctx;
  }
};

// Decodes ids[0, n) at positions pos.. in 512-token batches; rows of logits are kept for the
// positions at or after logits_from (relative to ids).
void Decode(llama_context* ctx, llama_batch& batch, const int32_t* ids, int n, int pos,
            int logits_from, std::vector<float>* logits, int n_vocab) {
  if (logits) logits->clear();
  for (int start = 0; start < n; start += 512) {
    const int m = std::min(512, n - start);
    batch.n_tokens = m;
    for (int i = 0; i < m; ++i) {
      batch.token[i] = ids[start + i];
      batch.pos[i] = pos + start + i;
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = 0;
      batch.logits[i] = start + i >= logits_from;
    }
    if (llama_decode(ctx, batch) != 0) Die("llama_decode failed");
    if (!logits) continue;
    for (int i = 0; i < m; ++i) {
      if (start + i < logits_from) continue;
      const float* row = llama_get_logits_ith(ctx, i);
      logits->insert(logits->end(), row, row + n_vocab);
    }
  }
}

int Argmax(const float* row, int n) { return int(std::max_element(row, row + n) - row); }

void Speed(const Peer& peer, int threads, const std::vector<int>& ctxs, int reps, int n_decode,
           ggml_type kv) {
  const int max_ctx = *std::max_element(ctxs.begin(), ctxs.end());
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> dist(3, peer.n_vocab - 1);
  std::vector<int32_t> tokens(max_ctx);
  for (int32_t& t : tokens) t = dist(rng);
  llama_context* ctx = peer.Context(threads, max_ctx + n_decode, kv);
  llama_batch batch = llama_batch_init(512, 0, 1);
  std::string prefill_json, decode_json;
  for (int n : ctxs) {
    std::vector<double> prefill, decode;
    for (int rep = 0; rep < reps; ++rep) {
      llama_memory_clear(llama_get_memory(ctx), true);
      auto t0 = std::chrono::steady_clock::now();
      Decode(ctx, batch, tokens.data(), n, 0, n - 1, nullptr, peer.n_vocab);
      prefill.push_back(n / Seconds(t0));
      auto t1 = std::chrono::steady_clock::now();
      for (int i = 0; i < n_decode; ++i) {
        const int32_t one = tokens[i % n];
        Decode(ctx, batch, &one, 1, n + i, 0, nullptr, peer.n_vocab);
      }
      decode.push_back(n_decode / Seconds(t1));
    }
    const std::string sep = prefill_json.empty() ? "" : ",";
    prefill_json += sep + "\"" + std::to_string(n) + "\":" + std::to_string(Median(prefill));
    decode_json += sep + "\"" + std::to_string(n) + "\":" + std::to_string(Median(decode));
  }
  llama_batch_free(batch);
  llama_free(ctx);
  std::printf(
      "{\"threads\":%d,\"reps\":%d,\"n_decode\":%d,\"prefill_tok_s\":{%s},\"decode_tok_s\":{%s},"
      "\"peak_rss_bytes\":%.0f}\n",
      threads, reps, n_decode, prefill_json.c_str(), decode_json.c_str(), PeakRssBytes());
}

void Greedy(const Peer& peer, int threads, int n_predict, ggml_type kv, const std::string& text) {
  std::vector<int32_t> prompt(text.size() + 8);
  const int n = llama_tokenize(peer.vocab, text.data(), int(text.size()), prompt.data(),
                               int(prompt.size()), /*add_special=*/true, /*parse_special=*/false);
  if (n < 0) Die("tokenization failed");
  prompt.resize(n);
  llama_context* ctx = peer.Context(threads, n + n_predict + 16, kv);
  llama_batch batch = llama_batch_init(512, 0, 1);
  std::vector<float> logits;
  Decode(ctx, batch, prompt.data(), n, 0, n - 1, &logits, peer.n_vocab);
  std::vector<int32_t> out;
  for (int i = 0; i < n_predict; ++i) {
    const int32_t next = Argmax(logits.data(), peer.n_vocab);
    out.push_back(next);
    if (llama_vocab_is_eog(peer.vocab, next)) break;
    Decode(ctx, batch, &next, 1, n + i, 0, &logits, peer.n_vocab);
  }
  llama_batch_free(batch);
  llama_free(ctx);
  auto list = [](const std::vector<int32_t>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
    return s;
  };
  std::printf("{\"prompt\":[%s],\"completion\":[%s]}\n", list(prompt).c_str(), list(out).c_str());
}

struct Window {
  int score_from = 0;
  std::vector<int32_t> ids;
};

// Reads the JSON lines `cachet eval --kl --dump-windows` writes: {"score_from":N,"ids":[...]}.
std::vector<Window> ReadWindows(const char* path) {
  std::ifstream in(path);
  if (!in) Die(std::string(path) + ": cannot open");
  std::vector<Window> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    Window w;
    const size_t sf = line.find("\"score_from\":"), ids = line.find("\"ids\":[");
    if (sf == std::string::npos || ids == std::string::npos) Die(std::string(path) + ": bad line");
    w.score_from = std::atoi(line.c_str() + sf + 13);
    const char* p = line.c_str() + ids + 7;
    while (*p && *p != ']') {
      char* end = nullptr;
      w.ids.push_back(int32_t(std::strtol(p, &end, 10)));
      if (end == p) Die(std::string(path) + ": bad id list");
      p = end;
      while (*p == ',' || *p == ' ') ++p;
    }
    out.push_back(std::move(w));
  }
  if (out.empty()) Die(std::string(path) + ": no windows");
  return out;
}

void LogSoftmax(const float* x, int n, std::vector<double>* out) {
  out->resize(n);
  const double mx = *std::max_element(x, x + n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(double(x[i]) - mx);
  const double lz = mx + std::log(sum);
  for (int i = 0; i < n; ++i) (*out)[i] = double(x[i]) - lz;
}

// Same evaluation as Cachet's RunKlSweep: prefill ids[0, score_from), then the rest with logits;
// the row at position p predicts ids[p + 1].
std::vector<float> WindowLogits(const Peer& peer, llama_context* ctx, llama_batch& batch,
                                const Window& w) {
  llama_memory_clear(llama_get_memory(ctx), true);
  Decode(ctx, batch, w.ids.data(), w.score_from, 0, w.score_from, nullptr, peer.n_vocab);
  std::vector<float> logits;
  Decode(ctx, batch, w.ids.data() + w.score_from, int(w.ids.size()) - w.score_from, w.score_from, 0,
         &logits, peer.n_vocab);
  return logits;
}

// Reads a JSON array of token ids: "[1, 2, 3]".
std::vector<int32_t> ReadIds(const char* path) {
  std::ifstream in(path);
  if (!in) Die(std::string(path) + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const size_t open = text.find('[');
  if (open == std::string::npos) Die(std::string(path) + ": not a JSON array of token ids");
  std::vector<int32_t> ids;
  const char* p = text.c_str() + open + 1;
  while (*p == ' ' || *p == '\n') ++p;
  while (*p && *p != ']') {
    char* end = nullptr;
    ids.push_back(int32_t(std::strtol(p, &end, 10)));
    if (end == p) Die(std::string(path) + ": bad id list");
    p = end;
    while (*p == ',' || *p == ' ' || *p == '\n') ++p;
  }
  if (ids.empty()) Die(std::string(path) + ": no token ids");
  return ids;
}

void Logits(const Peer& peer, int threads, const char* path, ggml_type kv) {
  const std::vector<int32_t> ids = ReadIds(path);
  for (int32_t id : ids) {
    if (id < 0 || id >= peer.n_vocab)
      Die(std::string(path) + ": token id " + std::to_string(id) + " is out of range");
  }
  const int n = int(ids.size());
  llama_context* ctx = peer.Context(threads, n + 16, kv);
  llama_batch batch = llama_batch_init(512, 0, 1);
  std::vector<float> logits;
  Decode(ctx, batch, ids.data(), n, 0, 0, &logits, peer.n_vocab);
  llama_batch_free(batch);
  llama_free(ctx);
  std::string argmax, margin;
  for (int p = 0; p < n; ++p) {
    const float* row = logits.data() + size_t(p) * peer.n_vocab;
    const int best = Argmax(row, peer.n_vocab);
    float second = -INFINITY;
    for (int i = 0; i < peer.n_vocab; ++i) {
      if (i != best) second = std::max(second, row[i]);
    }
    char m[32];
    std::snprintf(m, sizeof m, "%.6g", double(row[best] - second));
    argmax += (p ? "," : "") + std::to_string(best);
    margin += std::string(p ? "," : "") + m;
  }
  std::printf("{\"n\":%d,\"argmax\":[%s],\"margin\":[%s]}\n", n, argmax.c_str(), margin.c_str());
}

void Kl(const Peer& peer, int threads, const char* path, const std::vector<std::string>& types) {
  const std::vector<Window> windows = ReadWindows(path);
  size_t max_len = 0;
  for (const Window& w : windows) max_len = std::max(max_len, w.ids.size());
  const int V = peer.n_vocab;
  struct Stats {
    std::vector<double> kl;
    double nll_ref = 0, nll = 0;
    int64_t top1 = 0;
  };
  std::vector<Stats> stats(types.size());
  llama_context* ref_ctx = peer.Context(threads, int(max_len) + 16, GGML_TYPE_F32, /*flash=*/false);
  std::vector<llama_context*> ctxs;
  for (const std::string& t : types)
    ctxs.push_back(peer.Context(threads, int(max_len) + 16, KvType(t)));
  llama_batch batch = llama_batch_init(512, 0, 1);
  std::vector<double> ref_lp, lp;
  for (const Window& w : windows) {
    const std::vector<float> ref = WindowLogits(peer, ref_ctx, batch, w);
    for (size_t t = 0; t < types.size(); ++t) {
      const std::vector<float> got = WindowLogits(peer, ctxs[t], batch, w);
      for (size_t p = 0; w.score_from + p + 1 < w.ids.size(); ++p) {
        const float* r = ref.data() + p * V;
        const float* g = got.data() + p * V;
        LogSoftmax(r, V, &ref_lp);
        LogSoftmax(g, V, &lp);
        double kl = 0;
        for (int i = 0; i < V; ++i) kl += std::exp(ref_lp[i]) * (ref_lp[i] - lp[i]);
        Stats& s = stats[t];
        s.kl.push_back(kl);
        const int32_t next = w.ids[w.score_from + p + 1];
        s.nll_ref -= ref_lp[next];
        s.nll -= lp[next];
        s.top1 += Argmax(r, V) == Argmax(g, V);
      }
    }
  }
  llama_batch_free(batch);
  for (llama_context* c : ctxs) llama_free(c);
  llama_free(ref_ctx);
  std::printf("{\"windows\":%zu,\"kl\":{", windows.size());
  for (size_t t = 0; t < types.size(); ++t) {
    std::vector<double> v = stats[t].kl;
    std::sort(v.begin(), v.end());
    double sum = 0;
    for (double x : v) sum += x;
    const double n = double(v.size());
    std::printf(
        "%s\"%s\":{\"positions\":%zu,\"mean_kl\":%.6g,\"p99_kl\":%.6g,\"top1_agree\":%.6f,"
        "\"ppl_ref\":%.6f,\"ppl\":%.6f}",
        t ? "," : "", types[t].c_str(), v.size(), sum / n, v[size_t(std::ceil(0.99 * n)) - 1],
        double(stats[t].top1) / n, std::exp(stats[t].nll_ref / n), std::exp(stats[t].nll / n));
  }
  std::printf("}}\n");
}

// MODEL (f16) written to OUT as llama.cpp's llama-quantize writes FILE_TYPE, mixes included.
void Quantize(const char* in, int threads, const char* out, const std::string& type) {
  static const std::pair<const char*, llama_ftype> kTypes[] = {
      {"q4_k_m", LLAMA_FTYPE_MOSTLY_Q4_K_M}, {"q5_k_m", LLAMA_FTYPE_MOSTLY_Q5_K_M},
      {"iq4_xs", LLAMA_FTYPE_MOSTLY_IQ4_XS}, {"q3_k_m", LLAMA_FTYPE_MOSTLY_Q3_K_M},
      {"q2_k", LLAMA_FTYPE_MOSTLY_Q2_K},     {"q4_0", LLAMA_FTYPE_MOSTLY_Q4_0},
      {"q8_0", LLAMA_FTYPE_MOSTLY_Q8_0}};
  llama_model_quantize_params p = llama_model_quantize_default_params();
  p.nthread = threads;
  bool found = false;
  for (const auto& [name, ftype] : kTypes) {
    if (type == name) {
      p.ftype = ftype;
      found = true;
    }
  }
  if (!found) {
    std::string names;
    for (const auto& [name, ftype] : kTypes) names += std::string(names.empty() ? "" : ", ") + name;
    Die("quantize: unknown file type '" + type + "' (" + names + ")");
  }
  if (llama_model_quantize(in, out, &p) != 0) Die(std::string("quantize: ") + in + " failed");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr,
                 "usage: llama_peer speed MODEL THREADS CTX[,CTX..] REPS N_DECODE KV_TYPE\n"
                 "       llama_peer greedy MODEL THREADS N_PREDICT KV_TYPE PROMPT_TEXT\n"
                 "       llama_peer kl MODEL THREADS WINDOWS.jsonl KV_TYPE[,KV_TYPE..]\n"
                 "       llama_peer logits MODEL THREADS IDS.json KV_TYPE\n"
                 "       llama_peer quantize MODEL THREADS OUT.gguf FILE_TYPE (q4_k_m, q5_k_m, "
                 "iq4_xs, q3_k_m, q2_k, q4_0, q8_0)\n");
    return 2;
  }
  llama_log_set(Quiet, nullptr);
  // The package's CPU backends are separate libraries (one per x86 level); load the best one.
  // bench/peers/setup.sh compiles their directory in; LLAMA_PEER_BACKENDS overrides it.
  if (const char* dir = std::getenv("LLAMA_PEER_BACKENDS")) {
    ggml_backend_load_all_from_path(dir);
  } else {
#ifdef LLAMA_PEER_BACKENDS_DIR
    ggml_backend_load_all_from_path(LLAMA_PEER_BACKENDS_DIR);
#else
    ggml_backend_load_all();
#endif
  }
  llama_backend_init();
  const std::string mode = argv[1];
  const int threads = std::atoi(argv[3]);
  if (mode == "quantize" && argc == 6) {  // llama.cpp's quantizer, as llama-quantize runs it
    Quantize(argv[2], threads, argv[4], argv[5]);
    llama_backend_free();
    return 0;
  }
  {
    Peer peer(argv[2]);
    if (mode == "speed" && argc == 8) {
      std::vector<int> ctxs;
      for (const std::string& c : Split(argv[4])) ctxs.push_back(std::atoi(c.c_str()));
      Speed(peer, threads, ctxs, std::atoi(argv[5]), std::atoi(argv[6]), KvType(argv[7]));
    } else if (mode == "greedy" && argc == 7) {
      Greedy(peer, threads, std::atoi(argv[4]), KvType(argv[5]), argv[6]);
    } else if (mode == "kl" && argc == 6) {
      Kl(peer, threads, argv[4], Split(argv[5]));
    } else if (mode == "logits" && argc == 6) {
      Logits(peer, threads, argv[4], KvType(argv[5]));
    } else {
      Die("bad arguments for mode '" + mode + "' (run without arguments for usage)");
    }
  }
  llama_backend_free();
  return 0;
}
