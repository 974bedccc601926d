// Generated from diffexport/core/contract.py by tools/gen_plugin_fields.py. Do not edit: rerun the tool.
#pragma once

namespace diffx::contract {

constexpr char kPluginName[] = "DiffAttention";
constexpr char kPluginVersion[] = "1";
constexpr char kKeyMaskPluginVersion[] = "2";  // op version 2: + key_mask
constexpr char kKvCachePluginVersion[] = "3";  // op version 3: an 8-bit KV cache, + k_scale, v_scale
constexpr char kPluginNamespace[] = "diffexport";
constexpr char kOnnxDomain[] = "diffexport";

// Inputs in contract order (the plugin's input indices); version 2 adds the optional key_mask,
// version 3 the 8-bit KV cache's scales (key and value are then its codes).
enum InputIndex : int {
  kInput_query = 0,
  kInput_key = 1,
  kInput_value = 2,
  kInput_lambda_full = 3,
  kInput_norm_weight = 4,
  kInput_key_mask = 5,
  kInput_k_scale = 6,
  kInput_v_scale = 7,
  kNumInputs = 5,
  kNumInputsKeyMask = 6,
  kNumInputsKvCache = 8
};
constexpr int kNumOutputs = 1;

enum class FieldKind { kInt, kFloat };

struct FieldSpec {
  const char* name;
  FieldKind kind;
  bool required;          // no default: the node must carry it
  double default_value;
  int num_choices;        // 0: any value allowed by the minimum
  int choices[4];
  bool has_minimum;
  double minimum;
  bool exclusive_minimum;
  bool plugin_only;       // not an op attribute (ignored by the ONNX function body)
};

// Field order: the op's attributes, then the plugin-only fields (contract.PLUGIN_FIELDS).
enum FieldIndex : int {
  kField_variant = 0,
  kField_num_heads = 1,
  kField_num_kv_heads = 2,
  kField_head_dim = 3,
  kField_causal = 4,
  kField_scale = 5,
  kField_norm = 6,
  kField_norm_eps = 7,
  kField_output_scale = 8,
  kField_logit_bits = 9,
  kField_smooth_k = 10,
  kNumFields = 11
};

constexpr FieldSpec kFields[kNumFields] = {
    {"variant", FieldKind::kInt, false, 1.0, 2, {1, 2}, false, 0.0, false, false},
    {"num_heads", FieldKind::kInt, true, 0.0, 0, {0}, true, 1.0, false, false},
    {"num_kv_heads", FieldKind::kInt, true, 0.0, 0, {0}, true, 1.0, false, false},
    {"head_dim", FieldKind::kInt, true, 0.0, 0, {0}, true, 1.0, false, false},
    {"causal", FieldKind::kInt, false, 1.0, 2, {0, 1}, false, 0.0, false, false},
    {"scale", FieldKind::kFloat, false, 0.0, 0, {0}, true, 0.0, false, false},
    {"norm", FieldKind::kInt, false, 1.0, 2, {0, 1}, false, 0.0, false, false},
    {"norm_eps", FieldKind::kFloat, false, 1e-05, 0, {0}, true, 0.0, true, false},
    {"output_scale", FieldKind::kFloat, false, 1.0, 0, {0}, false, 0.0, false, false},
    {"logit_bits", FieldKind::kInt, false, 16.0, 4, {16, 8, 6, 4}, false, 0.0, false, true},
    {"smooth_k", FieldKind::kInt, false, 1.0, 2, {0, 1}, false, 0.0, false, true},
};

// Node attributes TensorRT's ONNX parser consumes to select the plugin; never plugin fields.
constexpr const char* kSelectorAttributes[] = {"plugin_namespace", "plugin_version"};
constexpr int kNumSelectorAttributes = 2;

}  // namespace diffx::contract
