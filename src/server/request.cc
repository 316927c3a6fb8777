#include "request.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

namespace cachet::server {
namespace {

using json = nlohmann::json;

Status Bad(const std::string& field, const std::string& message) {
  return InvalidArgument(field + ": " + message);
}

// What a value was, for messages: scalars as written (shortened), containers by type.
std::string Got(const json& j) {
  if (j.is_object() || j.is_array()) return "got an " + std::string(j.type_name());
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return "got " + s;
}

// The member `name` of obj, or null when it is absent or JSON null (OpenAI: null = default).
const json* Field(const json& obj, const std::string& name) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integral JSON number (an integral float such as 16.0 too), when it fits in int64.
std::optional<int64_t> AsInt(const json& j) {
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (j.is_number_integer()) return j.get<int64_t>();
  if (j.is_number_float()) {
    const double d = j.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
      return static_cast<int64_t>(d);
    }
  }
  return std::nullopt;
}

Status GetBool(const json& obj, const std::string& name, bool* out) {
  const json* j = Field(obj, name);
  if (j == nullptr) return OkStatus();
  if (!j->is_boolean()) return Bad(name, "must be true or false, " + Got(*j));
  *out = j->get<bool>();
  return OkStatus();
}

Status GetString(const json& obj, const std::string& name, std::optional<std::string>* out) {
  const json* j = Field(obj, name);
  if (j == nullptr) return OkStatus();
  if (!j->is_string()) return Bad(name, "must be a string, " + Got(*j));
  *out = j->get<std::string>();
  return OkStatus();
}

// An integer in [lo, hi]; larger values are clamped to hi when clamp_high is set.
Status GetInt(const json& obj, const std::string& name, int64_t lo, int64_t hi,
              std::optional<int64_t>* out, bool clamp_high = false) {
  const json* j = Field(obj, name);
  if (j == nullptr) return OkStatus();
  std::optional<int64_t> v = AsInt(*j);
  if (!v && clamp_high && j->is_number_unsigned()) v = hi;  // beyond int64
  if (!v) return Bad(name, "must be an integer, " + Got(*j));
  if (*v > hi && clamp_high) v = hi;
  if (*v < lo || *v > hi) {
    return Bad(name,
               "must be an integer " +
                   (clamp_high ? ">= " + std::to_string(lo)  // larger ones mean "at most"
                               : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]") +
                   ", " + Got(*j));
  }
  *out = v;
  return OkStatus();
}

enum class Bound { kClosed, kOpen };

Status GetNumber(const json& obj, const std::string& name, double lo, Bound lo_bound, double hi,
                 std::optional<double>* out) {
  const json* j = Field(obj, name);
  if (j == nullptr) return OkStatus();
  if (!j->is_number()) return Bad(name, "must be a number, " + Got(*j));
  const double v = j->get<double>();
  const bool low_ok = lo_bound == Bound::kOpen ? v > lo : v >= lo;
  if (!std::isfinite(v) || !low_ok || v > hi) {
    char range[96];
    std::snprintf(range, sizeof(range), "%s%g, %g]", lo_bound == Bound::kOpen ? "(" : "[", lo, hi);
    return Bad(name, "must be a number in " + std::string(range) + ", " + Got(*j));
  }
  *out = v;
  return OkStatus();
}

constexpr double kHuge = std::numeric_limits<double>::max();

// Token ids of a JSON array, each in [0, vocab_size) when vocab_size > 0.
Status GetTokenIds(const json& arr, const std::string& where, int32_t vocab_size,
                   std::vector<int32_t>* out) {
  out->clear();
  out->reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i) {
    const std::string at = where + "[" + std::to_string(i) + "]";
    const std::optional<int64_t> id = AsInt(arr[i]);
    if (!id) return Bad(at, "must be a token id (an integer), " + Got(arr[i]));
    const int64_t limit = vocab_size > 0 ? vocab_size : std::numeric_limits<int32_t>::max();
    if (*id < 0 || *id >= limit) {
      return Bad(at, "token id " + std::to_string(*id) + " is outside the vocabulary [0, " +
                         std::to_string(limit) + ")");
    }
    out->push_back(static_cast<int32_t>(*id));
  }
  return OkStatus();
}

