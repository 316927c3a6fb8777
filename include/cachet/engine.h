// Cachet's public C++ API: load a model, open sessions (one sequence and its paged KV cache
// each), evaluate tokens and generate text.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/sampler.h"
#include "util/status.h"

namespace cachet {

class ModelConfig;
class Tokenizer;
class ThreadPool;
class Transformer;
class PagePool;
class PagedSequence;

// The model directory used when none is given (the embedded kvtiny).
std::string DefaultModelDir();

struct EngineOptions {
  std::string model_dir;   // empty: DefaultModelDir()
  int threads = 0;         // 0: one per core
  int ubatch = 512;        // tokens per prefill chunk
  int page_tokens = 16;    // tokens per KV page
  int64_t kv_mem_mib = 0;  // KV pool capacity; 0: enough for one sequence of n_ctx tokens
  int n_ctx = 0;           // max tokens of a sequence; 0: the model's max_position_embeddings
};

struct GenerateOptions {
  int max_tokens = 128;  // -n
  SamplingParams sampling;
  bool stop_at_eos = true;
};

struct GenerateResult {
  std::string text;
  std::vector<int32_t> tokens;  // generated ids
  int prompt_tokens = 0;
  std::string finish_reason;  // "stop" (EOS), "length" (-n or context)
  double prefill_ms = 0;      // time to first token
  double decode_ms = 0;
};

// Called with each completed piece of text as it is generated; return false to stop.
using TextCallback = std::function<bool(std::string_view piece)>;

class Engine;

// One sequence and its KV cache. Not thread-safe; sessions of one engine share its pool and
// threads, so use them from one thread at a time.
class Session {
 public:
  ~Session();
  // Appends tokens (in ubatch chunks) and returns the logits of the last one, or of all of them.
  // On error (bad id, context or KV pool exhausted) the session is unchanged.
  Status Eval(std::span<const int32_t> tokens, std::vector<float>* logits, bool all_logits = false);
  // Generates a continuation of the tokens so far plus prompt_tokens (which may be empty when
  // the session already holds logits from a previous Eval/Generate).
  Result<GenerateResult> Generate(std::span<const int32_t> prompt_tokens,
                                  const GenerateOptions& options,
                                  const TextCallback& on_text = nullptr);
  // A new session sharing this one's KV pages (copy-on-write).
  std::unique_ptr<Session> Fork() const;

  // Tokens whose K/V is in the cache.
  int n_tokens() const;
  const std::vector<int32_t>& tokens() const { return tokens_; }
  const PagedSequence& kv() const { return *seq_; }

 private:
  friend class Engine;
  Session(Engine& engine, std::unique_ptr<PagedSequence> seq);

  Engine& engine_;
  std::unique_ptr<PagedSequence> seq_;
  std::vector<int32_t> tokens_;
  std::vector<float> last_logits_;
  std::vector<int32_t> pending_;    // sampled but not yet evaluated (the last token of Generate)
  std::vector<int32_t> positions_;  // scratch
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  ~Engine();

  std::unique_ptr<Session> NewSession();
  // Tokenizes prompt (BOS added as the tokenizer says) and generates in a fresh session.
  Result<GenerateResult> Generate(std::string_view prompt, const GenerateOptions& options,
                                  const TextCallback& on_text = nullptr);

  const ModelConfig& config() const;
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  Transformer& transformer() { return *model_; }
  ThreadPool& pool() { return *pool_; }
  PagePool& kv_pool() { return *kv_pool_; }
  const EngineOptions& options() const { return options_; }
  int n_ctx() const { return n_ctx_; }

 private:
  friend class Session;
  Engine() = default;

  EngineOptions options_;
  int n_ctx_ = 0;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<PagePool> kv_pool_;
};

}  // namespace cachet
