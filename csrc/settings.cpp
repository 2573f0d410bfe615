// The one place the C++ library reads the environment: at load, into constants
// (common/settings.h). tests/test_no_env_reads.py allows getenv nowhere else under csrc/.
#include "hopper_moe/common/settings.h"

#include <cstdlib>
#include <cstring>

namespace hopper_moe::settings {

namespace {

bool read_flag(const char* name, bool fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::strcmp(value, "0") != 0;
}

const bool kPdlEnabled = read_flag("HOPPER_MOE_PDL", true);

}  // namespace

bool pdl_enabled() { return kPdlEnabled; }

}  // namespace hopper_moe::settings
