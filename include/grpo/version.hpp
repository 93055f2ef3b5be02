// The version of these headers. CMakeLists.txt's project(VERSION) must say the
// same: the configure step checks it (a committed header, not a generated one,
// so no build tree adds an include directory of its own and every build of the
// library compiles the same command).
#pragma once

#define GRPO_VERSION_MAJOR 0
#define GRPO_VERSION_MINOR 1
#define GRPO_VERSION_PATCH 0
#define GRPO_VERSION_STRING "0.1.0"

namespace grpo {

// The version of the library actually linked (may differ from the header's).
const char* version();
// The SIMD path the stage kernels dispatch to on this CPU: "avx512", "avx2" or "scalar".
const char* simd_path();

}  // namespace grpo
