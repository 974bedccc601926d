#include "DiffAttentionPlugin.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <mutex>

#include "diff_attention.h"

using namespace nvinfer1;

namespace diffx::trt {

// Our field type codes are TensorRT's.
static_assert(int32_t(PluginFieldType::kFLOAT16) == kRawFloat16 && int32_t(PluginFieldType::kFLOAT32) == kRawFloat32 &&
                  int32_t(PluginFieldType::kFLOAT64) == kRawFloat64 && int32_t(PluginFieldType::kINT8) == kRawInt8 &&
                  int32_t(PluginFieldType::kINT16) == kRawInt16 && int32_t(PluginFieldType::kINT32) == kRawInt32 &&
                  int32_t(PluginFieldType::kCHAR) == kRawChar && int32_t(PluginFieldType::kINT64) == kRawInt64,
              "PluginFieldType codes changed");

namespace {

using contract::FieldKind;
namespace c = contract;

constexpr size_t kWorkspaceAlign = 256;  // the kernel library's workspace alignment

std::mutex g_logger_mutex;
ILoggerFinder* g_logger_finder = nullptr;

int32_t dtype_code(DataType type) {
  switch (type) {
    case DataType::kHALF: return DIFFX_DTYPE_FLOAT16;
    case DataType::kBF16: return DIFFX_DTYPE_BFLOAT16;
    case DataType::kFLOAT: return DIFFX_DTYPE_FLOAT32;  // converted to fp16 by the kernel library
    default: return 0;
  }
}

// The kernel's params for these shapes (contiguous tensors, contract layout) without pointers.
DiffxAttentionParams base_params(const PluginConfig& config, const Dims& query, const Dims& key, DataType type) {
  DiffxAttentionParams p{};
  const int64_t heads = config.get_int(c::kField_num_heads);
  const int64_t B = query.d[0], Sq = query.d[1], Skv = key.d[1];
  p.q_row_stride = query.d[2];
  p.q_batch_stride = Sq * query.d[2];
  p.k_row_stride = key.d[2];
  p.k_batch_stride = Skv * key.d[2];
  p.v_row_stride = int64_t(config.get_int(c::kField_num_kv_heads)) * config.value_dim();
  p.v_batch_stride = Skv * p.v_row_stride;
  p.o_row_stride = heads * config.value_dim();
  p.o_batch_stride = Sq * p.o_row_stride;
  if (config.get_int(c::kField_variant) == 2) {
    p.lambda_batch_stride = Sq * heads;
    p.lambda_row_stride = heads;
    p.lambda_head_stride = 1;
  }
  p.dtype = dtype_code(type);
  p.variant = config.get_int(c::kField_variant);
  p.batch = int32_t(B);
  p.q_len = int32_t(Sq);
  p.kv_len = int32_t(Skv);
  p.num_heads = config.get_int(c::kField_num_heads);
  p.num_kv_heads = config.get_int(c::kField_num_kv_heads);
  p.head_dim = config.get_int(c::kField_head_dim);
  p.causal = config.get_int(c::kField_causal);
  p.norm = config.get_int(c::kField_norm);
  p.scale = config.get_float(c::kField_scale);
  p.norm_eps = config.get_float(c::kField_norm_eps);
  p.output_scale = config.get_float(c::kField_output_scale);
  const int32_t bits = config.get_int(c::kField_logit_bits);
  p.logit_bits = bits >= 16 ? 0 : bits;
  p.smooth_k = config.get_int(c::kField_smooth_k);
  return p;
}

// An 8-bit KV cache's code type (DiffxKvFormat), 0 for any other.
int32_t kv_format_code(DataType type) {
  switch (type) {
    case DataType::kINT8: return DIFFX_KV_INT8;
    case DataType::kFP8: return DIFFX_KV_FP8_E4M3;
    default: return 0;
  }
}

bool fits_int32(const Dims& d) {
  for (int i = 0; i < d.nbDims; ++i)
    if (d.d[i] > INT32_MAX) return false;
  return true;
}

}  // namespace

void log_error(const std::string& message) noexcept {
  try {
    ILogger* logger = nullptr;
    {
      std::lock_guard<std::mutex> lock(g_logger_mutex);
      if (g_logger_finder) logger = g_logger_finder->findLogger();
    }
    const std::string line = "DiffAttention plugin: " + message;
    if (logger) {
      logger->log(ILogger::Severity::kERROR, line.c_str());
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  } catch (...) {
  }
}

const char* plugin_version(int op_version) noexcept {
  return op_version == 3 ? c::kKvCachePluginVersion : op_version == 2 ? c::kKeyMaskPluginVersion : c::kPluginVersion;
}

void set_logger_finder(ILoggerFinder* finder) noexcept {
  std::lock_guard<std::mutex> lock(g_logger_mutex);
  if (finder) g_logger_finder = finder;
}

// ----------------------------------------------------------------------------------------- plugin

DiffAttentionPlugin::DiffAttentionPlugin(const PluginConfig& config, int op_version)
    : config_(config), op_version_(op_version),
      description_(config.describe() + (op_version == 3 ? " kv_cache" : op_version == 2 ? " key_mask" : "")),
      serialized_(config) {
  for (int32_t i = 0; i < serialized_.count(); ++i) {
    const RawField& f = serialized_.fields()[i];
    fields_.emplace_back(f.name, f.data, static_cast<PluginFieldType>(f.type), f.length);
  }
  field_collection_.nbFields = static_cast<int32_t>(fields_.size());
  field_collection_.fields = fields_.data();
}

DiffAttentionPlugin::DiffAttentionPlugin(const DiffAttentionPlugin& other)
    : DiffAttentionPlugin(other.config_, other.op_version_) {
  recorder_ = other.recorder_;
}

void DiffAttentionPlugin::report(const std::string& message) const noexcept {
  try {
    if (recorder_) recorder_->reportError(ErrorCode::kINVALID_ARGUMENT, ("DiffAttention plugin: " + message).c_str());
  } catch (...) {
  }
  log_error(message);
}

IPluginCapability* DiffAttentionPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
  switch (type) {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

IPluginV3* DiffAttentionPlugin::clone() noexcept {
  try {
    return new DiffAttentionPlugin(*this);
  } catch (...) {
    log_error("out of memory while cloning");
    return nullptr;
  }
}

const char* DiffAttentionPlugin::getPluginName() const noexcept { return c::kPluginName; }
const char* DiffAttentionPlugin::getPluginVersion() const noexcept { return plugin_version(op_version_); }

int32_t DiffAttentionPlugin::num_inputs() const {
  return op_version_ == 3 ? c::kNumInputsKvCache : op_version_ == 2 ? c::kNumInputsKeyMask : c::kNumInputs;
}
const char* DiffAttentionPlugin::getPluginNamespace() const noexcept { return c::kPluginNamespace; }

std::string DiffAttentionPlugin::check_shapes(const Dims* in, const Dims* out) const {
  // -1 (unknown while building) matches anything.
  auto same = [](int64_t a, int64_t b) { return a < 0 || b < 0 || a == b; };
  const int64_t H = config_.get_int(c::kField_num_heads), Hkv = config_.get_int(c::kField_num_kv_heads);
  const int64_t D = config_.get_int(c::kField_head_dim), Dv = config_.value_dim();
  const bool v1 = config_.get_int(c::kField_variant) == 1;
  const Dims &q = in[c::kInput_query], &k = in[c::kInput_key], &v = in[c::kInput_value];
  const Dims &lam = in[c::kInput_lambda_full], &w = in[c::kInput_norm_weight];
  if (q.nbDims != 3 || k.nbDims != 3 || v.nbDims != 3) return "query, key and value must be 3-D [batch, seq, width]";
  if (!same(q.d[2], 2 * H * D)) return "query width " + std::to_string(q.d[2]) + " != 2*num_heads*head_dim = " + std::to_string(2 * H * D);
  if (!same(k.d[2], (v1 ? 2 : 1) * Hkv * D)) return "key width " + std::to_string(k.d[2]) + " does not match num_kv_heads and head_dim";
  if (!same(v.d[2], Hkv * Dv)) return "value width " + std::to_string(v.d[2]) + " != num_kv_heads*" + std::to_string(Dv);
  if (!same(q.d[0], k.d[0]) || !same(q.d[0], v.d[0])) return "batch sizes of query, key and value differ";
  if (!same(k.d[1], v.d[1])) return "key and value lengths differ";
  if (config_.get_int(c::kField_causal) && q.d[1] >= 0 && k.d[1] >= 0 && q.d[1] > k.d[1])
    return "causal attention needs query length <= key length (bottom-right alignment)";
  if (v1 ? !(lam.nbDims == 1 && same(lam.d[0], 1))
         : !(lam.nbDims == 3 && same(lam.d[0], q.d[0]) && same(lam.d[1], q.d[1]) && same(lam.d[2], H)))
    return v1 ? "lambda_full must be [1] for variant 1" : "lambda_full must be [batch, q_len, num_heads] for variant 2";
  if (w.nbDims != 1 || !same(w.d[0], Dv)) return "norm_weight must be [" + std::to_string(Dv) + "]";
  if (out && (out->nbDims != 3 || !same(out->d[2], H * Dv))) return "output must be [batch, seq, num_heads*Dv]";
  if (has_key_mask()) {
    const Dims& m = in[c::kInput_key_mask];
    if (m.nbDims != 2 || !same(m.d[0], q.d[0]) || !same(m.d[1], k.d[1])) return "key_mask must be [batch, key length]";
  }
  if (kv_cache()) {
    const Dims &ks = in[c::kInput_k_scale], &vs = in[c::kInput_v_scale];
    if (ks.nbDims != 1 || !same(ks.d[0], (v1 ? 2 : 1) * Hkv * D)) return "k_scale must be [key width]";
    if (vs.nbDims != 1 || !same(vs.d[0], Hkv * Dv)) return "v_scale must be [value width]";
  }
  return "";
}

int32_t DiffAttentionPlugin::configurePlugin(const DynamicPluginTensorDesc* in, int32_t nbInputs,
                                             const DynamicPluginTensorDesc* out, int32_t nbOutputs) noexcept {
  try {
    if (nbInputs != num_inputs() || nbOutputs != c::kNumOutputs || !in || !out) {
      report(op_version_ == 3 ? "version 3 expects 8 inputs (query, key, value, lambda_full, norm_weight, key_mask, "
                                "k_scale, v_scale) and 1 output"
             : op_version_ == 2 ? "version 2 expects 6 inputs (query, key, value, lambda_full, norm_weight, key_mask) "
                                  "and 1 output"
                                : "expects 5 inputs (query, key, value, lambda_full, norm_weight) and 1 output");
      return -1;
    }
    Dims dims[c::kNumInputsKvCache];
    for (int i = 0; i < num_inputs(); ++i) dims[i] = in[i].desc.dims;
    const std::string problem = check_shapes(dims, &out[0].desc.dims);
    if (!problem.empty()) {
      report(problem);
      return -1;
    }
    return 0;
  } catch (...) {
    report("configurePlugin failed");
    return -1;
  }
}

int32_t DiffAttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, const DataType* inputTypes,
                                                int32_t nbInputs) const noexcept {
  if (!outputTypes || !inputTypes || nbOutputs != c::kNumOutputs || nbInputs != num_inputs()) return -1;
  outputTypes[0] = inputTypes[c::kInput_query];
  return 0;
}

int32_t DiffAttentionPlugin::getOutputShapes(const DimsExprs* inputs, int32_t nbInputs, const DimsExprs*, int32_t,
                                             DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept {
  try {
    if (!inputs || !outputs || nbInputs != num_inputs() || nbOutputs != c::kNumOutputs ||
        inputs[c::kInput_query].nbDims != 3) {
      report("query must be 3-D [batch, seq, 2*num_heads*head_dim]");
      return -1;
    }
    outputs[0].nbDims = 3;
    outputs[0].d[0] = inputs[c::kInput_query].d[0];
    outputs[0].d[1] = inputs[c::kInput_query].d[1];
    outputs[0].d[2] = exprBuilder.constant(int64_t(config_.get_int(c::kField_num_heads)) * config_.value_dim());
    return 0;
  } catch (...) {
    report("getOutputShapes failed");
    return -1;
  }
}

bool DiffAttentionPlugin::supportsFormatCombination(int32_t pos, const DynamicPluginTensorDesc* inOut, int32_t nbInputs,
                                                    int32_t nbOutputs) noexcept {
  if (!inOut || nbInputs != num_inputs() || nbOutputs != c::kNumOutputs || pos < 0 || pos >= nbInputs + nbOutputs)
    return false;
  const PluginTensorDesc& desc = inOut[pos].desc;
  if (desc.format != TensorFormat::kLINEAR) return false;
  if (pos == c::kInput_query) return dtype_code(desc.type) != 0;  // fp16, bf16, or fp32 (run in fp16)
  if (pos == c::kInput_norm_weight) return desc.type == DataType::kFLOAT;
  if (has_key_mask() && pos == c::kInput_key_mask) return desc.type == DataType::kINT64;
  if (kv_cache()) {  // key and value: one code type (int8 or fp8 e4m3); their scales float32
    if (pos == c::kInput_k_scale || pos == c::kInput_v_scale) return desc.type == DataType::kFLOAT;
    if (pos == c::kInput_key) return kv_format_code(desc.type) != 0;
    if (pos == c::kInput_value) return desc.type == inOut[c::kInput_key].desc.type;
  }
  return desc.type == inOut[c::kInput_query].desc.type;  // key, value, lambda_full, output: query's type
}

int32_t DiffAttentionPlugin::getNbOutputs() const noexcept { return c::kNumOutputs; }

size_t DiffAttentionPlugin::getWorkspaceSize(const DynamicPluginTensorDesc* inputs, int32_t nbInputs,
                                             const DynamicPluginTensorDesc*, int32_t) const noexcept {
  if (!inputs || nbInputs != num_inputs()) return 0;
  DiffxAttentionParams p =
      base_params(config_, inputs[c::kInput_query].max, inputs[c::kInput_key].max, inputs[c::kInput_query].desc.type);
  if (kv_cache()) p.kv_format = kv_format_code(inputs[c::kInput_key].desc.type);  // longer calls dequantise it
  size_t bytes = diffx_attention_workspace_size(&p);
  // Calls with few query tokens run the split-KV decode kernels, whose partial states need room
  // of their own: size it for the most decode rows the profile allows (the size only grows with
  // batch, heads and keys, so the profile's maximum covers every shape in it).
  if (inputs[c::kInput_query].min.d[1] <= DIFFX_DECODE_MAX_QUERY && p.q_len > DIFFX_DECODE_MAX_QUERY) {
    p.q_len = DIFFX_DECODE_MAX_QUERY;
    bytes = std::max(bytes, diffx_attention_workspace_size(&p));
  }
  return bytes ? bytes + kWorkspaceAlign : 0;
}

const char* DiffAttentionPlugin::getTimingCacheID() noexcept { return description_.c_str(); }
const char* DiffAttentionPlugin::getMetadataString() noexcept { return description_.c_str(); }

int32_t DiffAttentionPlugin::onShapeChange(const PluginTensorDesc* in, int32_t nbInputs, const PluginTensorDesc* out,
                                           int32_t nbOutputs) noexcept {
  try {
    if (!in || !out || nbInputs != num_inputs() || nbOutputs != c::kNumOutputs) return -1;
    Dims dims[c::kNumInputsKvCache];
    for (int i = 0; i < num_inputs(); ++i) dims[i] = in[i].dims;
    const std::string problem = check_shapes(dims, &out[0].dims);
    if (!problem.empty()) {
      report(problem);
      return -1;
    }
    return 0;
  } catch (...) {
    report("onShapeChange failed");
    return -1;
  }
}

int32_t DiffAttentionPlugin::enqueue(const PluginTensorDesc* inputDesc, const PluginTensorDesc* outputDesc,
                                     const void* const* inputs, void* const* outputs, void* workspace,
                                     cudaStream_t stream) noexcept {
  try {
    if (!inputDesc || !outputDesc || !inputs || !outputs) {
      report("enqueue called without tensors");
      return -1;
    }
    for (int i = 0; i < num_inputs(); ++i)
      if (!fits_int32(inputDesc[i].dims)) {
        report("a dimension exceeds the kernel's int32 range");
        return -1;
      }
    DiffxAttentionParams p = base_params(config_, inputDesc[c::kInput_query].dims, inputDesc[c::kInput_key].dims,
                                         inputDesc[c::kInput_query].type);
    p.query = inputs[c::kInput_query];
    p.key = inputs[c::kInput_key];
    p.value = inputs[c::kInput_value];
    p.lambda_full = inputs[c::kInput_lambda_full];
    p.norm_weight = static_cast<const float*>(inputs[c::kInput_norm_weight]);
    p.output = outputs[0];
    if (has_key_mask()) {  // [batch, key length] int64, contiguous
      p.key_mask = static_cast<const int64_t*>(inputs[c::kInput_key_mask]);
      p.mask_batch_stride = inputDesc[c::kInput_key_mask].dims.d[1];
    }
    if (kv_cache()) {  // key and value are the cache's codes (1 byte an element: the strides hold)
      p.kv_format = kv_format_code(inputDesc[c::kInput_key].type);
      p.k_scale = static_cast<const float*>(inputs[c::kInput_k_scale]);
      p.v_scale = static_cast<const float*>(inputs[c::kInput_v_scale]);
    }
    const size_t need = diffx_attention_workspace_size(&p);
    if (need) {
      const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace);
      p.workspace = reinterpret_cast<void*>((raw + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign);
      p.workspace_bytes = workspace ? need : 0;
    }
    const int status = diffx_attention_forward(&p, stream);
    if (status != DIFFX_OK) {
      report(std::string(diffx_status_string(status)) + ": " + diffx_last_error());
      return status;
    }
    return 0;
  } catch (...) {
    report("enqueue failed");
    return -1;
  }
}

IPluginV3* DiffAttentionPlugin::attachToContext(IPluginResourceContext* context) noexcept {
  try {
    auto* plugin = new DiffAttentionPlugin(*this);
    plugin->recorder_ = context ? context->getErrorRecorder() : nullptr;
    return plugin;
  } catch (...) {
    log_error("out of memory while attaching to an execution context");
    return nullptr;
  }
}

const PluginFieldCollection* DiffAttentionPlugin::getFieldsToSerialize() noexcept { return &field_collection_; }

// ---------------------------------------------------------------------------------------- creator

DiffAttentionPluginCreator::DiffAttentionPluginCreator(int op_version) : op_version_(op_version) {
  for (int i = 0; i < c::kNumFields; ++i) {
    const bool is_int = c::kFields[i].kind == FieldKind::kInt;
    field_names_.emplace_back(c::kFields[i].name, nullptr, is_int ? PluginFieldType::kINT32 : PluginFieldType::kFLOAT32, 1);
  }
  field_name_collection_.nbFields = static_cast<int32_t>(field_names_.size());
  field_name_collection_.fields = field_names_.data();
}

IPluginV3* DiffAttentionPluginCreator::createPlugin(const char* name, const PluginFieldCollection* fc,
                                                    TensorRTPhase) noexcept {
  try {
    const std::string layer = name ? name : "<unnamed>";
    if (!fc) {
      log_error(layer + ": no field collection");
      return nullptr;
    }
    if (fc->nbFields < 0 || fc->nbFields > 4096 || (fc->nbFields > 0 && !fc->fields)) {
      log_error(layer + ": corrupt field collection");
      return nullptr;
    }
    std::vector<RawField> raw;
    raw.reserve(size_t(fc->nbFields));
    for (int32_t i = 0; i < fc->nbFields; ++i) {
      const PluginField& f = fc->fields[i];
      raw.push_back(RawField{f.name, f.data, static_cast<int32_t>(f.type), f.length});
    }
    PluginConfig config;
    std::string problem = parse_plugin_fields(raw.data(), int32_t(raw.size()), &config);
    if (problem.empty()) problem = check_plugin_config(config);
    if (!problem.empty()) {
      log_error(layer + ": " + problem);
      return nullptr;
    }
    return new DiffAttentionPlugin(config, op_version_);
  } catch (...) {
    log_error("createPlugin failed");
    return nullptr;
  }
}

const PluginFieldCollection* DiffAttentionPluginCreator::getFieldNames() noexcept { return &field_name_collection_; }
const char* DiffAttentionPluginCreator::getPluginName() const noexcept { return c::kPluginName; }
const char* DiffAttentionPluginCreator::getPluginVersion() const noexcept { return plugin_version(op_version_); }
const char* DiffAttentionPluginCreator::getPluginNamespace() const noexcept { return c::kPluginNamespace; }

}  // namespace diffx::trt