// An array of token ids, as far as its first element says (the others are checked as ids).
bool IsIdArray(const json& j) { return j.is_array() && !j.empty() && j[0].is_number(); }

Status ParsePrompt(const json& body, int32_t vocab_size, ParsedRequest* r) {
  const json* p = Field(body, "prompt");
  if (p == nullptr) return Bad("prompt", "required (a string or an array of token ids)");
  if (p->is_string()) {
    if (p->get_ref<const std::string&>().empty()) return Bad("prompt", "empty");
    r->prompt_text = p->get<std::string>();
    return OkStatus();
  }
  if (!p->is_array()) {
    return Bad("prompt", "must be a string or an array of token ids, " + Got(*p));
  }
  if (p->empty()) return Bad("prompt", "empty");
  if (IsIdArray(*p)) return GetTokenIds(*p, "prompt", vocab_size, &r->prompt_ids);
  // OpenAI's batch forms: a list of prompts (strings or token id lists). One is taken as the
  // prompt; several are refused rather than half served.
  if (p->size() > 1) {
    return Bad("prompt", "a list of " + std::to_string(p->size()) +
                             " prompts; this server takes one prompt per request (a string or "
                             "an array of token ids)");
  }
  const json& only = (*p)[0];
  if (only.is_string()) {
    if (only.get_ref<const std::string&>().empty()) return Bad("prompt[0]", "empty");
    r->prompt_text = only.get<std::string>();
    return OkStatus();
  }
  if (only.is_array()) {
    if (only.empty()) return Bad("prompt[0]", "empty");
    return GetTokenIds(only, "prompt[0]", vocab_size, &r->prompt_ids);
  }
  return Bad("prompt[0]", "must be a string or an array of token ids, " + Got(only));
}

// content: a string, null, or a list of parts of which only {"type": "text", "text"} is served.
Status ParseContent(const json& m, const std::string& where, std::string* out) {
  const json* c = Field(m, "content");
  if (c == nullptr) return OkStatus();
  if (c->is_string()) {
    *out = c->get<std::string>();
    return OkStatus();
  }
  if (!c->is_array()) {
    return Bad(where, "must be a string or an array of content parts, " + Got(*c));
  }
  for (size_t i = 0; i < c->size(); ++i) {
    const json& part = (*c)[i];
    const std::string at = where + "[" + std::to_string(i) + "]";
    if (!part.is_object()) return Bad(at, "must be an object {\"type\": \"text\", \"text\": ...}");
    const json* type = Field(part, "type");
    if (type == nullptr || !type->is_string()) {
      return Bad(at + ".type", "required: \"text\"");
    }
    if (type->get_ref<const std::string&>() != "text") {
      return Bad(at + ".type", "\"" + type->get<std::string>() +
                                   "\" is not supported; this server takes text parts only");
    }
    const json* text = Field(part, "text");
    if (text == nullptr || !text->is_string()) {
      return Bad(at + ".text", "must be a string" + (text ? ", " + Got(*text) : std::string()));
    }
    out->append(text->get_ref<const std::string&>());
  }
  return OkStatus();
}

