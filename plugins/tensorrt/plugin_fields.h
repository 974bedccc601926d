// The DiffAttention plugin's fields without TensorRT: parse a field collection into a validated
// configuration (one-line reasons for every refusal), check what the kernel supports, and lay the
// configuration out again for serialisation. The plugin glue converts TensorRT's
// PluginFieldCollection to RawField and back; tests fuzz this code through plugin_fields_c.cpp.
#pragma once

#include <stdint.h>

#include <string>

#include "generated/contract_fields.h"

namespace diffx {

// The type codes of TensorRT's PluginFieldType (checked with static_asserts where TensorRT's
// headers are present).
enum RawFieldType : int32_t {
  kRawFloat16 = 0,
  kRawFloat32 = 1,
  kRawFloat64 = 2,
  kRawInt8 = 3,
  kRawInt16 = 4,
  kRawInt32 = 5,
  kRawChar = 6,
  kRawDims = 7,
  kRawUnknown = 8,
  kRawBF16 = 9,
  kRawInt64 = 10,
};

struct RawField {
  const char* name;
  const void* data;
  int32_t type;
  int32_t length;
};

// One value per contract field (contract::kFields order): ints for int fields, floats for float ones.
struct PluginConfig {
  int32_t ints[contract::kNumFields] = {};
  float floats[contract::kNumFields] = {};
  int32_t get_int(int field) const { return ints[field]; }
  float get_float(int field) const { return floats[field]; }
  int32_t value_dim() const;  // 2*head_dim (V1) or head_dim (V2)
  std::string describe() const;  // "variant=1 num_heads=... logit_bits=16 smooth_k=1"
};

// Parses `count` fields; returns "" and fills *out, or the reason. Never throws.
std::string parse_plugin_fields(const RawField* fields, int32_t count, PluginConfig* out) noexcept;

// Checks beyond each field's range: kv heads divide heads, V2 has no norm, the kernel supports the head dim.
std::string check_plugin_config(const PluginConfig& config) noexcept;

// The configuration as fields (all int32 or float32, length 1) pointing into this object.
class SerializedFields {
 public:
  explicit SerializedFields(const PluginConfig& config);
  SerializedFields(const SerializedFields& other) : SerializedFields(other.config_) {}
  SerializedFields& operator=(const SerializedFields&) = delete;
  const RawField* fields() const { return fields_; }
  int32_t count() const { return contract::kNumFields; }

 private:
  PluginConfig config_;
  RawField fields_[contract::kNumFields];
};

}  // namespace diffx
