// HF tokenizer.json BPE: encoding (added tokens, pre-tokenizer steps, byte-level BPE with its
// merge ranks and a bounded cache of pieces). Loading: bpe_tokenizer.cc.
#include <oniguruma.h>

#include <algorithm>
#include <memory>
#include <mutex>

#include "model/bpe_tokenizer.h"

namespace cachet {

using tokenizer_internal::OnigMutex;
using tokenizer_internal::PairKey;
using tokenizer_internal::PieceSink;
using tokenizer_internal::U;
using tokenizer_internal::Utf8Scan;
using tokenizer_internal::Utf8Step;

namespace {

bool IsAsciiSpace(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

OnigRegion* ThreadRegion() {
  struct Free {
    void operator()(OnigRegion* r) const { onig_region_free(r, 1); }
  };
  thread_local std::unique_ptr<OnigRegion, Free> region(onig_region_new());
  return region.get();
}

}  // namespace

BpeTokenizer::~BpeTokenizer() {
  std::lock_guard<std::mutex> lock(OnigMutex());
  for (Step& s : steps_) {
    if (s.regex) onig_free(static_cast<OnigRegex>(s.regex));
  }
}

std::string BpeTokenizer::TokenBytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return token_bytes_[id];
}

bool BpeTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < special_.size() && special_[id];
}

std::vector<int32_t> BpeTokenizer::Encode(std::string_view text, bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  size_t done = 0;  // text before this is encoded
  if (!added_.empty()) {
    for (size_t i = 0; i < text.size();) {
      const AddedToken* hit = nullptr;
      for (int32_t k : added_first_[static_cast<unsigned char>(text[i])]) {
        const AddedToken& a = added_[k];
        if ((parse_special || !a.special) && text.substr(i).starts_with(a.content)) {
          hit = &a;
          break;
        }
      }
      if (!hit) {
        ++i;
        continue;
      }
      size_t begin = i, end = i + hit->content.size();
      if (hit->lstrip) {
        while (begin > done && IsAsciiSpace(text[begin - 1])) --begin;
      }
      if (hit->rstrip) {
        while (end < text.size() && IsAsciiSpace(text[end])) ++end;
      }
      EncodeSegment(text.substr(done, begin - done), &out);
      out.push_back(hit->id);
      done = i = end;
    }
  }
  EncodeSegment(text.substr(done), &out);
  return out;
}

void BpeTokenizer::EncodeSegment(std::string_view text, std::vector<int32_t>* out) const {
  auto sink = [&](std::string_view piece) { EncodePiece(piece, out); };
  PreTokenize(text, 0, sink);
}

void BpeTokenizer::PreTokenize(std::string_view text, size_t step, PieceSink sink) const {
  if (text.empty()) return;
  if (step == steps_.size()) return sink(text);
  const Step& st = steps_[step];
  auto next = [&](std::string_view piece) { PreTokenize(piece, step + 1, sink); };
  if (!st.byte_level) return SplitStep(st, text, next);
  std::string prefixed;
  if (st.add_prefix_space && text[0] != ' ') {
    prefixed.reserve(text.size() + 1);
    prefixed.append(1, ' ').append(text);
    text = prefixed;
  }
  if (st.regex) return SplitStep(st, text, next);
  next(text);
}

namespace {

struct Span {
  size_t begin, end;
  bool match;
};

// Calls cb(begin, end, is_match) for the matches of `re` in `text` and the gaps between them, in
// order. Oniguruma only sees well-formed UTF-8: each ill-formed subpart becomes its own gap.
template <class F>
void ForEachRegexSpan(OnigRegex re, std::string_view text, const F& cb) {
  const unsigned char* p = U(text);
  const size_t n = text.size();
  OnigRegion* region = ThreadRegion();
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j < n) {
      if (p[j] < 0x80) {
        ++j;
        continue;
      }
      const Utf8Step st = Utf8Scan(p + j, n - j);
      if (!st.valid) break;
      j += st.len;
    }
    // Search [i, j) as a whole string, so that anchors and look-arounds see its real context.
    const unsigned char* start = p + i;
    const unsigned char* end = p + j;
    size_t gap = i;
    for (size_t pos = i; pos < j;) {
      const int r = onig_search(re, start, end, p + pos, end, region, ONIG_OPTION_NONE);
      if (r < 0) break;  // no further match (or a matcher error: the rest is one gap)
      const size_t mb = i + region->beg[0], me = i + region->end[0];
      if (me == mb) {  // an empty match only splits, as in HF; look again one character later
        if (mb > gap) cb(gap, mb, false);
        gap = mb;
        if (mb >= j) break;
        pos = mb + Utf8Scan(p + mb, j - mb).len;
        continue;
      }
      if (mb > gap) cb(gap, mb, false);
      cb(mb, me, true);
      gap = pos = me;
    }
    if (j > gap) cb(gap, j, false);
    if (j < n) {
      const size_t len = Utf8Scan(p + j, n - j).len;
      cb(j, j + len, false);
      j += len;
    }
    i = j;
  }
}

template <class F>
void ForEachLiteralSpan(std::string_view lit, std::string_view text, const F& cb) {
  size_t gap = 0;
  if (!lit.empty()) {
    for (size_t m; (m = text.find(lit, gap)) != std::string_view::npos; gap = m + lit.size()) {
      if (m > gap) cb(gap, m, false);
      cb(m, m + lit.size(), true);
    }
  }
  if (text.size() > gap) cb(gap, text.size(), false);
}

}  // namespace

