// libFuzzer target for the server's request parsers (src/server/request.h): the input is a request
// body as a client would send it, parsed for both endpoints, /v1/caches, /tokenize and /detokenize.
// Checks, besides ASan/UBSan: what parses satisfies the limits it was parsed under (n, logprobs,
// stop strings, token ids), and every error becomes valid OpenAI-style error JSON naming a field
// only when the message starts with one; the response writers take the input as generated text
// (any bytes, invalid UTF-8 included) and still write valid JSON, and split its thinking
// (server/reasoning.h) the same however a stream cuts it; and what JSON mode's automaton
// (runtime/json_constraint.h) takes as a whole object, nlohmann's strict parser takes too. A
// violation aborts.
// Build and run: scripts/fuzz.sh [seconds] server_request.
//
// With CACHET_FUZZ_SEED_DIR set, LLVMFuzzerInitialize first writes seed inputs there.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/json_constraint.h"
#include "server/reasoning.h"
#include "server/request.h"
#include "server/response.h"

namespace {

using cachet::server::ApiError;
using cachet::server::Endpoint;
using json = nlohmann::json;

void WriteSeeds(const std::string& dir) {
  const std::string seeds[] = {
      R"({"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stop": ["\n"]})",
      R"({"prompt": [1, 2, 3], "n": 2, "logprobs": 3, "stream": true,
          "stream_options": {"include_usage": true}, "seed": -7})",
      R"({"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
          "max_completion_tokens": 4, "logprobs": true, "top_logprobs": 2,
          "kv_press": {"name": "snapkv+ada", "ratio": 0.5}, "cache_salt": "a"})",
      R"({"content": "a b c", "add_special": true, "with_pieces": true, "tokens": [5, 6]})",
      R"({"prompt": "doc", "cache_id": "kvc-0", "cache_salt": "t"})",
      R"({"prompt": [[1, 2]], "top_p": 0.5, "top_k": -1, "min_p": 0.1, "ignore_eos": true,
          "kv_press": {"name": "knorm+demote:rot3+qjl", "budget": 4}})",
      // As generated replies (the reasoning split): thinking closed, unclosed, opened mid-tag.
      " <think>Let me see.</think>\n\nParis.",
      "Hmm, so </think> yes </thi",
      "<thi<think>nk></think>",
      R"({"a": [1, -2.5e3, true, null, {"b": "\u00e9\ud83d\ude00"}], "c": {}})",
  };
  int i = 0;
  for (const std::string& s : seeds) {
    std::ofstream(dir + "/seed-" + std::to_string(i++), std::ios::binary) << s;
  }
}

