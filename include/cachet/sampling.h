// How the next token is chosen (src/runtime/sampler.h implements it).
#pragma once

#include <cstdint>
#include <vector>

namespace cachet {

// A bias added to one token's logit before sampling (OpenAI's logit_bias, llama.cpp's
// --logit-bias): -100 in effect bans the token, +100 all but forces it.
struct LogitBias {
  int32_t token = 0;
  float bias = 0.0f;
};

// What the output must be: any text, or one JSON object (OpenAI's response_format json_object;
// the sampler only picks tokens that keep the text a prefix of one, and EOS once it is closed).
enum class OutputFormat : uint8_t { kText, kJsonObject };

struct SamplingParams {
  float temperature = 0.8f;     // <= 0: greedy
  int top_k = 40;               // <= 0: off
  float top_p = 0.95f;          // >= 1: off
  float min_p = 0.05f;          // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off (llama.cpp convention: logit / p if > 0 else * p)
  // The tokens the penalties look at: the last repeat_last_n of the prompt and the text generated
  // so far (-1: all of them; 0: none), as llama.cpp's penalty_last_n.
  int repeat_last_n = 64;
  // OpenAI's penalties, over the same tokens: a token seen c > 0 times there loses
  // frequency_penalty * c + presence_penalty of its logit (0: off; negative values favour it).
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::vector<LogitBias> logit_bias = {};  // added first, before the penalties and the filters
  uint64_t seed = 0xcac4e7;
  OutputFormat format = OutputFormat::kText;
};

}  // namespace cachet