Status ParseMessages(const json& body, ParsedRequest* r) {
  const json* ms = Field(body, "messages");
  if (ms == nullptr) return Bad("messages", "required (an array of {\"role\", \"content\"})");
  if (!ms->is_array()) return Bad("messages", "must be an array, " + Got(*ms));
  if (ms->empty()) return Bad("messages", "empty");
  for (size_t i = 0; i < ms->size(); ++i) {
    const json& m = (*ms)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return Bad(at, "must be an object {\"role\", \"content\"}, " + Got(m));
    const json* role = Field(m, "role");
    if (role == nullptr) return Bad(at + ".role", "required");
    if (!role->is_string()) return Bad(at + ".role", "must be a string, " + Got(*role));
    ChatMessage msg;
    // OpenAI's newer name of the system role.
    const std::string& name = role->get_ref<const std::string&>();
    Result<ChatRole> parsed =
        name == "developer" ? Result<ChatRole>(ChatRole::kSystem) : ParseChatRole(name);
    if (!parsed.ok()) return Bad(at + ".role", parsed.status().message() + " (and developer)");
    msg.role = parsed.value();
    // Only an assistant's turn may come without content (OpenAI's rule: one that called tools).
    if (const json* c = Field(m, "content");
        (c == nullptr || c->is_null()) && msg.role != ChatRole::kAssistant) {
      return Bad(at + ".content", "required for a " + name + " message");
    }
    CACHET_RETURN_IF_ERROR(ParseContent(m, at + ".content", &msg.content));
    if (const json* tc = Field(m, "tool_calls");
        tc != nullptr && !(tc->is_array() && tc->empty())) {
      return Bad(at + ".tool_calls", "not supported (this server has no tool calling)");
    }
    r->messages.push_back(std::move(msg));
  }
  return OkStatus();
}

// "chunks": an array of non-empty strings; "blend": a spec, only with chunks.
Status ParseChunks(const json& body, ParsedRequest* r) {
  if (const json* c = Field(body, "chunks"); c != nullptr) {
    if (!c->is_array()) return Bad("chunks", "must be an array of strings, " + Got(*c));
    if (c->size() > 256) {
      return Bad("chunks", "at most 256 chunks, got " + std::to_string(c->size()));
    }
    for (size_t i = 0; i < c->size(); ++i) {
      const std::string at = "chunks[" + std::to_string(i) + "]";
      const json& e = (*c)[i];
      if (!e.is_string()) return Bad(at, "must be a string, " + Got(e));
      if (e.get_ref<const std::string&>().empty()) return Bad(at, "empty string");
      r->chunks.push_back(e.get<std::string>());
    }
  }
  std::optional<std::string> sep;
  CACHET_RETURN_IF_ERROR(GetString(body, "chunk_separator", &sep));
  if (sep) {
    if (sep->empty()) return Bad("chunk_separator", "empty string");
    if (!r->chunks.empty()) return Bad("chunk_separator", "not with \"chunks\"");
    if (r->endpoint != Endpoint::kCompletions || !r->prompt_text) {
      return Bad("chunk_separator", "needs a text prompt of /v1/completions");
    }
    const std::string& text = *r->prompt_text;
    std::string joined;
    std::vector<std::string> pieces;
    for (size_t at = 0;;) {
      const size_t next = text.find(*sep, at);
      pieces.push_back(text.substr(at, next == std::string::npos ? next : next - at));
      if (next == std::string::npos) break;
      at = next + sep->size();
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
      joined += pieces[i];
      if (i > 0 && i + 1 < pieces.size() && !pieces[i].empty()) r->chunks.push_back(pieces[i]);
    }
    r->prompt_text = std::move(joined);
    r->chunk_separator = std::move(*sep);
  }
  std::optional<std::string> blend;
  CACHET_RETURN_IF_ERROR(GetString(body, "blend", &blend));
  if (blend) {
    if (r->chunks.empty() && r->chunk_separator.empty()) {
      return Bad("blend", "only with \"chunks\" or \"chunk_separator\"");
    }
    Result<BlendOptions> b = ParseBlend(*blend);
    if (!b.ok()) return Bad("blend", b.status().message());
    r->blend = *b;
  }
  if (r->chunks.empty()) return OkStatus();
  if (!r->cache_id.empty()) return Bad("chunks", "not with cache_id");
  if (r->press) return Bad("chunks", "not with kv_press: press after the chunks are reused");
  if (r->endpoint == Endpoint::kCompletions && !r->prompt_text) {
    return Bad("chunks", "need a text prompt (the chunks are found in its text)");
  }
  return OkStatus();
}

