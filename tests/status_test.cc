#include "cachet/status.h"

#include <gtest/gtest.h>

namespace cachet {
namespace {

Result<int> Half(int x) {
  if (x % 2) return InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

Status Chain(int x, int* out) {
  CACHET_ASSIGN_OR_RETURN(int h, Half(x));
  CACHET_ASSIGN_OR_RETURN(*out, Half(h));
  return OkStatus();
}

TEST(Status, PropagatesFirstError) {
  int v = 0;
  EXPECT_TRUE(Chain(8, &v).ok());
  EXPECT_EQ(v, 2);
  Status s = Chain(6, &v);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.ToString(), "INVALID_ARGUMENT: odd: 3");
}

}  // namespace
}  // namespace cachet
