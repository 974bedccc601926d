#include "plugin_fields.h"

#include <cmath>
#include <cstring>
#include <sstream>

namespace diffx {

namespace {

bool is_selector(const char* name) {
  for (int i = 0; i < contract::kNumSelectorAttributes; ++i)
    if (std::strcmp(name, contract::kSelectorAttributes[i]) == 0) return true;
  return false;
}

int field_index(const char* name) {
  for (int i = 0; i < contract::kNumFields; ++i)
    if (std::strcmp(name, contract::kFields[i].name) == 0) return i;
  return -1;
}

std::string known_names() {
  std::string names;
  for (int i = 0; i < contract::kNumFields; ++i) names += (i ? ", " : "") + std::string(contract::kFields[i].name);
  return names;
}

// Reads an integer-typed field as int64; false when the type is not an integer type.
bool read_int(const RawField& f, int64_t* value) {
  switch (f.type) {
    case kRawInt8: *value = *static_cast<const int8_t*>(f.data); return true;
    case kRawInt16: { int16_t v; std::memcpy(&v, f.data, sizeof v); *value = v; return true; }
    case kRawInt32: { int32_t v; std::memcpy(&v, f.data, sizeof v); *value = v; return true; }
    case kRawInt64: { int64_t v; std::memcpy(&v, f.data, sizeof v); *value = v; return true; }
    default: return false;
  }
}

bool read_float(const RawField& f, double* value) {
  switch (f.type) {
    case kRawFloat32: { float v; std::memcpy(&v, f.data, sizeof v); *value = v; return true; }
    case kRawFloat64: { double v; std::memcpy(&v, f.data, sizeof v); *value = v; return true; }
    default: return false;
  }
}

std::string check_range(const contract::FieldSpec& spec, double value) {
  std::ostringstream msg;
  if (spec.num_choices) {
    for (int c = 0; c < spec.num_choices; ++c)
      if (value == spec.choices[c]) return "";
    msg << "field " << spec.name << "=" << value << " is not one of {";
    for (int c = 0; c < spec.num_choices; ++c) msg << (c ? ", " : "") << spec.choices[c];
    msg << "}";
    return msg.str();
  }
  if (spec.has_minimum && (spec.exclusive_minimum ? !(value > spec.minimum) : !(value >= spec.minimum))) {
    msg << "field " << spec.name << "=" << value << " must be " << (spec.exclusive_minimum ? "> " : ">= ") << spec.minimum;
    return msg.str();
  }
  return "";
}

}  // namespace

int32_t PluginConfig::value_dim() const {
  return get_int(contract::kField_variant) == 1 ? 2 * get_int(contract::kField_head_dim) : get_int(contract::kField_head_dim);
}

std::string PluginConfig::describe() const {
  std::ostringstream s;
  for (int i = 0; i < contract::kNumFields; ++i) {
    s << (i ? " " : "") << contract::kFields[i].name << "=";
    if (contract::kFields[i].kind == contract::FieldKind::kInt) {
      s << ints[i];
    } else {
      s << floats[i];
    }
  }
  return s.str();
}

std::string parse_plugin_fields(const RawField* fields, int32_t count, PluginConfig* out) noexcept {
  try {
    if (!out) return "no output configuration";
    if (count < 0 || count > 4096) return "field count " + std::to_string(count) + " is out of range";
    if (count > 0 && !fields) return "the field collection has " + std::to_string(count) + " fields but no field array";
    bool seen[contract::kNumFields] = {};
    PluginConfig config;
    for (int i = 0; i < contract::kNumFields; ++i) {
      const contract::FieldSpec& spec = contract::kFields[i];
      if (spec.kind == contract::FieldKind::kInt) {
        config.ints[i] = static_cast<int32_t>(spec.default_value);
      } else {
        config.floats[i] = static_cast<float>(spec.default_value);
      }
    }
    for (int32_t k = 0; k < count; ++k) {
      const RawField& f = fields[k];
      if (!f.name) return "field #" + std::to_string(k) + " has no name";
      if (std::strlen(f.name) > 256) return "field #" + std::to_string(k) + " has an over-long name";
      if (is_selector(f.name)) continue;
      const int idx = field_index(f.name);
      if (idx < 0) return "unknown field '" + std::string(f.name) + "' (known: " + known_names() + ")";
      const contract::FieldSpec& spec = contract::kFields[idx];
      if (seen[idx]) return "field " + std::string(spec.name) + " appears twice";
      seen[idx] = true;
      if (f.length != 1) return "field " + std::string(spec.name) + " has " + std::to_string(f.length) + " values, expected 1";
      if (!f.data) return "field " + std::string(spec.name) + " has no data";
      if (spec.kind == contract::FieldKind::kInt) {
        int64_t v = 0;
        if (!read_int(f, &v))
          return "field " + std::string(spec.name) + " must be an integer (INT8/16/32/64), got type " + std::to_string(f.type);
        if (v < INT32_MIN || v > INT32_MAX) return "field " + std::string(spec.name) + " does not fit in int32";
        const std::string range = check_range(spec, double(v));
        if (!range.empty()) return range;
        config.ints[idx] = static_cast<int32_t>(v);
      } else {
        double v = 0;
        if (!read_float(f, &v))
          return "field " + std::string(spec.name) + " must be a float (FLOAT32/64), got type " + std::to_string(f.type);
        if (!std::isfinite(v) || std::fabs(v) > 3.0e38) return "field " + std::string(spec.name) + " must be finite";
        const std::string range = check_range(spec, v);
        if (!range.empty()) return range;
        config.floats[idx] = static_cast<float>(v);
      }
    }
    for (int i = 0; i < contract::kNumFields; ++i)
      if (contract::kFields[i].required && !seen[i]) return "required field " + std::string(contract::kFields[i].name) + " is missing";
    *out = config;
    return "";
  } catch (...) {
    return "could not parse the plugin fields (out of memory?)";
  }
}

std::string check_plugin_config(const PluginConfig& c) noexcept {
  try {
    const int heads = c.get_int(contract::kField_num_heads), kv_heads = c.get_int(contract::kField_num_kv_heads);
    if (heads % kv_heads)
      return "num_kv_heads=" + std::to_string(kv_heads) + " must divide num_heads=" + std::to_string(heads);
    if (c.get_int(contract::kField_variant) == 2 && c.get_int(contract::kField_norm))
      return "variant 2 (DIFF V2) has no per-head norm: norm must be 0";
    const int d = c.get_int(contract::kField_head_dim);
    if (d != 64 && d != 128)
      return "head_dim=" + std::to_string(d) + " is not supported by the plugin's kernel (64 or 128); build the "
             "engine with --attention native for other head dims";
    if (heads > 65535) return "num_heads=" + std::to_string(heads) + " exceeds the kernel's 65535";
    return "";
  } catch (...) {
    return "could not check the plugin configuration";
  }
}

SerializedFields::SerializedFields(const PluginConfig& config) : config_(config) {
  for (int i = 0; i < contract::kNumFields; ++i) {
    const bool is_int = contract::kFields[i].kind == contract::FieldKind::kInt;
    fields_[i] = RawField{contract::kFields[i].name,
                          is_int ? static_cast<const void*>(&config_.ints[i]) : static_cast<const void*>(&config_.floats[i]),
                          is_int ? kRawInt32 : kRawFloat32, 1};
  }
}

}  // namespace diffx
