// ParseBlend and BlendName (cachet/reuse.h): a blend spec parsed once, where it enters (the CLI's
// --blend, the server's "blend"), with no engine.
#include <cstdio>
#include <exception>
#include <string>

#include "cachet/reuse.h"

namespace cachet {

Result<BlendOptions> ParseBlend(std::string_view spec) {
  BlendOptions b;
  const size_t colon = spec.find(':');
  const std::string_view name = spec.substr(0, colon);
  const std::string arg =
      colon == std::string_view::npos ? "" : std::string(spec.substr(colon + 1));
  auto bad = [&](const std::string& why) {
    std::string m = "'";
    m.append(spec).append("': ").append(why);
    return InvalidArgument(m);
  };
  try {
    size_t used = 0;
    if (name == "none" && arg.empty() && colon == std::string_view::npos) {
      b.kind = BlendOptions::Kind::kNone;
    } else if (name == "epic") {
      b.kind = BlendOptions::Kind::kEpic;
      if (colon != std::string_view::npos) b.epic_tokens = std::stoi(arg, &used);
      if (colon != std::string_view::npos && (used != arg.size() || b.epic_tokens < 0)) {
        return bad("epic:K takes a token count >= 0");
      }
    } else if (name == "cacheblend") {
      b.kind = BlendOptions::Kind::kCacheBlend;
      if (colon != std::string_view::npos) b.recompute = std::stod(arg, &used);
      if (colon != std::string_view::npos &&
          (used != arg.size() || !(b.recompute >= 0 && b.recompute <= 1))) {
        return bad("cacheblend:R takes a fraction in [0, 1]");
      }
    } else {
      return bad("expected none, epic[:K] or cacheblend[:R]");
    }
  } catch (const std::exception&) {
    return bad(name == "epic" ? "epic:K takes a token count >= 0"
                              : "cacheblend:R takes a fraction in [0, 1]");
  }
  return b;
}

std::string BlendName(const BlendOptions& b) {
  switch (b.kind) {
    case BlendOptions::Kind::kNone:
      return "none";
    case BlendOptions::Kind::kEpic:
      return "epic:" + std::to_string(b.epic_tokens);
    case BlendOptions::Kind::kCacheBlend: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "cacheblend:%g", b.recompute);
      return buf;
    }
  }
  return "?";
}

}  // namespace cachet
