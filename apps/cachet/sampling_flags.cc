// The sampling flags of run and chat (llama.cpp's names), parsed into SamplingParams.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>

#include "commands.h"

namespace cachet::cli {
namespace {

// ID+BIAS or ID-BIAS (llama.cpp's --logit-bias): BIAS a number up to 100, or inf after '-'.
LogitBias ParseLogitBias(const std::string& v) {
  const size_t sign = v.find_first_of("+-", 1);
  const auto bad = [&v] {
    return CLI::ValidationError("--logit-bias",
                                "'" + v + "' is not ID+BIAS or ID-BIAS (a token id, then a bias " +
                                    "of at most 100, or -inf to ban the token)");
  };
  if (sign == std::string::npos || sign == 0) throw bad();
  char* end = nullptr;
  errno = 0;
  const long id = std::strtol(v.c_str(), &end, 10);
  if (end != v.c_str() + sign || v[0] == '-' || v[0] == '+' || id > INT32_MAX || errno != 0) {
    throw bad();
  }
  const std::string amount = v.substr(sign + 1);
  if (v[sign] == '-' && amount == "inf") {
    return {static_cast<int32_t>(id), -std::numeric_limits<float>::infinity()};
  }
  const double b = std::strtod(amount.c_str(), &end);
  if (amount.empty() || *end != '\0' || !std::isfinite(b) || b < 0 || b > 100 || amount[0] == '+' ||
      amount[0] == '-') {
    throw bad();
  }
  return {static_cast<int32_t>(id), static_cast<float>(v[sign] == '-' ? -b : b)};
}

}  // namespace

void AddSamplingFlags(CLI::App& app, GenerateOptions& o) {
  SamplingParams& s = o.sampling;
  // A finite value in [lo, hi] (CLI::Range lets NaN through).
  auto finite_in = [](double lo, double hi) {
    return CLI::Validator(
        [lo, hi](std::string& v) -> std::string {
          const double x = std::strtod(v.c_str(), nullptr);
          if (std::isfinite(x) && x >= lo && x <= hi) return {};
          return "value " + v + " is not a number in [" + CLI::detail::to_string(lo) + ", " +
                 CLI::detail::to_string(hi) + "]";
        },
        "FLOAT in [" + CLI::detail::to_string(lo) + " - " + CLI::detail::to_string(hi) + "]");
  };
  app.add_option("-n,--n-predict", o.max_tokens, "Max tokens to generate")
      ->default_val(128)
      ->check(NonNegative());
  app.add_option("--temp", s.temperature, "Sampling temperature; 0 = greedy")
      ->default_val(0.8)
      ->check(finite_in(0, 100));
  app.add_option("--top-k", s.top_k, "Keep the k most likely tokens (0 = off)")
      ->default_val(40)
      ->check(NonNegative());
  app.add_option("--top-p", s.top_p,
                 "Nucleus sampling: keep the smallest set with this mass, the most likely token "
                 "at least (1 = off)")
      ->default_val(0.95)
      ->check(finite_in(0, 1));
  app.add_option("--min-p", s.min_p, "Drop tokens below min_p x the top probability (0 = off)")
      ->default_val(0.05)
      ->check(finite_in(0, 1));
  app.add_option_function<std::string>(
         "--response-format",
         [&s](const std::string& v) {
           if (v == "text") {
             s.format = OutputFormat::kText;
           } else if (v == "json_object") {
             s.format = OutputFormat::kJsonObject;
           } else {
             throw CLI::ValidationError("--response-format",
                                        "'" + v + "' is not text or json_object");
           }
         },
         "text (default), or json_object: the output is one JSON object (OpenAI's "
         "response_format): only tokens that keep the text a prefix of one are sampled, and the "
         "end of text only once it is closed")
      ->type_name("FORMAT");
  app.add_option("--repeat-penalty", s.repeat_penalty,
                 "Penalize tokens seen in the last --repeat-last-n (1 = off)")
      ->default_val(1.0)
      ->check(finite_in(1e-3, 1e3));
  app.add_option("--repeat-last-n", s.repeat_last_n,
                 "The tokens the repeat, presence and frequency penalties look at: the last n of "
                 "the prompt and the text so far (-1 = all of them, 0 = none)")
      ->default_val(64)
      ->check(AtLeast(-1, ">= -1 (-1: the whole context)", "INT"));
  app.add_option("--presence-penalty", s.presence_penalty,
                 "OpenAI's presence penalty: subtracted once from the logit of each token seen in "
                 "the last --repeat-last-n (0 = off; negative favours them)")
      ->default_val(0.0)
      ->check(finite_in(-2, 2));
  app.add_option("--frequency-penalty", s.frequency_penalty,
                 "OpenAI's frequency penalty: subtracted from a token's logit once per time it "
                 "occurs in the last --repeat-last-n (0 = off)")
      ->default_val(0.0)
      ->check(finite_in(-2, 2));
  app.add_option_function<std::vector<std::string>>(
         "--logit-bias",
         [&s](const std::vector<std::string>& all) {
           for (const std::string& v : all) s.logit_bias.push_back(ParseLogitBias(v));
         },
         "Add BIAS to token ID's logit, as llama.cpp's flag: ID+BIAS or ID-BIAS, BIAS up to 100 "
         "(-100 or -inf bans the token, +100 all but forces it); repeat for more tokens")
      ->type_name("ID(+|-)BIAS")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option_function<std::string>(
         "-s,--seed",
         [&s](const std::string& v) {
           // -1: a random seed, as llama.cpp's; else 0 .. 2^64 - 1 (CLI11 saturated larger ones).
           if (v == "-1") {
             std::random_device rd;
             s.seed = (uint64_t{rd()} << 32) ^ rd();
             return;
           }
           char* end = nullptr;
           errno = 0;
           const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
           if (v.empty() || v[0] == '-' || *end != '\0' || errno == ERANGE) {
             throw CLI::ValidationError("--seed",
                                        "'" + v +
                                            "' is not a seed: an integer from 0 to "
                                            "18446744073709551615, or -1 for a random one");
           }
           s.seed = x;
         },
         "Random seed (-1: a random one)")
      ->type_name("INT")
      ->default_str(std::to_string(s.seed));
  app.add_flag(
      "--ignore-eos", [&o](int64_t) { o.stop_at_eos = false; },
      "Keep generating past the end-of-sequence token");
}

void RequireLogitBiasInVocab(const SamplingParams& s, const Engine& engine) {
  const int vocab_size = engine.config().vocab_size;
  for (const LogitBias& b : s.logit_bias) {
    if (b.token >= vocab_size) {
      Fail(InvalidArgument("--logit-bias: token " + std::to_string(b.token) +
                           " is past the model's vocabulary of " + std::to_string(vocab_size) +
                           " tokens"));
    }
  }
}

}  // namespace cachet::cli
