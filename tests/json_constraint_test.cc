// JSON mode (runtime/json_constraint.h): the automaton against nlohmann's parser on valid objects
// and on thousands of damaged ones, and the sampler drawing from kvtiny's vocabulary under it.
#include "runtime/json_constraint.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "cachet/tokenizer.h"
#include "runtime/sampler.h"
#include "test_util.h"

namespace cachet {
namespace {

using json = nlohmann::json;

bool Whole(std::string_view text) {
  JsonObjectPrefix p;
  return p.Feed(text) && p.complete();
}

// Every prefix continues, and only the whole text is complete.
void ExpectEveryPrefix(const std::string& text) {
  JsonObjectPrefix p;
  for (size_t i = 0; i < text.size(); ++i) {
    ASSERT_FALSE(p.complete()) << text << " complete at " << i;
    ASSERT_TRUE(p.Feed(text.substr(i, 1)))
        << text << " refused at " << i << ": '" << text[i] << "'";
  }
  EXPECT_TRUE(p.complete()) << text;
}

// Random JSON of every kind, nested up to depth, strings with escapes and UTF-8.
json RandomValue(std::mt19937& rng, int depth) {
  const int kind = std::uniform_int_distribution<int>(0, depth > 0 ? 7 : 5)(rng);
  static const char* kStrings[] = {
      "",       "a",       "héllo wörld", "tab\there", "q\"uote\\",
      "日本語", "😀 emoji", "ctl\x01",     "/slash",    "\xf4\x8f\xbf\xbf"};
  switch (kind) {
    case 0:
      return nullptr;
    case 1:
      return std::uniform_int_distribution<int>(0, 1)(rng) == 1;
    case 2:
      return std::uniform_int_distribution<int64_t>(-1'000'000, 1'000'000)(rng);
    case 3:
      return std::uniform_real_distribution<double>(-1e6, 1e6)(rng) *
             std::pow(10.0, std::uniform_int_distribution<int>(-30, 30)(rng));
    case 4:
    case 5:
      return kStrings[std::uniform_int_distribution<int>(0, 9)(rng)];
    case 6: {
      json a = json::array();
      for (int n = std::uniform_int_distribution<int>(0, 4)(rng); n > 0; --n) {
        a.push_back(RandomValue(rng, depth - 1));
      }
      return a;
    }
    default: {
      json o = json::object();
      for (int n = std::uniform_int_distribution<int>(0, 4)(rng); n > 0; --n) {
        o[kStrings[std::uniform_int_distribution<int>(0, 9)(rng)]] = RandomValue(rng, depth - 1);
      }
      return o;
    }
  }
}

TEST(JsonConstraint, AcceptsEveryPrefixOfValidObjects) {
  for (const char* text :
       {"{}", R"({"a":1})", R"({"a": [1, -2.5e+3, 0, 0.25, 1E9, true, false, null]})",
        "{\n  \"k\": {\"n\": [[], {}, \"\\u00e9\\ud83d\\ude00\\n\"]}\n}", R"({"":""})",
        R"({"x": -0.0e-0})"}) {
    ExpectEveryPrefix(text);
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    json o = json::object();
    o["k"] = RandomValue(rng, 4);
    ExpectEveryPrefix(o.dump());
    ExpectEveryPrefix(o.dump(2));  // pretty-printed: newlines and indentation
  }
}

TEST(JsonConstraint, RefusesWhatNoObjectStartsWith) {
  for (const char* bad : {" {}",
                          "[]",
                          "\"a\"",
                          "1",
                          "{,}",
                          "{\"a\" 1}",
                          "{\"a\":}",
                          "{\"a\":1,}",
                          "{\"a\":01}",
                          "{\"a\":1.}",
                          "{\"a\":.5}",
                          "{\"a\":-}",
                          "{\"a\":1e}",
                          "{\"a\":tru}x",
                          "{\"a\":nul1}",
                          "{\"a\":[1,]}",
                          "{\"a\":[1}",
                          "{\"a\":{]}",
                          "{\"a\n\":1}",
                          "{\"\\x\":1}",
                          "{\"\\u12g4\"",
                          "{\"\\ud800\":1}",
                          "{\"\\udc00\"",
                          "{\"\xc0\x80\"",
                          "{\"\xed\xa0\x80\"",
                          "{\"\xf5\"",
                          "{\"\x80\"",
                          "{}}",
                          "{} ",
                          "{}x",
                          "{1:2}"}) {
    EXPECT_FALSE(Whole(bad)) << bad;
    EXPECT_FALSE(json::accept(bad) && json::parse(bad).is_object() && bad[0] == '{' && Whole(bad))
        << bad;
  }
  // Prefixes that are still fine, and limits.
  JsonObjectPrefix p;
  EXPECT_TRUE(p.Feed("{\"a\": [1, 2"));
  EXPECT_FALSE(p.complete());
  JsonObjectPrefix deep;
  std::string open = "{\"a\":";
  open.append(JsonObjectPrefix::kMaxDepth - 1, '[');
  EXPECT_TRUE(deep.Feed(open));
  EXPECT_FALSE(deep.Feed("["));
  JsonObjectPrefix spaces;
  std::string blank = "{";
  blank.append(JsonObjectPrefix::kMaxSpace, ' ');
  EXPECT_TRUE(spaces.Feed(blank));
  EXPECT_FALSE(spaces.Feed(" "));
  JsonObjectPrefix lines;
  EXPECT_TRUE(lines.Feed("{\n  \"a\": 1,\r\n\t\"b\":"));
  EXPECT_FALSE(lines.Feed(" \n\n"));  // a blank line
}

// Damaged objects (bytes changed, dropped, doubled): the automaton takes the whole text as one
// object exactly when nlohmann's strict parser does (within the depth and white-space limits).
TEST(JsonConstraint, AgreesWithAStrictParserOnDamagedObjects) {
  std::mt19937 rng(11);
  const std::string alphabet = "{}[]\":,.-+0123456789eEtrufalsn \n\\u\x01\x80\xc3\xa9\xf0";
  int agreed_valid = 0;
  for (int i = 0; i < 4000; ++i) {
    json o = json::object();
    o["k"] = RandomValue(rng, 3);
    std::string text = o.dump();
    for (int edits = std::uniform_int_distribution<int>(1, 3)(rng); edits > 0; --edits) {
      const size_t at = std::uniform_int_distribution<size_t>(0, text.size() - 1)(rng);
      const char c = alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(rng)];
      switch (std::uniform_int_distribution<int>(0, 2)(rng)) {
        case 0:
          text[at] = c;
          break;
        case 1:
          text.erase(at, 1);
          break;
        default:
          text.insert(at, 1, c);
      }
    }
    if (text.empty() || std::regex_search(text, std::regex("\n[ \t\r]*\n"))) {
      continue;  // a blank line: past the white-space limit
    }
    bool strict = false;
    try {
      strict = json::parse(text).is_object() && text[0] == '{' && text.back() == '}';
    } catch (const json::parse_error&) {
    } catch (const json::out_of_range&) {
      continue;  // a number past a double's range: valid JSON, which this parser refuses
    }
    EXPECT_EQ(Whole(text), strict) << json(text).dump();  // dump: escaped for the message
    agreed_valid += strict;
  }
  EXPECT_GT(agreed_valid, 100);  // the damage leaves some valid objects to agree on
}

// The sampler under JSON mode, on kvtiny's vocabulary: whatever the logits (random, or pushed
// towards letters that cannot come), every draw keeps the text a prefix of an object, EOS comes
// only after the object closed, and then the text parses.
TEST(JsonConstraint, SamplerKeepsTheTextAnObject) {
  auto tok = Tokenizer::Load(testing::ModelDir());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const Tokenizer& t = *tok.value();
  const std::vector<int32_t> letters = t.Encode("xyz", false);
  std::mt19937 rng(3);
  int finished = 0;
  for (int run = 0; run < 40; ++run) {
    SamplingParams p;
    p.temperature = run % 4 == 0 ? 0.0f : 1.5f;
    p.seed = run;
    p.format = OutputFormat::kJsonObject;
    Sampler s(p, t.vocab_size(), &t);
    std::vector<float> logits(t.vocab_size());
    std::normal_distribution<float> noise(0.0f, 3.0f);
    std::string text;
    JsonObjectPrefix check;
    for (int step = 0; step < 300; ++step) {
      for (float& l : logits) l = noise(rng);
      for (int32_t id : letters) logits[id] += 20.0f;  // tokens the object cannot take, mostly
      // The closing brace often enough for objects to finish.
      for (int32_t id : t.Encode("}", false)) logits[id] += 4.0f;
      const int32_t next = s.Sample(logits, {});
      if (next == t.eos_id()) {
        ASSERT_TRUE(check.complete()) << text;
        ASSERT_TRUE(s.complete());
        EXPECT_TRUE(json::accept(text) && json::parse(text).is_object()) << text;
        ++finished;
        break;
      }
      ASSERT_FALSE(t.IsSpecial(next)) << next;
      const std::string bytes = t.TokenBytes(next);
      ASSERT_TRUE(check.Feed(bytes)) << text << " + '" << bytes << "'";
      text += bytes;
    }
  }
  EXPECT_GT(finished, 10);
}

}  // namespace
}  // namespace cachet