Status ParseStop(const json& body, int max_stop, std::vector<std::string>* out) {
  const json* s = Field(body, "stop");
  if (s == nullptr) return OkStatus();
  if (s->is_string()) {
    if (s->get_ref<const std::string&>().empty()) return Bad("stop", "empty string");
    out->push_back(s->get<std::string>());
    return OkStatus();
  }
  if (!s->is_array()) return Bad("stop", "must be a string or an array of strings, " + Got(*s));
  if (static_cast<int64_t>(s->size()) > max_stop) {
    return Bad("stop", "at most " + std::to_string(max_stop) + " stop strings, got " +
                           std::to_string(s->size()));
  }
  for (size_t i = 0; i < s->size(); ++i) {
    const std::string at = "stop[" + std::to_string(i) + "]";
    const json& e = (*s)[i];
    if (!e.is_string()) return Bad(at, "must be a string, " + Got(e));
    if (e.get_ref<const std::string&>().empty()) return Bad(at, "empty string");
    out->push_back(e.get<std::string>());
  }
  return OkStatus();
}

// The error of a field inside an object, named by its path ("kv_press.ratio: ...").
Status Inside(const std::string& object, Status s) {
  return s.ok() ? s : Status(s.code(), object + "." + s.message());
}

// kv_press: {"name": a press as --press takes it, "ratio": fraction removed (default 0.5, as
// --ratio) | "budget": tokens kept per layer and KV head}.
Status ParsePress(const json& body, std::optional<press::PressOptions>* out) {
  const json* p = Field(body, "kv_press");
  if (p == nullptr) return OkStatus();
  if (!p->is_object()) {
    return Bad("kv_press", "must be an object {\"name\", \"ratio\"}, " + Got(*p));
  }
  for (const auto& [key, value] : p->items()) {
    if (key != "name" && key != "ratio" && key != "budget") {
      return Bad("kv_press." + key, "unknown field (known: name, ratio, budget)");
    }
  }
  std::optional<std::string> name;
  CACHET_RETURN_IF_ERROR(Inside("kv_press", GetString(*p, "name", &name)));
  if (!name) return Bad("kv_press.name", "required (a press as --press takes it: snapkv, ...)");
  press::PressOptions o;
  o.ratio = 0.5;  // --ratio's default
  if (Status s = press::ParsePressSpec(*name, &o); !s.ok()) {
    return Bad("kv_press.name", s.message());
  }
  std::optional<double> ratio;
  CACHET_RETURN_IF_ERROR(
      Inside("kv_press", GetNumber(*p, "ratio", 0.0, Bound::kClosed, 0.999999, &ratio)));
  std::optional<int64_t> budget;
  CACHET_RETURN_IF_ERROR(
      Inside("kv_press", GetInt(*p, "budget", 1, std::numeric_limits<int32_t>::max(), &budget)));
  if (ratio && budget) return Bad("kv_press.budget", "give ratio or budget, not both");
  if (ratio) o.ratio = *ratio;
  if (budget) o.budget = static_cast<int>(*budget);
  *out = o;
  return OkStatus();
}

// logit_bias: {"token id": bias in [-100, 100], ...}, as OpenAI's API takes it (ids as strings).
Status ParseLogitBias(const json& body, int32_t vocab_size, std::vector<LogitBias>* out) {
  const json* lb = Field(body, "logit_bias");
  if (lb == nullptr) return OkStatus();
  if (!lb->is_object()) return Bad("logit_bias", "must be an object of token ids, " + Got(*lb));
  for (const auto& [key, value] : lb->items()) {
    // The key is the client's text: named in the message, never in the param path.
    const std::string what = "key \"" + key.substr(0, 32) + "\" ";
    int64_t id = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (ec != std::errc() || end != key.data() + key.size() || id < 0 ||
        (vocab_size > 0 && id >= vocab_size) || id > std::numeric_limits<int32_t>::max()) {
      return Bad("logit_bias",
                 what + "must be a token id in [0, " +
                     (vocab_size > 0 ? std::to_string(vocab_size) : std::string("vocab")) + ")");
    }
    if (!value.is_number() || !(value.get<double>() >= -100.0 && value.get<double>() <= 100.0)) {
      return Bad("logit_bias", what + "must map to a number in [-100, 100], " + Got(value));
    }
    out->push_back({static_cast<int32_t>(id), value.get<float>()});
  }
  return OkStatus();
}

