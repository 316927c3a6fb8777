// Helpers shared by the tests: paths of the embedded model and fixtures, golden cases.
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace cachet::testing {

inline std::string ModelDir() { return std::string(CACHET_SOURCE_DIR) + "/models/kvtiny"; }
inline std::string DataDir() { return CACHET_TEST_DATA_DIR; }

struct GoldenCase {
  std::string kind, text, answer;
  std::vector<int32_t> ids, positions, greedy;
  std::vector<std::vector<float>> logits;  // one full vocab row per position
};

inline std::vector<GoldenCase> LoadGolden() {
  std::ifstream in(DataDir() + "/golden.json");
  nlohmann::json j = nlohmann::json::parse(in);
  std::vector<GoldenCase> cases;
  for (const auto& c : j["cases"]) {
    GoldenCase g;
    g.kind = c["kind"];
    g.text = c.value("text", "");
    g.answer = c.value("answer", "");
    g.ids = c["ids"].get<std::vector<int32_t>>();
    g.positions = c["positions"].get<std::vector<int32_t>>();
    g.greedy = c["greedy"].get<std::vector<int32_t>>();
    g.logits = c["logits"].get<std::vector<std::vector<float>>>();
    cases.push_back(std::move(g));
  }
  return cases;
}

// A fresh temporary directory (under `base`, by default the system's temporary directory),
// removed by the destructor.
class TempDir {
 public:
  explicit TempDir(const std::string& base = "");
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string Write(const std::string& name, const std::string& contents) const {
    std::string p = path_ + "/" + name;
    std::ofstream(p, std::ios::binary) << contents;
    return p;
  }

 private:
  std::string path_;
};

// ||a - b|| / ||b||: the normalized error every comparison of float outputs uses.
inline double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * double(a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The cachet binary run with args (stdin from stdin_text, under wrapper: taskset ...): its exit
// status as pclose gives it, stdout and stderr.
struct CliRun {
  int status = -1;
  std::string out, err;
};
CliRun RunCachet(const std::string& args, const std::string& stdin_text = "",
                 const std::string& wrapper = "");

}  // namespace cachet::testing
