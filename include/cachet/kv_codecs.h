// Names of the KV page codecs (how K and V pages are stored: f32, f16, q8_0, q4_0, kivi4,
// rot3+qjl, ...; src/kv/codecs/ implements them). EngineOptions names its codecs by these.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "cachet/status.h"

namespace cachet::codecs {

// "K:V" names a K codec and a V codec, "K" alone both: the two names, not yet parsed.
std::pair<std::string, std::string> SplitKv(std::string_view kv);
// The names the engine accepts, comma separated (for --help and errors).
std::string CodecNames();
// Whether "K[:V]" names codecs the engine accepts; InvalidArgument naming the one it does not.
Status CheckCodecNames(std::string_view kv);

}  // namespace cachet::codecs