// OpenAI fields this server cannot honour: refused unless neutral.
Status RejectUnsupported(const json& body, Endpoint endpoint, int n) {
  for (const char* name : {"tools", "functions"}) {
    if (const json* t = Field(body, name); t != nullptr && !(t->is_array() && t->empty())) {
      return Bad(name, "not supported (this server has no tool calling)");
    }
  }
  if (endpoint == Endpoint::kCompletions) {
    bool echo = false;
    CACHET_RETURN_IF_ERROR(GetBool(body, "echo", &echo));
    if (echo) return Bad("echo", "not supported");
    std::optional<std::string> suffix;
    CACHET_RETURN_IF_ERROR(GetString(body, "suffix", &suffix));
    if (suffix && !suffix->empty()) return Bad("suffix", "not supported");
    std::optional<int64_t> best_of;
    CACHET_RETURN_IF_ERROR(GetInt(body, "best_of", 1, 1 << 20, &best_of));
    if (best_of && *best_of != 1 && *best_of != n) {
      return Bad("best_of", "not supported (only best_of = n, which is what n gives)");
    }
  }
  return OkStatus();
}

Result<json> ParseObject(std::string_view text) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    // "[json.exception.parse_error.101] parse error at line 1, column 2: ..." without the tag;
    // the bytes it quotes ("last read: ...") may be anything, so they are written as \xNN.
    std::string what;
    for (unsigned char c : std::string_view(e.what())) {
      if (c >= 0x20 && c < 0x7f) {
        what += static_cast<char>(c);
      } else {
        char hex[5];
        std::snprintf(hex, sizeof(hex), "\\x%02X", c);
        what += hex;
      }
    }
    if (const size_t tag = what.find("] "); what.starts_with("[json.") && tag != what.npos) {
      what.erase(0, tag + 2);
    }
    return InvalidArgument("malformed JSON in the request body: " + what);
  }
  if (!body.is_object()) {
    return InvalidArgument("the request body must be a JSON object, " + Got(body));
  }
  return body;
}

}  // namespace

