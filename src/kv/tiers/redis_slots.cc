// Redis Cluster's hash slots: which node holds a key, and the slot map CLUSTER SLOTS gives.
#include <hiredis/hiredis.h>

#include <algorithm>

#include "kv/tiers/redis_tier.h"

namespace cachet::tiers {
namespace {

constexpr int kSlots = 16384;
constexpr uint16_t kNoOwner = 0xffff;

uint16_t Crc16(std::string_view s) {
  // CRC-16/XMODEM (polynomial 0x1021, initial value 0), as Redis Cluster hashes keys.
  uint16_t crc = 0;
  for (const char ch : s) {
    crc ^= static_cast<uint16_t>(static_cast<uint8_t>(ch)) << 8;
    for (int b = 0; b < 8; ++b) {
      crc = (crc & 0x8000) ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                           : static_cast<uint16_t>(crc << 1);
    }
  }
  return crc;
}

}  // namespace

int RedisTier::SlotOf(std::string_view key) {
  // A hash tag: the text between the first '{' and the first '}' after it, if not empty.
  if (const size_t open = key.find('{'); open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  return Crc16(key) % kSlots;
}

bool RedisTier::ParseSlots(const redisReply* r, const RedisNode& from, std::string* why) {
  if (r->type != REDIS_REPLY_ARRAY) {
    *why = "CLUSTER SLOTS: " + RedisReplyText(r);
    return false;
  }
  std::vector<RedisNode> owners;
  std::vector<uint16_t> slot_owner(kSlots, kNoOwner);
  for (size_t i = 0; i < r->elements; ++i) {
    const redisReply* e = r->element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
        e->element[0]->type != REDIS_REPLY_INTEGER || e->element[1]->type != REDIS_REPLY_INTEGER ||
        e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
        e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
        e->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
      *why = "CLUSTER SLOTS: entry " + std::to_string(i) + " is not [start, end, [host, port]]";
      return false;
    }
    const long long lo = e->element[0]->integer, hi = e->element[1]->integer;
    const long long port = e->element[2]->element[1]->integer;
    if (lo < 0 || hi >= kSlots || lo > hi || port < 1 || port > 65535) {
      *why = "CLUSTER SLOTS: entry " + std::to_string(i) + " has slots " + std::to_string(lo) +
             "-" + std::to_string(hi) + " at port " + std::to_string(port);
      return false;
    }
    RedisNode node;
    node.host = std::string(e->element[2]->element[0]->str, e->element[2]->element[0]->len);
    // An empty or "?" endpoint means the node's address is not known to the one asked: reach it
    // where the one asked is reached.
    if (node.host.empty() || node.host == "?") node.host = from.host;
    node.port = static_cast<int>(port);
    auto it = std::find(owners.begin(), owners.end(), node);
    const size_t index = static_cast<size_t>(it - owners.begin());
    if (it == owners.end()) owners.push_back(node);
    std::fill(slot_owner.begin() + lo, slot_owner.begin() + hi + 1, static_cast<uint16_t>(index));
  }
  if (owners.empty()) {
    *why = "no hash slot is assigned to any node (the cluster is not set up)";
    return false;
  }
  std::lock_guard<std::mutex> lock(map_mu_);
  owners_ = std::move(owners);
  slot_owner_ = std::move(slot_owner);
  return true;
}

bool RedisTier::RefreshSlots(Conns& conns, std::string* why) {
  std::vector<RedisNode> candidates;
  {
    std::lock_guard<std::mutex> lock(map_mu_);
    candidates = owners_;
    for (const RedisNode& s : seeds_) {
      if (std::find(candidates.begin(), candidates.end(), s) == candidates.end()) {
        candidates.push_back(s);
      }
    }
  }
  for (const RedisNode& node : candidates) {
    if (!Allowed(node)) continue;
    redisContext* c = Connect(conns, node, why);
    if (c == nullptr) {
      Failed(node);
      continue;
    }
    Reply r(static_cast<redisReply*>(redisCommand(c, "CLUSTER SLOTS")));
    if (!r) {
      *why = c->errstr;
      Disconnect(conns, node);
      Failed(node);
      continue;
    }
    Succeeded(node);
    if (ParseSlots(r.get(), node, why)) {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++counters_.slot_refreshes;
      return true;
    }
  }
  return false;
}

RedisNode RedisTier::NodeOfKey(std::string_view key) const {
  std::lock_guard<std::mutex> lock(map_mu_);
  if (!cluster_) return owners_.front();
  const uint16_t owner = slot_owner_[SlotOf(key)];
  // A slot no node owns: ask a seed, whose MOVED or CLUSTERDOWN reply says what is going on.
  return owner == kNoOwner ? seeds_.front() : owners_[owner];
}

}  // namespace cachet::tiers
