// The entry points TensorRT looks for in a plugin shared library (trtexec --dynamicPlugins,
// polygraphy --plugins, IPluginRegistry::loadLibrary). The creator list is static: loading the
// library twice hands TensorRT the same creators.
#include <NvInferRuntime.h>

#include "DiffAttentionPlugin.h"

namespace diffx::trt {
void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept;
}

#define DIFFX_PLUGIN_API extern "C" __attribute__((visibility("default")))

DIFFX_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  // version "1": the five-input op; "2": + key_mask (KV-cache decoders, op version 2); "3": an 8-bit
  // KV cache (+ k_scale, v_scale, op version 3)
  static diffx::trt::DiffAttentionPluginCreator creator(1);
  static diffx::trt::DiffAttentionPluginCreator creator_key_mask(2);
  static diffx::trt::DiffAttentionPluginCreator creator_kv_cache(3);
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator, &creator_key_mask, &creator_kv_cache};
  nbCreators = 3;
  return creators;
}

DIFFX_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { diffx::trt::set_logger_finder(finder); }
