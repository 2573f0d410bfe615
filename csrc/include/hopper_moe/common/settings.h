// Process-wide settings from the environment, read once when the library loads
// (csrc/settings.cpp), never on a launch path. README.md lists them.
#pragma once

namespace hopper_moe::settings {

// HOPPER_MOE_PDL=0 launches every kernel without programmatic dependent launch (the overlap
// of a kernel's start with the previous kernel's end; common/pdl.cuh). Default: on.
bool pdl_enabled();

}  // namespace hopper_moe::settings