Result<ParsedRequest> ParseRequest(std::string_view text, Endpoint endpoint,
                                   const ParseLimits& limits) {
  CACHET_ASSIGN_OR_RETURN(json body, ParseObject(text));
  ParsedRequest r;
  r.endpoint = endpoint;

  std::optional<std::string> model;
  CACHET_RETURN_IF_ERROR(GetString(body, "model", &model));
  if (model && !model->empty() && !limits.model_name.empty() && *model != limits.model_name) {
    return NotFound("model: the model '" + *model + "' does not exist; this server serves '" +
                    limits.model_name + "'");
  }

  if (endpoint == Endpoint::kCompletions) {
    CACHET_RETURN_IF_ERROR(ParsePrompt(body, limits.vocab_size, &r));
  } else {
    CACHET_RETURN_IF_ERROR(ParseMessages(body, &r));
  }

  // max_tokens (chat: max_completion_tokens first, OpenAI's newer name).
  constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
  std::optional<int64_t> max_tokens;
  if (endpoint == Endpoint::kChat) {
    CACHET_RETURN_IF_ERROR(GetInt(body, "max_completion_tokens", 1, kMaxInt, &max_tokens, true));
  }
  if (!max_tokens) {
    CACHET_RETURN_IF_ERROR(GetInt(body, "max_tokens", 1, kMaxInt, &max_tokens, true));
  }
  if (max_tokens) r.max_tokens = static_cast<int>(*max_tokens);

  std::optional<double> v;
  CACHET_RETURN_IF_ERROR(GetNumber(body, "temperature", 0.0, Bound::kClosed, 2.0, &v));
  if (v) r.sampling.temperature = static_cast<float>(*v);
  v.reset();
  CACHET_RETURN_IF_ERROR(GetNumber(body, "top_p", 0.0, Bound::kOpen, 1.0, &v));
  if (v) r.sampling.top_p = static_cast<float>(*v);
  v.reset();
  CACHET_RETURN_IF_ERROR(GetNumber(body, "min_p", 0.0, Bound::kClosed, 1.0, &v));
  if (v) r.sampling.min_p = static_cast<float>(*v);
  v.reset();
  // repetition_penalty (vLLM) or repeat_penalty (llama.cpp): logits of recent tokens / factor.
  for (const char* name : {"repetition_penalty", "repeat_penalty"}) {
    CACHET_RETURN_IF_ERROR(GetNumber(body, name, 0.0, Bound::kOpen, 100.0, &v));
    if (v) r.sampling.repeat_penalty = static_cast<float>(*v);
    v.reset();
  }
  // OpenAI's presence / frequency penalties, over the tokens the repeat penalty sees.
  CACHET_RETURN_IF_ERROR(GetNumber(body, "presence_penalty", -2.0, Bound::kClosed, 2.0, &v));
  if (v) r.sampling.presence_penalty = static_cast<float>(*v);
  v.reset();
  CACHET_RETURN_IF_ERROR(GetNumber(body, "frequency_penalty", -2.0, Bound::kClosed, 2.0, &v));
  if (v) r.sampling.frequency_penalty = static_cast<float>(*v);
  v.reset();
  CACHET_RETURN_IF_ERROR(ParseLogitBias(body, limits.vocab_size, &r.sampling.logit_bias));
  std::optional<int64_t> i;
  // llama.cpp's server: how many recent tokens the penalties see (-1: all, 0: none).
  CACHET_RETURN_IF_ERROR(GetInt(body, "repeat_last_n", -1, kMaxInt, &i));
  if (i) r.sampling.repeat_last_n = static_cast<int>(*i);
  i.reset();
  CACHET_RETURN_IF_ERROR(GetInt(body, "top_k", -1, kMaxInt, &i));  // -1 or 0: off
  if (i) r.sampling.top_k = static_cast<int>(std::max<int64_t>(*i, 0));
  i.reset();
  if (const json* seed = Field(body, "seed"); seed != nullptr) {
    if (seed->is_number_unsigned()) {
      r.seed = seed->get<uint64_t>();
    } else if (const std::optional<int64_t> s = AsInt(*seed)) {
      if (*s != -1) r.seed = static_cast<uint64_t>(*s);  // -1: random, as llama-server reads it
    } else {
      return Bad("seed", "must be an integer, " + Got(*seed));
    }
  }
  CACHET_RETURN_IF_ERROR(GetInt(body, "n", 1, limits.max_n, &i));
  if (i) r.n = static_cast<int>(*i);
  i.reset();
  CACHET_RETURN_IF_ERROR(ParseStop(body, limits.max_stop, &r.stop));

  if (endpoint == Endpoint::kCompletions) {
    // An integer: the chosen token's logprob and the k most likely.
    CACHET_RETURN_IF_ERROR(GetInt(body, "logprobs", 0, limits.max_logprobs, &i));
    if (i) r.logprobs = static_cast<int>(*i);
    i.reset();
  } else {
    // A boolean, and top_logprobs alternatives (which need logprobs: true).
    bool logprobs = false;
    CACHET_RETURN_IF_ERROR(GetBool(body, "logprobs", &logprobs));
    CACHET_RETURN_IF_ERROR(GetInt(body, "top_logprobs", 0, limits.max_logprobs, &i));
    if (i && !logprobs) return Bad("top_logprobs", "needs \"logprobs\": true");
    if (logprobs) r.logprobs = i ? static_cast<int>(*i) : 0;
    i.reset();
  }

  CACHET_RETURN_IF_ERROR(GetBool(body, "stream", &r.stream));
  if (const json* so = Field(body, "stream_options"); so != nullptr) {
    if (!r.stream) return Bad("stream_options", "only allowed when \"stream\" is true");
    if (!so->is_object()) return Bad("stream_options", "must be an object, " + Got(*so));
    CACHET_RETURN_IF_ERROR(
        Inside("stream_options", GetBool(*so, "include_usage", &r.include_usage)));
  }
  CACHET_RETURN_IF_ERROR(GetBool(body, "ignore_eos", &r.ignore_eos));
  CACHET_RETURN_IF_ERROR(GetBool(body, "skip_special_tokens", &r.skip_special_tokens));

  std::optional<std::string> salt;
  CACHET_RETURN_IF_ERROR(GetString(body, "cache_salt", &salt));
  if (salt) r.cache_salt = std::move(*salt);
  CACHET_RETURN_IF_ERROR(ParsePress(body, &r.press));
  std::optional<std::string> cache_id;
  CACHET_RETURN_IF_ERROR(GetString(body, "cache_id", &cache_id));
  if (cache_id) {
    if (cache_id->empty()) return Bad("cache_id", "empty");
    if (r.press) {
      return Bad("kv_press", "not with cache_id: the cache was compressed when it was made");
    }
    r.cache_id = std::move(*cache_id);
  }
  CACHET_RETURN_IF_ERROR(ParseChunks(body, &r));
  if (const json* rf = Field(body, "response_format"); rf != nullptr) {
    const json* type = rf->is_object() ? Field(*rf, "type") : nullptr;
    const std::string name = type != nullptr && type->is_string() ? type->get<std::string>() : "";
    if (name == "json_object") {
      r.sampling.format = OutputFormat::kJsonObject;
    } else if (name != "text") {
      return Bad("response_format",
                 "only {\"type\": \"text\"} and {\"type\": \"json_object\"} are supported" +
                     (name.empty() ? std::string() : " (not \"" + name + "\")"));
    }
  }
  if (const json* kw = Field(body, "chat_template_kwargs"); kw != nullptr) {
    if (endpoint != Endpoint::kChat)
      return Bad("chat_template_kwargs", "only for chat completions");
    ChatTemplate read;  // the kwargs alone, read into a template of their own
    CACHET_RETURN_IF_ERROR(ApplyChatTemplateKwargs(kw->dump(), &read));
    if (kw->contains("enable_thinking")) r.enable_thinking = read.enable_thinking;
  }
  std::optional<std::string> reasoning;  // llama.cpp server's field
  CACHET_RETURN_IF_ERROR(GetString(body, "reasoning_format", &reasoning));
  if (reasoning) {
    if (endpoint != Endpoint::kChat) return Bad("reasoning_format", "only for chat completions");
    Result<ReasoningFormat> f = ParseReasoningFormat(*reasoning);
    if (!f.ok()) return Bad("reasoning_format", f.status().message());
    r.reasoning_format = f.value();
  }

  CACHET_RETURN_IF_ERROR(RejectUnsupported(body, endpoint, r.n));
  std::optional<std::string> user;  // accepted, unused
  CACHET_RETURN_IF_ERROR(GetString(body, "user", &user));
  return r;
}

