#include "test_util.h"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

namespace cachet::testing {

TempDir::TempDir(const std::string& base) {
  const std::filesystem::path root =
      base.empty() ? std::filesystem::temp_directory_path() : std::filesystem::path(base);
  std::string tmpl = (root / "cachet-test-XXXXXX").string();
  char* p = ::mkdtemp(tmpl.data());
  path_ = p ? p : "";
}

TempDir::~TempDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

CliRun RunCachet(const std::string& args, const std::string& stdin_text,
                 const std::string& wrapper) {
  TempDir dir;
  const std::string in = dir.Write("stdin.txt", stdin_text);
  const std::string err = dir.path() + "/stderr.txt";
  const std::string cmd =
      wrapper + " " + std::string(CACHET_BINARY) + " " + args + " < " + in + " 2> " + err;
  CliRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), p)) > 0;) r.out.append(buf.data(), n);
  r.status = pclose(p);
  r.err = ReadFile(err);
  return r;
}

}  // namespace cachet::testing
