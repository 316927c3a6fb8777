#include "cachet/eval/tasks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <unordered_set>

#include "cachet/tokenizer.h"

namespace cachet::eval {

uint64_t UniformInt(std::mt19937_64& rng, uint64_t lo, uint64_t hi) {
  const uint64_t span = hi - lo;  // hi - lo + 1 may overflow: handle the full range apart
  if (span == ~uint64_t{0}) return rng();
  const uint64_t n = span + 1;
  const uint64_t limit = ~uint64_t{0} - (~uint64_t{0} % n);  // largest multiple of n, exclusive
  uint64_t x;
  do x = rng();
  while (x >= limit);
  return lo + x % n;
}

uint64_t MixSeed(uint64_t a, uint64_t b) {
  uint64_t z = a + 0x9e3779b97f4a7c15ull * (b + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t Fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

namespace {

// One row per TaskKind, in its order (the static_assert below keeps them in step).
struct TaskEntry {
  TaskKind kind;
  const char* name;
};
constexpr TaskEntry kTaskTable[] = {
    {TaskKind::kPasskey, "passkey"},
    {TaskKind::kNiah, "niah"},
    {TaskKind::kKv, "kv"},
    {TaskKind::kVt, "vt"},
    {TaskKind::kMultiq, "multiq"},
    {TaskKind::kMultiturn, "multiturn"},
    {TaskKind::kMultidoc, "multidoc"},
};
static_assert(std::size(kTaskTable) == kTaskKinds);
constexpr bool TableInOrder() {
  for (size_t i = 0; i < std::size(kTaskTable); ++i) {
    if (static_cast<size_t>(kTaskTable[i].kind) != i) return false;
  }
  return true;
}
static_assert(TableInOrder());

}  // namespace

Result<TaskKind> ParseTaskKind(std::string_view name) {
  std::string names;
  for (const TaskEntry& t : kTaskTable) {
    if (name == t.name) return t.kind;
    names += std::string(names.empty() ? "" : ", ") + t.name;
  }
  return InvalidArgument("unknown task '" + std::string(name) + "' (tasks: " + names + ")");
}

const char* TaskName(TaskKind kind) { return kTaskTable[static_cast<size_t>(kind)].name; }

bool AsksSeveral(TaskKind kind) {
  return kind == TaskKind::kMultiq || kind == TaskKind::kMultiturn;
}

namespace {

constexpr const char* kSourceNames[Haystack::kSources] = {"bible", "pydocs", "fortunes"};
// Training drew haystacks from this list (bible and pydocs twice as often as fortunes).
constexpr int kSourcePick[5] = {0, 1, 2, 0, 1};
constexpr std::string_view kBlank = "\n\n";

Result<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot open (haystack corpus slice)");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// Python's `[p.strip("\n") for p in text.split("\n\n") if p.strip()]`, as training did.
std::vector<std::string> SplitParagraphs(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(kBlank, start);
    if (end == std::string::npos) end = text.size();
    std::string_view p(text.data() + start, end - start);
    if (std::any_of(p.begin(), p.end(), [](char c) { return !IsSpace(c); })) {
      while (!p.empty() && p.front() == '\n') p.remove_prefix(1);
      while (!p.empty() && p.back() == '\n') p.remove_suffix(1);
      out.emplace_back(p);
    }
    start = end + kBlank.size();
  }
  return out;
}

// Drops a UTF-8 character cut off at the end of s (a paragraph cut at a token boundary).
void TrimPartialUtf8(std::string* s) {
  const size_t n = s->size();
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    const auto c = static_cast<unsigned char>((*s)[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    const size_t need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
    if (need > back) s->resize(n - back);
    return;
  }
}

std::string Digits(std::mt19937_64& rng, int n) {
  uint64_t lo = 1;
  for (int i = 1; i < n; ++i) lo *= 10;
  return std::to_string(UniformInt(rng, lo, lo * 10 - 1));
}

std::string Hex8(std::mt19937_64& rng) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08llx",
                static_cast<unsigned long long>(UniformInt(rng, 0, 0xffffffffull)));
  return buf;
}

std::string Var5(std::mt19937_64& rng) {
  std::string v(5, 'A');
  for (char& c : v) c = static_cast<char>('A' + UniformInt(rng, 0, 25));
  return v;
}

}  // namespace

Result<Haystack> Haystack::Load(const std::string& dir) {
  Haystack h;
  for (int s = 0; s < kSources; ++s) {
    CACHET_ASSIGN_OR_RETURN(std::string text, ReadText(dir + "/" + kSourceNames[s] + ".txt"));
    h.paras_[s] = SplitParagraphs(text);
    if (h.paras_[s].size() < 2)
      return DataLoss(dir + "/" + kSourceNames[s] + ".txt: no paragraphs");
  }
  CACHET_ASSIGN_OR_RETURN(std::string words, ReadText(dir + "/words.txt"));
  std::istringstream ws(words);
  for (std::string w; ws >> w;) h.words_.push_back(std::move(w));
  if (h.words_.size() < 2) return DataLoss(dir + "/words.txt: no words");
  return h;
}

std::string DefaultHaystackDir() {
  if (const char* env = std::getenv("CACHET_HAYSTACK_DIR"); env && *env) return env;
  // CACHET_DEFAULT_MODEL_DIR is <source>/models/kvtiny.
  return (std::filesystem::path(CACHET_DEFAULT_MODEL_DIR).parent_path().parent_path() / "data" /
          "haystack")
      .string();
}

struct TaskGenerator::Needles {
  std::vector<std::string> texts;
  std::vector<std::string> questions, answers;  // asked in this order
  int answer_index = 0;  // the needle whose depth the sample reports (the first question's)
};

TaskGenerator::TaskGenerator(const Tokenizer& tok, Haystack haystack)
    : tok_(tok), hay_(std::move(haystack)) {
  for (int s = 0; s < Haystack::kSources; ++s) {
    para_tokens_[s].assign(hay_.paragraphs(s).size(), -1);
  }
}

int TaskGenerator::Tokens(std::string_view text) const {
  return static_cast<int>(tok_.Encode(text).size());
}

int TaskGenerator::ParagraphTokens(int source, size_t index) {
  int& n = para_tokens_[source][index];
  if (n < 0) n = Tokens(hay_.paragraphs(source)[index] + std::string(kBlank));
  return n;
}

TaskGenerator::Needles TaskGenerator::MakeNeedles(const TaskSpec& spec,
                                                  std::mt19937_64& rng) const {
  Needles n;
  switch (spec.kind) {
    case TaskKind::kPasskey: {
      const std::string p = Digits(rng, 5);
      n.texts.push_back("The pass key is " + p + ". Remember it. " + p + " is the pass key.\n\n");
      n.questions = {"What is the pass key?"};
      n.answers = {p};
      break;
    }
    case TaskKind::kNiah:
    case TaskKind::kMultidoc:
    case TaskKind::kMultiq:
    case TaskKind::kMultiturn: {
      const auto& words = hay_.words();
      std::vector<std::string> keys, values;
      while (static_cast<int>(keys.size()) < spec.needles) {
        std::string key = words[UniformInt(rng, 0, words.size() - 1)] + "-" +
                          words[UniformInt(rng, 0, words.size() - 1)];
        if (std::find(keys.begin(), keys.end(), key) != keys.end()) continue;  // keys must differ
        values.push_back(Digits(rng, 7));
        n.texts.push_back("The special magic number for " + key + " is " + values.back() + ".\n\n");
        keys.push_back(std::move(key));
      }
      std::vector<std::string> asks;
      for (const std::string& key : keys) {
        asks.push_back("What is the special magic number for " + key + "?");
      }
      if (AsksSeveral(spec.kind)) {
        // The first needle is a pass key: a model that tells one magic number from another
        // poorly (kvtiny: niah2 0.40) still has two questions it answers as well as alone.
        const std::string p = Digits(rng, 5);
        n.texts[0] = "The pass key is " + p + ". Remember it. " + p + " is the pass key.\n\n";
        asks[0] = "What is the pass key?";
        values[0] = p;
      }
      // niah asks for one needle; the multi-question tasks for every needle, in a random order.
      std::vector<int> order;
      if (AsksSeveral(spec.kind)) {
        for (int i = 0; i < spec.needles; ++i) order.push_back(i);
        for (int i = spec.needles - 1; i > 0; --i) {
          std::swap(order[i], order[UniformInt(rng, 0, static_cast<uint64_t>(i))]);
        }
      } else {
        order.push_back(static_cast<int>(UniformInt(rng, 0, keys.size() - 1)));
      }
      n.answer_index = order[0];
      for (int i : order) {
        n.questions.push_back(asks[i]);
        n.answers.push_back(values[i]);
      }
      break;
    }
    case TaskKind::kVt: {
      const std::string value = Digits(rng, 5);
      const int chain_len = static_cast<int>(2 + UniformInt(rng, 0, 2));
      std::vector<std::string> vars;
      while (static_cast<int>(vars.size()) < chain_len + 1) {  // the last is the distractor
        std::string v = Var5(rng);
        if (std::find(vars.begin(), vars.end(), v) == vars.end()) vars.push_back(std::move(v));
      }
      std::string other = Digits(rng, 5);
      while (other == value) other = Digits(rng, 5);
      n.texts.push_back("VAR " + vars[0] + " = " + value + ".\n\n");
      for (int i = 1; i < chain_len; ++i) {
        n.texts.push_back("VAR " + vars[i] + " = VAR " + vars[i - 1] + ".\n\n");
      }
      const auto at = static_cast<int>(UniformInt(rng, 0, chain_len));
      n.texts.insert(n.texts.begin() + at, "VAR " + vars[chain_len] + " = " + other + ".\n\n");
      n.answer_index = at == 0 ? 1 : 0;
      n.questions = {"Which variables are assigned the value " + value + "?"};
      n.answers = {""};
      for (int i = 0; i < chain_len; ++i) n.answers[0] += (i ? " " : "") + vars[i];
      break;
    }
    case TaskKind::kKv:
      break;  // BuildKvContext
  }
  return n;
}

void TaskGenerator::BuildKvContext(const TaskSpec& spec, std::mt19937_64& rng, int adjust,
                                   TaskSample* s) {
  const std::string head = "Below is a table of keys and their values.\n\n";
  // The question's length depends on its key; a typical key stands in until the retry loop in
  // Generate corrects the estimate.
  const int room = spec.length + adjust - 1 - Tokens(head) - Tokens(kBlank) -
                   Tokens("Question: What is the value of 3f2a9c0e?\nAnswer:");
  std::vector<std::string> keys, values;
  std::vector<int> line_start;  // token offset of each line in the table
  std::unordered_set<std::string> seen;
  int used = 0;
  // Lines run about 10-20 tokens depending on their digits and letters: when the next one does
  // not fit, draw more candidates and keep one that does; once none fits, end with the shortest
  // candidate if overshooting with it is closer to the room than stopping.
  std::string over_k, over_v;
  int over_t = INT32_MAX;
  auto add = [&](std::string k, std::string v, int t) {
    line_start.push_back(used);
    used += t;
    keys.push_back(std::move(k));
    values.push_back(std::move(v));
  };
  for (int misses = 0; (used < room || keys.empty()) && misses < 64;) {  // one line at least
    std::string k = Hex8(rng);
    if (!seen.insert(k).second) continue;
    std::string v = Hex8(rng);
    const int t = Tokens(k + " => " + v + "\n");
    if (used + t <= room || keys.empty()) {
      add(std::move(k), std::move(v), t);
      misses = 0, over_t = INT32_MAX;
    } else {
      ++misses;
      if (t < over_t) over_k = std::move(k), over_v = std::move(v), over_t = t;
    }
  }
  if (over_t != INT32_MAX && used + over_t - room < room - used) {
    add(std::move(over_k), std::move(over_v), over_t);
  }
  size_t ask;
  if (spec.depth < 0) {
    ask = UniformInt(rng, 0, keys.size() - 1);
  } else {
    ask = 0;  // the line that starts nearest the requested depth
    for (size_t i = 1; i < keys.size(); ++i) {
      if (std::abs(line_start[i] - spec.depth * used) <
          std::abs(line_start[ask] - spec.depth * used)) {
        ask = i;
      }
    }
  }
  s->context = head;
  for (size_t i = 0; i < keys.size(); ++i) s->context += keys[i] + " => " + values[i] + "\n";
  s->context += kBlank;
  s->question = "Question: What is the value of " + keys[ask] + "?\nAnswer:";
  s->answer = values[ask];
  const int head_tokens = Tokens(head);
  s->depth = double(head_tokens + line_start[ask]) / double(head_tokens + used + 2);
}

TaskSample TaskGenerator::Build(const TaskSpec& spec, std::mt19937_64 rng, int adjust) {
  TaskSample s;
  if (spec.kind == TaskKind::kKv) {
    BuildKvContext(spec, rng, adjust, &s);
  } else {
    // Draw order: needles, haystack, then needle places, so that a fixed depth changes only
    // where the same needles go in the same haystack.
    Needles nd = MakeNeedles(spec, rng);
    for (const std::string& q : nd.questions) s.questions.push_back("Question: " + q + "\nAnswer:");
    s.answers = nd.answers;
    s.question = s.questions[0];
    s.answer = s.answers[0];
    std::vector<int> needle_tokens;
    int budget = spec.length + adjust - 1 - Tokens(s.question);
    for (const auto& t : nd.texts) {
      needle_tokens.push_back(Tokens(t));
      budget -= needle_tokens.back();
    }
    budget = std::max(budget, 8);

    // Consecutive paragraphs from a random start; the last one cut to fit, closed by "\n\n".
    const int source = kSourcePick[UniformInt(rng, 0, 4)];
    const auto& paras = hay_.paragraphs(source);
    size_t i = UniformInt(rng, 0, paras.size() - 2);
    const int blank_tokens = Tokens(kBlank);
    std::vector<std::string> hay;
    std::vector<int> hay_tokens;
    int total = 0;
    while (total < budget - blank_tokens - 2) {
      if (i >= paras.size()) i = 0;
      int n = ParagraphTokens(source, i);
      std::string text = paras[i] + std::string(kBlank);
      ++i;
      const int room = budget - total;
      if (n > room) {
        std::vector<int32_t> ids = tok_.Encode(text);
        ids.resize(room - blank_tokens);
        text = tok_.Decode(ids);
        TrimPartialUtf8(&text);
        text += kBlank;
        n = room;
      }
      hay.push_back(std::move(text));
      hay_tokens.push_back(n);
      total += n;
    }

    // Needles go between paragraphs, in order: at random boundaries, or all at the boundary
    // nearest the requested depth.
    const size_t bounds = hay.size();  // boundary b sits before paragraph b (b = size: the end)
    std::vector<size_t> slots(nd.texts.size());
    if (spec.depth < 0) {
      for (size_t& b : slots) b = UniformInt(rng, 0, bounds);
      std::sort(slots.begin(), slots.end());
    } else {
      size_t best = 0;
      int before = 0, best_err = INT32_MAX;
      for (size_t b = 0; b <= bounds; ++b) {
        const int err = static_cast<int>(std::lround(std::abs(before - spec.depth * total)));
        if (err < best_err) best = b, best_err = err;
        if (b < bounds) before += hay_tokens[b];
      }
      std::fill(slots.begin(), slots.end(), best);
    }
    size_t k = 0;
    int pos = 0, answer_pos = 0;
    std::vector<Piece> pieces;
    for (size_t b = 0; b <= bounds; ++b) {
      for (; k < slots.size() && slots[k] == b; ++k) {
        if (static_cast<int>(k) == nd.answer_index) answer_pos = pos;
        pieces.push_back({nd.texts[k], needle_tokens[k], static_cast<int>(k) == nd.answer_index});
        pos += needle_tokens[k];
      }
      if (b < bounds) {
        pieces.push_back({hay[b], hay_tokens[b], false});
        pos += hay_tokens[b];
      }
    }
    for (const Piece& p : pieces) s.context += p.text;
    s.depth = pos > 0 ? double(answer_pos) / pos : 0.0;
    s.needles = std::move(nd.texts);
    if (spec.kind == TaskKind::kMultidoc) {
      SplitDocuments(spec, pieces, rng, &s);
      return s;
    }
  }
  s.prompt = s.context + s.question;
  s.ids = tok_.EncodePrompt(s.prompt);
  // The question must start on a token boundary so compress_at=context can prefill the context
  // alone; the context always ends with "\n\n", where the tokenizer splits anyway.
  std::vector<int32_t> ctx = tok_.EncodePrompt(s.context);
  if (ctx.size() > s.ids.size() || !std::equal(ctx.begin(), ctx.end(), s.ids.begin())) {
    std::vector<int32_t> q = tok_.Encode(s.question);
    s.ids = ctx;
    s.ids.insert(s.ids.end(), q.begin(), q.end());
  }
  s.context_tokens = static_cast<int>(ctx.size());
  if (s.questions.empty()) {  // kv: one question
    s.questions = {s.question};
    s.answers = {s.answer};
  }
  s.question_ids = {std::vector<int32_t>(s.ids.begin() + s.context_tokens, s.ids.end())};
  for (size_t q = 1; q < s.questions.size(); ++q)
    s.question_ids.push_back(tok_.Encode(s.questions[q]));
  return s;
}

void TaskGenerator::SplitDocuments(const TaskSpec& spec, const std::vector<Piece>& pieces,
                                   std::mt19937_64& rng, TaskSample* s) const {
  // Consecutive pieces into spec.docs documents of about equal tokens, in a random order.
  int total = 0;
  for (const Piece& p : pieces) total += p.tokens;
  const int docs = std::clamp(spec.docs, 1, static_cast<int>(pieces.size()));
  std::vector<std::string> text(1);
  std::vector<char> holds(1, 0);
  int used = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int left = static_cast<int>(pieces.size() - i);  // each document needs a piece
    if (!text.back().empty() &&
        (used >= int64_t(total) * int(text.size()) / docs || left < docs - int(text.size()) + 1) &&
        static_cast<int>(text.size()) < docs) {
      text.emplace_back();
      holds.push_back(0);
    }
    text.back() += pieces[i].text;
    holds.back() |= pieces[i].answer;
    used += pieces[i].tokens;
  }
  std::vector<int> order(text.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  for (int i = static_cast<int>(order.size()) - 1; i > 0; --i) {
    std::swap(order[i], order[UniformInt(rng, 0, static_cast<uint64_t>(i))]);
  }
  s->context.clear();
  s->ids.clear();
  if (tok_.add_bos() && tok_.bos_id() >= 0) s->ids.push_back(tok_.bos_id());
  for (int d : order) {
    if (holds[d]) s->depth = double(s->ids.size()) / std::max(1, total);
    s->docs.push_back(text[d]);
    s->doc_ids.push_back(tok_.Encode(text[d]));
    s->context += text[d];
    s->ids.insert(s->ids.end(), s->doc_ids.back().begin(), s->doc_ids.back().end());
  }
  s->context_tokens = static_cast<int>(s->ids.size());
  s->prompt = s->context + s->question;
  const std::vector<int32_t> q = tok_.Encode(s->question);
  s->ids.insert(s->ids.end(), q.begin(), q.end());
  s->question_ids = {q};
}

Result<TaskSample> TaskGenerator::Generate(const TaskSpec& mixed_spec, uint64_t seed, int index) {
  // needles == 0: the mix the model was trained and its baseline measured on, by sample index.
  static constexpr int kTrainingMix[] = {1, 1, 2, 4, 8};
  TaskSpec spec = mixed_spec;
  if (spec.kind == TaskKind::kNiah && spec.needles == 0) spec.needles = kTrainingMix[index % 5];
  if (spec.kind == TaskKind::kNiah && (spec.needles < 1 || spec.needles > 64)) {
    return InvalidArgument("niah needs 1..64 needles (or 0 for the training mix), got " +
                           std::to_string(spec.needles));
  }
  if (AsksSeveral(spec.kind) && (spec.needles < 1 || spec.needles > 64)) {
    return InvalidArgument(std::string(TaskName(spec.kind)) + " needs 1..64 questions, got " +
                           std::to_string(spec.needles));
  }
  if (spec.depth > 1) return InvalidArgument("needle depth must be in [0, 1] or random");
  if (spec.kind == TaskKind::kMultidoc) {
    if (spec.docs < 1 || spec.docs > 256) {
      return InvalidArgument("multidoc needs 1..256 documents, got " + std::to_string(spec.docs));
    }
    if (spec.length / spec.docs < 32) {  // ran as one-token "documents" before
      return InvalidArgument("multidoc: " + std::to_string(spec.docs) + " documents in " +
                             std::to_string(spec.length) +
                             " tokens are fewer than 32 tokens each: give fewer --docs or a "
                             "longer --len");
    }
    spec.needles = 1;
  }
  const int needles = spec.kind == TaskKind::kNiah || AsksSeveral(spec.kind) ? spec.needles : 1;
  uint64_t s = MixSeed(seed, static_cast<uint64_t>(spec.kind));
  s = MixSeed(s, static_cast<uint64_t>(spec.length));
  s = MixSeed(s, static_cast<uint64_t>(needles));
  if (spec.kind == TaskKind::kMultidoc) s = MixSeed(s, static_cast<uint64_t>(spec.docs));
  const std::mt19937_64 rng(MixSeed(s, static_cast<uint64_t>(index)));

  // Paragraphs are tokenized one by one, so the joined prompt can differ by a few tokens:
  // correct the budget by the miss and rebuild from the same draws.
  TaskSample best;
  int best_miss = INT32_MAX, adjust = 0;
  for (int attempt = 0; attempt < 4 && best_miss > spec.length / 200; ++attempt) {
    TaskSample t = Build(spec, rng, adjust);
    const int miss = spec.length - static_cast<int>(t.ids.size());
    if (std::abs(miss) < best_miss) best_miss = std::abs(miss), best = std::move(t);
    adjust += miss;
  }
  if (best_miss > spec.length / 50) {
    return InvalidArgument(std::string(TaskName(spec.kind)) + " at " + std::to_string(spec.length) +
                           " tokens: the prompt cannot be made " +
                           "within 2% of that length (the closest was " +
                           std::to_string(best_miss) + " tokens off)");
  }
  char id[96];
  const std::string name =
      TaskName(spec.kind) + (spec.kind == TaskKind::kNiah || AsksSeveral(spec.kind)
                                 ? std::to_string(needles)
                             : spec.kind == TaskKind::kMultidoc ? std::to_string(spec.docs)
                                                                : std::string());
  if (spec.depth < 0) {
    std::snprintf(id, sizeof id, "%s-%d-s%llu-%d", name.c_str(), spec.length,
                  static_cast<unsigned long long>(seed), index);
  } else {
    std::snprintf(id, sizeof id, "%s-%d-d%.3g-s%llu-%d", name.c_str(), spec.length, spec.depth,
                  static_cast<unsigned long long>(seed), index);
  }
  best.id = id;
  return best;
}

}  // namespace cachet::eval
