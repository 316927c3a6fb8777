// One Runtime request's events, for the tests of the serving runtime: Wait returns once the final
// event arrived (or fails the test after two minutes).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "cachet/model_config.h"
#include "cachet/serving.h"

namespace cachet::testing {

struct Collector {
  std::mutex mu;
  std::condition_variable cv;
  std::string text;
  std::vector<int32_t> tokens;
  int events = 0;
  TokenEvent last;
  bool done = false;
  std::atomic<int> most_pages{0};  // with a watched runtime: pages in use as events arrived
  EventCallback Callback(Runtime* watch = nullptr) {
    return [this, watch](const TokenEvent& e) {
      if (watch != nullptr && !e.finished) {
        most_pages = std::max(most_pages.load(), watch->kv_stats().pages_used);
      }
      std::lock_guard<std::mutex> lock(mu);
      text += e.text;
      tokens.insert(tokens.end(), e.tokens.begin(), e.tokens.end());
      ++events;
      if (e.finished) {
        last = e;
        done = true;
        cv.notify_all();
      }
    };
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return done; }));
  }
};

// Tokens one request's cache can hold in the runtime's whole KV pool (every table's pages).
inline int TokensThePoolHolds(const Runtime& r) {
  const KvStats kv = r.kv_stats();
  return kv.pages_total / (r.config().n_layers * r.config().n_kv_heads) * kv.page_tokens;
}

}  // namespace cachet::testing
