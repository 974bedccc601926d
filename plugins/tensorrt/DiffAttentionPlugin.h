// The DiffAttention TensorRT plugin (IPluginV3, namespace/version from the op contract): thin
// glue between TensorRT and the fused kernel's C ABI (plugins/kernels/diff_attention.h). Shapes,
// types and fields are validated here; every number is computed by the kernel library.
#pragma once

#include <NvInferRuntime.h>

#include <string>
#include <vector>

#include "plugin_fields.h"

namespace diffx::trt {

class DiffAttentionPlugin final : public nvinfer1::IPluginV3,
                                  public nvinfer1::IPluginV3OneCore,
                                  public nvinfer1::IPluginV3OneBuild,
                                  public nvinfer1::IPluginV3OneRuntime {
 public:
  // op_version: the plugin version's op version: 1 (five inputs), 2 (+ the int64 key padding mask),
  // 3 (+ key_mask, k_scale, v_scale: key and value hold an 8-bit KV cache's int8 or fp8 codes).
  DiffAttentionPlugin(const PluginConfig& config, int op_version);
  DiffAttentionPlugin(const DiffAttentionPlugin& other);
  DiffAttentionPlugin& operator=(const DiffAttentionPlugin&) = delete;
  ~DiffAttentionPlugin() override = default;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  const char* getPluginName() const noexcept override;
  const char* getPluginVersion() const noexcept override;
  const char* getPluginNamespace() const noexcept override;

  // IPluginV3OneBuild
  int32_t configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* out, int32_t nbOutputs) noexcept override;
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, const nvinfer1::DataType* inputTypes,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs, const nvinfer1::DimsExprs* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t getNbOutputs() const noexcept override;
  size_t getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* outputs, int32_t nbOutputs) const noexcept override;
  const char* getTimingCacheID() noexcept override;
  const char* getMetadataString() noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(const nvinfer1::PluginTensorDesc* in, int32_t nbInputs, const nvinfer1::PluginTensorDesc* out,
                        int32_t nbOutputs) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc* outputDesc,
                  const void* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  const nvinfer1::PluginFieldCollection* getFieldsToSerialize() noexcept override;

 private:
  // One line through the execution context's error recorder (runtime) and TensorRT's logger.
  void report(const std::string& message) const noexcept;
  std::string check_shapes(const nvinfer1::Dims* inputs, const nvinfer1::Dims* output) const;
  int32_t num_inputs() const;
  bool has_key_mask() const { return op_version_ >= 2; }
  bool kv_cache() const { return op_version_ == 3; }

  PluginConfig config_;
  int op_version_ = 1;
  std::string description_;  // timing-cache id / metadata: every field value
  SerializedFields serialized_;
  std::vector<nvinfer1::PluginField> fields_;
  nvinfer1::PluginFieldCollection field_collection_{};
  nvinfer1::IErrorRecorder* recorder_ = nullptr;
};

class DiffAttentionPluginCreator final : public nvinfer1::IPluginCreatorV3One {
 public:
  explicit DiffAttentionPluginCreator(int op_version);
  nvinfer1::IPluginV3* createPlugin(const char* name, const nvinfer1::PluginFieldCollection* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;
  const nvinfer1::PluginFieldCollection* getFieldNames() noexcept override;
  const char* getPluginName() const noexcept override;
  const char* getPluginVersion() const noexcept override;
  const char* getPluginNamespace() const noexcept override;

 private:
  std::vector<nvinfer1::PluginField> field_names_;
  nvinfer1::PluginFieldCollection field_name_collection_{};
  int op_version_ = 1;
};

// The plugin version string of an op version (1, 2 or 3).
const char* plugin_version(int op_version) noexcept;

// Logs an error through the logger TensorRT handed to setLoggerFinder (stderr before that).
void log_error(const std::string& message) noexcept;

}  // namespace diffx::trt
