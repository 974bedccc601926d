// A C entry to the field parser for tests (ctypes fuzzing without TensorRT): not part of the plugin.
#include <cstring>

#include "plugin_fields.h"

#define DIFFX_FIELDS_API extern "C" __attribute__((visibility("default")))

// Returns 0 and fills ints/floats (contract::kNumFields each), or 1 and the reason in `error`.
// check != 0 also applies check_plugin_config (what createPlugin does).
DIFFX_FIELDS_API int diffx_plugin_parse_fields(const diffx::RawField* fields, int32_t count, int32_t check,
                                               int32_t* ints, float* floats, char* error, int32_t error_len) {
  diffx::PluginConfig config;
  std::string reason = diffx::parse_plugin_fields(fields, count, &config);
  if (reason.empty() && check) reason = diffx::check_plugin_config(config);
  if (!reason.empty()) {
    if (error && error_len > 0) {
      std::strncpy(error, reason.c_str(), size_t(error_len) - 1);
      error[error_len - 1] = '\0';
    }
    return 1;
  }
  std::memcpy(ints, config.ints, sizeof config.ints);
  std::memcpy(floats, config.floats, sizeof config.floats);
  return 0;
}

// Round trip: the serialised form of a parsed configuration, parsed again, into ints/floats.
DIFFX_FIELDS_API int diffx_plugin_roundtrip(const int32_t* ints, const float* floats, int32_t* ints_out, float* floats_out) {
  diffx::PluginConfig config;
  std::memcpy(config.ints, ints, sizeof config.ints);
  std::memcpy(config.floats, floats, sizeof config.floats);
  const diffx::SerializedFields serialised(config);
  diffx::PluginConfig again;
  if (!diffx::parse_plugin_fields(serialised.fields(), serialised.count(), &again).empty()) return 1;
  std::memcpy(ints_out, again.ints, sizeof again.ints);
  std::memcpy(floats_out, again.floats, sizeof again.floats);
  return 0;
}

DIFFX_FIELDS_API int32_t diffx_plugin_field_count() { return diffx::contract::kNumFields; }
DIFFX_FIELDS_API const char* diffx_plugin_field_name(int32_t i) {
  return (i >= 0 && i < diffx::contract::kNumFields) ? diffx::contract::kFields[i].name : nullptr;
}