void BpeTokenizer::SplitStep(const Step& st, std::string_view text, PieceSink emit) const {
  auto for_each = [&](const auto& cb) {
    auto flip = [&](size_t b, size_t e, bool m) { cb(b, e, m != st.invert); };
    if (st.regex) {
      ForEachRegexSpan(static_cast<OnigRegex>(st.regex), text, flip);
    } else {
      ForEachLiteralSpan(st.literal, text, flip);
    }
  };
  auto piece = [&](size_t b, size_t e) { emit(text.substr(b, e - b)); };
  switch (st.behavior) {
    case Behavior::kIsolated:
      return for_each([&](size_t b, size_t e, bool) { piece(b, e); });
    case Behavior::kRemoved:
      return for_each([&](size_t b, size_t e, bool m) {
        if (!m) piece(b, e);
      });
    default:
      break;
  }
  // The merging behaviours fold spans the way HF's SplitDelimiterBehavior does.
  std::vector<Span> spans;
  for_each([&](size_t b, size_t e, bool m) { spans.push_back({b, e, m}); });
  std::vector<Span> out;
  bool prev_match = false;
  if (st.behavior == Behavior::kMergedWithNext) {
    for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
      if (it->match && !prev_match && !out.empty()) {
        out.back().begin = it->begin;
      } else {
        out.push_back(*it);
      }
      prev_match = it->match;
    }
    std::reverse(out.begin(), out.end());
  } else {
    const bool contiguous = st.behavior == Behavior::kContiguous;
    for (const Span& s : spans) {
      const bool merge = contiguous ? s.match == prev_match : s.match && !prev_match;
      if (merge && !out.empty()) {
        out.back().end = s.end;
      } else {
        out.push_back(s);
      }
      prev_match = s.match;
    }
  }
  for (const Span& s : out) piece(s.begin, s.end);
}

void BpeTokenizer::EncodePiece(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.size() == 1 && byte_level_ && byte_ids_[U(piece)[0]] >= 0) {
    out->push_back(byte_ids_[U(piece)[0]]);
    return;
  }
  const bool cacheable = piece.size() <= kMaxCachedPiece;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(piece);
    if (it != cache_.end()) {
      const int32_t* ids = cache_ids_.data() + it->second.offset;
      out->insert(out->end(), ids, ids + it->second.size);
      return;
    }
  }
  const size_t first = out->size();
  Bpe(piece, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() >= kMaxCacheEntries) {  // bounded memory on endless varied input
      cache_.clear();
      cache_ids_.clear();
    }
    const CacheSpan span{static_cast<uint32_t>(cache_ids_.size()),
                         static_cast<uint32_t>(out->size() - first)};
    if (cache_.emplace(piece, span).second) {
      cache_ids_.insert(cache_ids_.end(), out->begin() + first, out->end());
    }
  }
}

void BpeTokenizer::AppendUnknown(std::vector<int32_t>* out) const {
  if (unk_id_ < 0) return;  // like HF without unk_token: the text is dropped
  if (fuse_unk_ && !out->empty() && out->back() == unk_id_) return;
  out->push_back(unk_id_);
}

void BpeTokenizer::Bpe(std::string_view piece, std::vector<int32_t>* out) const {
  if (ignore_merges_) {
    auto it = vocab_.find(piece);
    if (it != vocab_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  // Initial symbols: bytes for byte-level models, else characters (with byte fallback).
  thread_local std::vector<int32_t> ids;
  ids.clear();
  const unsigned char* p = U(piece);
  if (byte_level_) {
    for (unsigned char b : piece) {
      if (byte_ids_[b] >= 0) {
        ids.push_back(byte_ids_[b]);
      } else {
        AppendUnknown(&ids);
      }
    }
  } else {
    for (size_t i = 0; i < piece.size();) {
      const size_t len = Utf8Scan(p + i, piece.size() - i).len;
      auto it = vocab_.find(piece.substr(i, len));
      if (it != vocab_.end()) {
        ids.push_back(it->second);
      } else if (byte_fallback_ && std::all_of(p + i, p + i + len, [&](unsigned char b) {
                   return byte_ids_[b] >= 0;
                 })) {
        for (size_t k = i; k < i + len; ++k) ids.push_back(byte_ids_[p[k]]);
      } else {
        AppendUnknown(&ids);
      }
      i += len;
    }
  }
  if (ids.size() < 2) {
    out->insert(out->end(), ids.begin(), ids.end());
    return;
  }
  // Repeatedly merge the lowest-rank adjacent pair (leftmost on ties) as HF does, with a
  // doubly linked list over the symbols and a lazy min-heap of candidate pairs.
  struct Sym {
    int32_t id, prev, next;
  };
  struct Cand {
    int32_t rank, pos, left, right, merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<Sym> syms;
  thread_local std::vector<Cand> heap;
  syms.clear();
  heap.clear();
  const int32_t n = static_cast<int32_t>(ids.size());
  for (int32_t i = 0; i < n; ++i) syms.push_back({ids[i], i - 1, i + 1 < n ? i + 1 : -1});
  auto push_pair = [&](int32_t i) {
    const int32_t j = syms[i].next;
    if (j < 0) return;
    auto it = merges_.find(PairKey(syms[i].id, syms[j].id));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, i, syms[i].id, syms[j].id, it->second.id});
    std::push_heap(heap.begin(), heap.end(), std::greater<>());
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Cand c = heap.back();
    heap.pop_back();
    Sym& l = syms[c.pos];
    // Stale candidates: a side was merged away (id -1) or replaced since it was pushed.
    if (l.id != c.left || l.next < 0 || syms[l.next].id != c.right) continue;
    Sym& r = syms[l.next];
    l.id = c.merged;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = c.pos;
    r.id = -1;
    if (l.prev >= 0) push_pair(l.prev);
    push_pair(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out->push_back(syms[i].id);
}

}  // namespace cachet
