// Chat templates and models: reading the template a model ships, and encoding rendered prompts
// with the model's tokenizer. (chat_template.cc holds the families and knows no model.)
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cachet/chat_template.h"
#include "cachet/tokenizer.h"
#include "model/gguf.h"
#include "model/gguf_model.h"
#include "util/mmap_file.h"

namespace cachet {
namespace {

// tokenizer_config.json's "chat_template": a string, or a list of {"name", "template"}.
Result<std::optional<std::string>> FromTokenizerConfig(const std::filesystem::path& path) {
  CACHET_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path.string()));
  const std::string where = path.string() + ": chat_template";
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(path.string() + ": not valid JSON");
  if (!j.is_object() || !j.contains("chat_template") || j["chat_template"].is_null()) {
    return std::optional<std::string>();
  }
  const nlohmann::json& t = j["chat_template"];
  if (t.is_string()) return std::optional<std::string>(t.get<std::string>());
  if (!t.is_array()) {
    return InvalidArgument(where + " is " + std::string(t.type_name()) +
                           ", not a string or a list of {\"name\", \"template\"}");
  }
  std::string names;
  for (size_t i = 0; i < t.size(); ++i) {
    const nlohmann::json& e = t[i];
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string() ||
        !e.contains("template") || !e["template"].is_string()) {
      return InvalidArgument(where + "[" + std::to_string(i) +
                             "] is not {\"name\": string, \"template\": string}");
    }
    const std::string& name = e["name"].get_ref<const std::string&>();
    if (name == "default") return std::optional<std::string>(e["template"].get<std::string>());
    names += (names.empty() ? "" : ", ") + name;
  }
  return InvalidArgument(where + " has no template named \"default\" (it has: " + names +
                         "); choose a family with " + std::string(kChatTemplateFlag));
}

}  // namespace

Result<std::optional<std::string>> ReadChatTemplateText(const std::string& model_path) {
  if (IsGgufPath(model_path)) {
    CACHET_ASSIGN_OR_RETURN(GgufFile f, GgufFile::Open(model_path));
    if (!f.Find("tokenizer.chat_template")) return std::optional<std::string>();
    CACHET_ASSIGN_OR_RETURN(std::string t, f.GetString("tokenizer.chat_template"));
    return std::optional<std::string>(std::move(t));
  }
  const std::filesystem::path dir(model_path);
  std::error_code ec;
  // transformers >= 4.43 saves the template in its own file, which takes precedence.
  if (std::filesystem::exists(dir / "chat_template.jinja", ec)) {
    CACHET_ASSIGN_OR_RETURN(std::string t, ReadTextFile((dir / "chat_template.jinja").string()));
    return std::optional<std::string>(std::move(t));
  }
  if (std::filesystem::exists(dir / "tokenizer_config.json", ec)) {
    return FromTokenizerConfig(dir / "tokenizer_config.json");
  }
  return std::optional<std::string>();
}

Result<ChatTemplate> ResolveChatTemplate(const std::string& model_path, std::string_view name) {
  if (!name.empty()) return ChatTemplateByName(name);
  CACHET_ASSIGN_OR_RETURN(std::optional<std::string> text, ReadChatTemplateText(model_path));
  if (!text) return ChatTemplateByName("plain");
  Result<ChatTemplate> t = DetectChatTemplate(*text);
  if (!t.ok()) return InvalidArgument(model_path + ": " + t.status().message());
  return t;
}

void UseTokenizerSpecials(const Tokenizer& tok, ChatTemplate* t) {
  t->bos_token = tok.bos_id() >= 0 ? tok.TokenBytes(tok.bos_id()) : "";
  t->eos_token = tok.eos_id() >= 0 ? tok.TokenBytes(tok.eos_id()) : "";
}

std::vector<int32_t> EncodeChatPrompt(const Tokenizer& tok, std::string_view text, bool first) {
  const std::string bos = tok.bos_id() >= 0 ? tok.TokenBytes(tok.bos_id()) : "";
  const std::string eos = tok.eos_id() >= 0 ? tok.TokenBytes(tok.eos_id()) : "";
  std::vector<int32_t> ids;
  if (first && tok.add_bos() && tok.bos_id() >= 0) {
    ids.push_back(tok.bos_id());
    if (!bos.empty() && text.starts_with(bos)) text.remove_prefix(bos.size());
  }
  // Split at the BOS and EOS texts; what lies between is encoded as text.
  while (!text.empty()) {
    size_t at = text.npos, len = 0;
    int32_t id = -1;
    for (auto [s, sid] : {std::pair{std::string_view(bos), tok.bos_id()}, {eos, tok.eos_id()}}) {
      if (s.empty()) continue;
      if (size_t p = text.find(s); p < at) at = p, len = s.size(), id = sid;
    }
    if (at > 0) {
      const std::vector<int32_t> part = tok.Encode(text.substr(0, at));
      ids.insert(ids.end(), part.begin(), part.end());
    }
    if (at == text.npos) break;
    ids.push_back(id);
    text.remove_prefix(at + len);
  }
  return ids;
}

}  // namespace cachet
