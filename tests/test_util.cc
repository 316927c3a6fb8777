#include "test_util.h"

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

}  // namespace cachet::testing