[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "server_request_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

std::string FakeTokenText(int32_t id) { return "<" + std::to_string(id) + ">"; }

// An error as a client sees it: valid JSON with the four fields; a param only where the message
// starts with it.
void CheckError(const cachet::Status& s) {
  const ApiError e = cachet::server::ApiErrorFromStatus(s);
  if (e.http_status < 400 || e.http_status > 599) Fail("not an error status", e.message);
  const json j = json::parse(cachet::server::ErrorJson(e), nullptr, false);
  if (j.is_discarded() || !j.contains("error")) Fail("error JSON does not parse", e.message);
  for (const char* key : {"message", "type", "param", "code"}) {
    if (!j["error"].contains(key)) Fail("error JSON lacks a field", key);
  }
  if (!e.param.empty() && !e.message.starts_with(e.param + ": ")) {
    Fail("param is not where the message starts", e.param + " / " + e.message);
  }
}

constexpr int32_t kVocab = 1000;

// The text as a reply split whole and in pieces of 1..8 bytes cut where its own bytes say: the
// same; a reply with no <think> part is all content; an opened one with no </think> all reasoning.
void CheckReasoningSplit(std::string_view text, bool opened) {
  using cachet::server::ReasoningSplit;
  ReasoningSplit whole(opened), cut(opened);
  ReasoningSplit::Piece a = whole.Feed(text), a_end = whole.Finish();
  std::string reasoning = a.reasoning + a_end.reasoning, content = a.content + a_end.content;
  std::string r2, c2;
  for (size_t at = 0; at < text.size();) {
    const size_t n = std::min<size_t>(text.size() - at, 1 + static_cast<uint8_t>(text[at]) % 8);
    ReasoningSplit::Piece p = cut.Feed(text.substr(at, n));
    r2 += p.reasoning;
    c2 += p.content;
    at += n;
  }
  ReasoningSplit::Piece end = cut.Finish();
  r2 += end.reasoning;
  c2 += end.content;
  if (r2 != reasoning || c2 != content || cut.reasoned() != whole.reasoned()) {
    Fail("the reasoning split depends on how the stream is cut", std::string(text));
  }
  if (!whole.reasoned() && content != text) Fail("a reply without thinking changed", "");
  if (opened && text.find("</think>") == text.npos && reasoning != text) {
    Fail("an unclosed thinking is not all reasoning", std::string(text));
  }
}

void CheckParsed(const cachet::server::ParsedRequest& r, const cachet::server::ParseLimits& l) {
  if (r.n < 1 || r.n > l.max_n) Fail("n out of range", std::to_string(r.n));
  if (r.logprobs < -1 || r.logprobs > l.max_logprobs) Fail("logprobs out of range", "");
  if (static_cast<int>(r.stop.size()) > l.max_stop) Fail("too many stop strings", "");
  for (const std::string& s : r.stop) {
    if (s.empty()) Fail("an empty stop string", "");
  }
  if (r.max_tokens && *r.max_tokens < 1) Fail("max_tokens < 1", "");
  if (r.endpoint == Endpoint::kCompletions) {
    if (r.prompt_text.has_value() == !r.prompt_ids.empty()) Fail("not exactly one prompt", "");
    if (r.prompt_text && r.prompt_text->empty()) Fail("an empty prompt", "");
    for (int32_t id : r.prompt_ids) {
      if (id < 0 || id >= kVocab) Fail("a token id outside the vocabulary", std::to_string(id));
    }
  } else if (r.messages.empty()) {
    Fail("a chat without messages", "");
  }
  if (!(r.sampling.temperature >= 0 && r.sampling.temperature <= 2)) Fail("temperature", "");
  if (!(r.sampling.top_p > 0 && r.sampling.top_p <= 1)) Fail("top_p", "");
  if (r.sampling.top_k < 0) Fail("top_k", "");
  if (r.press && !(r.press->ratio >= 0 && r.press->ratio < 1)) Fail("kv_press.ratio", "");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("CACHET_FUZZ_SEED_DIR")) WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cachet::server;
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  ParseLimits limits;
  limits.model_name = "m";
  limits.vocab_size = kVocab;
  for (Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChat}) {
    cachet::Result<ParsedRequest> r = ParseRequest(body, endpoint, limits);
    if (r.ok()) {
      if (r->endpoint != endpoint) Fail("wrong endpoint", "");
      CheckParsed(r.value(), limits);
    } else {
      CheckError(r.status());
    }
  }
  if (cachet::Result<TokenizeRequest> t = ParseTokenizeRequest(body); !t.ok()) {
    CheckError(t.status());
  }
  // POST /v1/caches: exactly one form of the context when it parses.
  if (cachet::Result<ParsedCacheRequest> c = ParseCacheRequest(body, limits); c.ok()) {
    const int forms =
        (c->prompt_text ? 1 : 0) + (c->prompt_ids.empty() ? 0 : 1) + (c->messages.empty() ? 0 : 1);
    if (forms != 1) Fail("cache request: not exactly one context", std::string(body));
  } else {
    CheckError(c.status());
  }
  if (cachet::Result<std::vector<int32_t>> d = ParseDetokenizeRequest(body, kVocab); d.ok()) {
    for (int32_t id : d.value()) {
      if (id < 0 || id >= kVocab) Fail("detokenize: id outside the vocabulary", "");
    }
  } else {
    CheckError(d.status());
  }

  CheckReasoningSplit(body, size % 3 == 0);
  // JSON mode: what the automaton takes whole as an object, a strict parser takes too.
  if (cachet::JsonObjectPrefix p; p.Feed(body) && p.complete()) {
    try {
      if (!json::parse(body).is_object()) Fail("JSON mode passed a non-object", std::string(body));
    } catch (const json::out_of_range&) {  // a number past a double: valid JSON all the same
    } catch (const json::parse_error& e) {
      Fail("JSON mode passed what a strict parser refuses", std::string(body) + "\n" + e.what());
    }
  }

  // The input as generated text: the writers must still produce valid JSON.
  ResponseMeta meta;
  meta.endpoint = size % 2 ? Endpoint::kChat : Endpoint::kCompletions;
  meta.id = "x";
  meta.model = std::string(body.substr(0, 16));
  meta.logprobs = true;
  std::vector<cachet::TokenLogprob> lps;
  for (size_t i = 0; i < std::min<size_t>(size, 4); ++i) {
    lps.push_back({static_cast<int32_t>(data[i]), -static_cast<float>(data[i]) / 8, {{1, -1.0f}}});
  }
  ChunkContent c;
  c.text = body;
  c.logprobs = lps;
  const std::string chunk = StreamChunk(meta, c, FakeTokenText, true);
  if (json::parse(chunk, nullptr, false).is_discarded()) Fail("a chunk does not parse", chunk);
  std::vector<ChoiceOutput> choices = {{std::string(body), lps, "stop"}};
  const std::string full = CompletionResponse(meta, choices, cachet::Usage{}, FakeTokenText);
  if (json::parse(full, nullptr, false).is_discarded()) Fail("a response does not parse", full);
  return 0;
}