Result<ParsedCacheRequest> ParseCacheRequest(std::string_view text, const ParseLimits& limits) {
  CACHET_ASSIGN_OR_RETURN(json body, ParseObject(text));
  // Every field is one this endpoint acts on: a completion's (stream, max_tokens, cache_id,
  // chunks, ...) sent here would otherwise be dropped without a word.
  for (const auto& [key, value] : body.items()) {
    static constexpr std::string_view kFields[] = {"model", "prompt", "messages", "kv_press",
                                                   "cache_salt"};
    if (std::find(std::begin(kFields), std::end(kFields), key) == std::end(kFields)) {
      return Bad(key,
                 "not a field of POST /v1/caches (it takes prompt or messages, kv_press, "
                 "cache_salt and model)");
    }
  }
  std::optional<std::string> model;
  CACHET_RETURN_IF_ERROR(GetString(body, "model", &model));
  if (model && !model->empty() && !limits.model_name.empty() && *model != limits.model_name) {
    return NotFound("model: the model '" + *model + "' does not exist; this server serves '" +
                    limits.model_name + "'");
  }
  const bool has_prompt = Field(body, "prompt") != nullptr;
  const bool has_messages = Field(body, "messages") != nullptr;
  if (has_prompt == has_messages) {
    return Bad(has_prompt ? "messages" : "prompt",
               has_prompt ? "give prompt or messages, not both"
                          : "required: the context as a prompt (text) or as chat messages");
  }
  ParsedRequest r;
  if (has_prompt) {
    CACHET_RETURN_IF_ERROR(ParsePrompt(body, limits.vocab_size, &r));
  } else {
    CACHET_RETURN_IF_ERROR(ParseMessages(body, &r));
  }
  ParsedCacheRequest c;
  c.prompt_text = std::move(r.prompt_text);
  c.prompt_ids = std::move(r.prompt_ids);
  c.messages = std::move(r.messages);
  std::optional<std::string> salt;
  CACHET_RETURN_IF_ERROR(GetString(body, "cache_salt", &salt));
  if (salt) c.cache_salt = std::move(*salt);
  CACHET_RETURN_IF_ERROR(ParsePress(body, &c.press));
  return c;
}

