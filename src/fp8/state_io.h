#pragma once
// FP8 delayed-scaling state in checkpoints: fp8_state.safetensors holds every slot's scale
// and amax history; slots are matched by (tensor name, role) on restore, so a changed model
// config, history length or FP8 block selection restores what still applies.
#include <string>

#include "fp8/meta.h"
#include "io/safetensors.h"

namespace flux8 {

void save_fp8_state(const Fp8MetaRegistry& registry, const std::string& path);
// The same file's writer, holding its own copy of the state (written later, on any thread).
SafetensorsWriter fp8_state_writer(const Fp8MetaRegistry& registry);

// Restores the slots of `registry` found in the file; returns a one-line note of what was
// done (slots restored, slots starting fresh, history length changes, file slots unused).
std::string load_fp8_state(Fp8MetaRegistry& registry, const std::string& path);

}  // namespace flux8