std::string ChatNote(std::span<const ChatMessage> messages) {
  if (messages.empty()) return "";
  json list = json::array();
  for (const ChatMessage& m : messages) {
    list.push_back({{"role", ChatRoleName(m.role)}, {"content", m.content}});
  }
  return json{{"messages", std::move(list)}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<std::vector<ChatMessage>> ParseChatNote(std::string_view note) {
  std::vector<ChatMessage> out;
  if (note.empty()) return out;
  const json j = json::parse(note, nullptr, /*allow_exceptions=*/false);
  const json* ms = j.is_object() ? Field(j, "messages") : nullptr;
  if (ms == nullptr || !ms->is_array()) return InvalidArgument("the cache's note is not a chat");
  for (const json& m : *ms) {
    const json* role = m.is_object() ? Field(m, "role") : nullptr;
    const json* content = m.is_object() ? Field(m, "content") : nullptr;
    if (role == nullptr || !role->is_string() || content == nullptr || !content->is_string()) {
      return InvalidArgument("the cache's note holds a malformed message");
    }
    CACHET_ASSIGN_OR_RETURN(ChatRole r, ParseChatRole(role->get<std::string>()));
    out.push_back({r, content->get<std::string>()});
  }
  return out;
}

Result<TokenizeRequest> ParseTokenizeRequest(std::string_view text) {
  CACHET_ASSIGN_OR_RETURN(json body, ParseObject(text));
  TokenizeRequest r;
  std::optional<std::string> content;
  CACHET_RETURN_IF_ERROR(GetString(body, "content", &content));
  if (!content) return Bad("content", "required (the text to tokenize)");
  r.content = std::move(*content);
  CACHET_RETURN_IF_ERROR(GetBool(body, "add_special", &r.add_special));
  CACHET_RETURN_IF_ERROR(GetBool(body, "parse_special", &r.parse_special));
  CACHET_RETURN_IF_ERROR(GetBool(body, "with_pieces", &r.with_pieces));
  return r;
}

Result<std::vector<int32_t>> ParseDetokenizeRequest(std::string_view text, int32_t vocab_size) {
  CACHET_ASSIGN_OR_RETURN(json body, ParseObject(text));
  const json* t = Field(body, "tokens");
  if (t == nullptr) return Bad("tokens", "required (an array of token ids)");
  if (!t->is_array()) return Bad("tokens", "must be an array of token ids, " + Got(*t));
  std::vector<int32_t> ids;
  CACHET_RETURN_IF_ERROR(GetTokenIds(*t, "tokens", vocab_size, &ids));
  return ids;
}

}  // namespace cachet::server
