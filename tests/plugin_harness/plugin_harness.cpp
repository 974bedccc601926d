// Plays TensorRT's part against libdiffexport_plugins.so, so that the plugin's own code runs where
// no TensorRT engine can (issue 44, item 4). It loads the library the way TensorRT does (dlopen,
// setLoggerFinder, getCreators) and calls every IPluginV3 method a builder and a runtime call, in
// their order, through TensorRT's public headers only: it includes nothing of the plugin's.
//
//   plugin_harness LIB api              the interface checks; launches nothing, so no GPU needed
//   plugin_harness LIB run CASE OUTPUT  one case through build, serialisation and runtime, then
//                                       two enqueues (the build-time clone and the plugin rebuilt
//                                       from its serialised fields); OUTPUT gets the second's bytes
//
// CASE is a text file written by tests/test_plugin_harness.py (one line each):
//   version 1|2
//   field NAME i|f VALUE          (as the ONNX parser hands attributes over: int32 or float32)
//   input INDEX TYPE NDIMS D... FILE    (TYPE: float half bf16 int64; FILE raw bytes beside CASE)
//   output TYPE NDIMS D...
//   min_q_len N                   (the profile's smallest query length; sizes the workspace)
// Every check prints "ok: ..." or "FAIL: ..."; the exit status is the number of failures (at most
// 100), 2 for a usage or input error. Not part of the plugin library and never installed.
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {

int g_failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

// ------------------------------------------------------------------ what TensorRT hands a plugin

// The logger TensorRT gives through setLoggerFinder: records every line.
class RecordingLogger final : public ILogger {
 public:
  void log(Severity severity, const char* msg) noexcept override {
    lines.emplace_back(msg ? msg : "");
    if (severity <= Severity::kERROR) ++errors;
  }
  std::vector<std::string> lines;
  int errors = 0;
  std::string last() const { return lines.empty() ? "" : lines.back(); }
};

class Finder final : public ILoggerFinder {
 public:
  explicit Finder(ILogger* logger) : logger_(logger) {}
  ILogger* findLogger() noexcept override { return logger_; }

 private:
  ILogger* logger_;
};

class RecordingErrorRecorder final : public IErrorRecorder {
 public:
  int32_t getNbErrors() const noexcept override { return int32_t(errors_.size()); }
  ErrorCode getErrorCode(int32_t i) const noexcept override { return errors_.at(size_t(i)).first; }
  ErrorDesc getErrorDesc(int32_t i) const noexcept override { return errors_.at(size_t(i)).second.c_str(); }
  bool hasOverflowed() const noexcept override { return false; }
  void clear() noexcept override { errors_.clear(); }
  bool reportError(ErrorCode code, ErrorDesc desc) noexcept override {
    errors_.emplace_back(code, desc ? desc : "");
    return false;  // not fatal: the harness goes on
  }
  RefCount incRefCount() noexcept override { return ++refs_; }
  RefCount decRefCount() noexcept override { return --refs_; }

 private:
  std::vector<std::pair<ErrorCode, std::string>> errors_;
  RefCount refs_ = 0;
};

class ResourceContext final : public IPluginResourceContext {
 public:
  explicit ResourceContext(IErrorRecorder* recorder) : recorder_(recorder) {}
  IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
  IErrorRecorder* getErrorRecorder() const noexcept override { return recorder_; }

 private:
  IErrorRecorder* recorder_;
};

// Dimension expressions: constants, symbols (a runtime dimension) and the operations TensorRT has.
class Expr final : public IDimensionExpr {
 public:
  struct Impl final : apiv::VDimensionExpr {
    bool constant = true;
    int64_t value = 0;
    bool isConstant() const override { return constant; }
    int64_t getConstantValue() const override { return constant ? value : INT64_MIN; }
    bool isSizeTensor() const override { return false; }
  };
  Expr(bool constant, int64_t value) {
    impl_.constant = constant;
    impl_.value = value;
    mImpl = &impl_;
  }

 private:
  Impl impl_;
};

class ExprBuilder final : public IExprBuilder {
 public:
  struct Impl final : apiv::VExprBuilder {
    std::vector<std::unique_ptr<Expr>>* pool = nullptr;
    const IDimensionExpr* constant(int64_t value) override { return make(true, value); }
    const IDimensionExpr* operation(DimensionOperation op, const IDimensionExpr& a, const IDimensionExpr& b) override {
      if (!a.isConstant() || !b.isConstant()) return make(false, 0);
      const int64_t x = a.getConstantValue(), y = b.getConstantValue();
      switch (op) {
        case DimensionOperation::kSUM: return make(true, x + y);
        case DimensionOperation::kPROD: return make(true, x * y);
        case DimensionOperation::kMAX: return make(true, std::max(x, y));
        case DimensionOperation::kMIN: return make(true, std::min(x, y));
        case DimensionOperation::kSUB: return make(true, x - y);
        default: return y ? make(true, x / y) : nullptr;
      }
    }
    const IDimensionExpr* declareSizeTensor(int32_t, const IDimensionExpr&, const IDimensionExpr&) override {
      return nullptr;  // this plugin has no size tensors
    }
    const IDimensionExpr* make(bool constant, int64_t value) {
      pool->push_back(std::make_unique<Expr>(constant, value));
      return pool->back().get();
    }
  };
  ExprBuilder() {
    impl_.pool = &pool_;
    mImpl = &impl_;
  }
  const IDimensionExpr* symbol() { return impl_.make(false, 0); }

 private:
  std::vector<std::unique_ptr<Expr>> pool_;
  Impl impl_;
};

// ---------------------------------------------------------------------------- the library

using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
using SetLoggerFinder = void (*)(ILoggerFinder*);

struct Library {
  void* handle = nullptr;
  std::vector<IPluginCreatorV3One*> creators;
};

bool load(const char* path, ILoggerFinder* finder, Library* lib) {
  lib->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib->handle) {
    std::fprintf(stderr, "error: cannot load %s: %s\n", path, dlerror());
    return false;
  }
  auto get_creators = reinterpret_cast<GetCreators>(dlsym(lib->handle, "getCreators"));
  auto set_finder = reinterpret_cast<SetLoggerFinder>(dlsym(lib->handle, "setLoggerFinder"));
  check(get_creators && set_finder, "the library exports getCreators and setLoggerFinder");
  if (!get_creators || !set_finder) return false;
  set_finder(finder);
  int32_t n = -1;
  IPluginCreatorInterface* const* list = get_creators(n);
  check(list && n == 3, "getCreators lists 3 creators (versions 1, 2 and 3), got " + std::to_string(n));
  for (int32_t i = 0; list && i < n; ++i) {
    const InterfaceInfo info = list[i]->getInterfaceInfo();
    const bool v3 = info.kind && std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0 && info.major == 1;
    check(v3, std::string("creator ") + std::to_string(i) + " is an IPluginCreatorV3One (" + (info.kind ? info.kind : "?") + ")");
    if (v3) lib->creators.push_back(static_cast<IPluginCreatorV3One*>(list[i]));
  }
  int32_t again = -1;
  check(get_creators(again) == list && again == n, "a second getCreators hands the same creators");
  return lib->creators.size() == 3;
}

IPluginCreatorV3One* creator_for(const Library& lib, const std::string& version) {
  for (IPluginCreatorV3One* c : lib.creators)
    if (std::string(c->getPluginName()) == "DiffAttention" && version == c->getPluginVersion() &&
        std::string(c->getPluginNamespace()) == "diffexport")
      return c;
  return nullptr;
}

// Fields as TensorRT's ONNX parser hands attributes over; the values live in the object.
class Fields {
 public:
  void set_int(const std::string& name, int32_t v, PluginFieldType type = PluginFieldType::kINT32) {
    entries_.push_back({name, type, {}});
    auto& bytes = entries_.back().bytes;
    if (type == PluginFieldType::kINT64) {
      const int64_t w = v;
      bytes.assign(reinterpret_cast<const char*>(&w), reinterpret_cast<const char*>(&w) + 8);
    } else {
      bytes.assign(reinterpret_cast<const char*>(&v), reinterpret_cast<const char*>(&v) + 4);
    }
  }
  void set_float(const std::string& name, float v) {
    entries_.push_back({name, PluginFieldType::kFLOAT32, {}});
    entries_.back().bytes.assign(reinterpret_cast<const char*>(&v), reinterpret_cast<const char*>(&v) + 4);
  }
  void set_chars(const std::string& name, const std::string& text) {
    entries_.push_back({name, PluginFieldType::kCHAR, std::vector<char>(text.begin(), text.end())});
  }
  void remove(const std::string& name) {
    for (size_t i = 0; i < entries_.size(); ++i)
      if (entries_[i].name == name) entries_.erase(entries_.begin() + long(i--));
  }
  const PluginFieldCollection* collection() {
    fields_.clear();
    for (auto& e : entries_) {
      const int32_t length = e.type == PluginFieldType::kCHAR ? int32_t(e.bytes.size()) : 1;
      fields_.emplace_back(e.name.c_str(), e.bytes.data(), e.type, length);
    }
    fc_.nbFields = int32_t(fields_.size());
    fc_.fields = fields_.data();
    return &fc_;
  }

 private:
  struct Entry {
    std::string name;
    PluginFieldType type;
    std::vector<char> bytes;
  };
  std::vector<Entry> entries_;
  std::vector<PluginField> fields_;
  PluginFieldCollection fc_{};
};

Fields v1_fields(int heads, int kv_heads, int head_dim) {
  Fields f;
  f.set_int("variant", 1);
  f.set_int("num_heads", heads);
  f.set_int("num_kv_heads", kv_heads);
  f.set_int("head_dim", head_dim);
  f.set_int("causal", 1);
  f.set_float("scale", 0.f);
  f.set_int("norm", 1);
  f.set_float("norm_eps", 1e-5f);
  f.set_float("output_scale", 0.8f);
  return f;
}

struct Capabilities {
  IPluginV3OneCore* core = nullptr;
  IPluginV3OneBuild* build = nullptr;
  IPluginV3OneRuntime* runtime = nullptr;
};

Capabilities capabilities(IPluginV3* plugin) {
  Capabilities c;
  c.core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
  c.build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
  c.runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  return c;
}

Dims dims(std::initializer_list<int64_t> values) {
  Dims d{};
  d.nbDims = int32_t(values.size());
  int i = 0;
  for (int64_t v : values) d.d[i++] = v;
  return d;
}

PluginTensorDesc desc(const Dims& d, DataType type, TensorFormat format = TensorFormat::kLINEAR) {
  PluginTensorDesc t{};
  t.dims = d;
  t.type = type;
  t.format = format;
  t.scale = 1.f;
  return t;
}

DynamicPluginTensorDesc dynamic(const PluginTensorDesc& t, const Dims& min, const Dims& max) {
  DynamicPluginTensorDesc d{};
  d.desc = t;
  d.min = min;
  d.opt = t.dims;
  d.max = max;
  return d;
}

std::string serialised_bytes(const PluginFieldCollection* fc) {
  std::string out;
  for (int32_t i = 0; fc && i < fc->nbFields; ++i) {
    const PluginField& f = fc->fields[i];
    const size_t size = f.type == PluginFieldType::kFLOAT32 || f.type == PluginFieldType::kINT32 ? 4 : 1;
    out += std::string(f.name) + "=" + std::string(static_cast<const char*>(f.data), size * size_t(f.length)) + ";";
  }
  return out;
}

// ------------------------------------------------------------------------------ api checks

// The plugin V1 [4 heads on 2 kv groups, head dim 64] at one shape: the tensors TensorRT would describe.
struct Shapes {
  std::vector<PluginTensorDesc> in;
  PluginTensorDesc out;
};

// The build-time descriptors of fixed shapes (min = opt = max): the inputs, then the output.
struct FixedDescs {
  std::vector<DynamicPluginTensorDesc> in;
  DynamicPluginTensorDesc out;
};

FixedDescs fixed(const Shapes& s) {
  FixedDescs f;
  for (auto& t : s.in) f.in.push_back(dynamic(t, t.dims, t.dims));
  f.out = dynamic(s.out, s.out.dims, s.out.dims);
  return f;
}

Shapes v1_shapes(DataType type, int64_t B, int64_t Sq, int64_t Skv, bool key_mask) {
  const int64_t H = 4, Hkv = 2, D = 64, Dv = 128;
  Shapes s;
  s.in = {desc(dims({B, Sq, 2 * H * D}), type), desc(dims({B, Skv, 2 * Hkv * D}), type),
          desc(dims({B, Skv, Hkv * Dv}), type), desc(dims({1}), type), desc(dims({Dv}), DataType::kFLOAT)};
  if (key_mask) s.in.push_back(desc(dims({B, Skv}), DataType::kINT64));
  s.out = desc(dims({B, Sq, H * Dv}), type);
  return s;
}

bool expect_refused(IPluginCreatorV3One* creator, Fields fields, RecordingLogger& log, const std::string& what,
                    const std::string& reason_part) {
  const int before = log.errors;
  IPluginV3* p = creator->createPlugin("harness_layer", fields.collection(), TensorRTPhase::kBUILD);
  const bool refused = p == nullptr && log.errors == before + 1 &&
                       log.last().find(reason_part) != std::string::npos &&
                       log.last().find("harness_layer") != std::string::npos;
  check(refused, "createPlugin refuses " + what + " with one logged line naming the layer (" + log.last() + ")");
  delete p;
  return refused;
}

void api_checks(const Library& lib, RecordingLogger& log) {
  IPluginCreatorV3One* c1 = creator_for(lib, "1");
  IPluginCreatorV3One* c2 = creator_for(lib, "2");
  IPluginCreatorV3One* c3 = creator_for(lib, "3");
  check(c1 && c2 && c3, "creators DiffAttention/1, /2 and /3 in namespace diffexport");
  if (!c1 || !c2 || !c3) return;

  const PluginFieldCollection* names = c1->getFieldNames();
  std::string listed;
  for (int32_t i = 0; names && i < names->nbFields; ++i) listed += std::string(names->fields[i].name) + " ";
  check(names && names->nbFields == 11 && listed.find("logit_bits") != std::string::npos,
        "getFieldNames lists the contract's 11 fields: " + listed);

  // Good fields, in every integer and float width the ONNX parser may use.
  Fields good = v1_fields(4, 2, 64);
  IPluginV3* plugin = c1->createPlugin("harness_layer", good.collection(), TensorRTPhase::kBUILD);
  check(plugin != nullptr, "createPlugin accepts good V1 fields");
  if (!plugin) return;
  Fields wide = v1_fields(4, 2, 64);
  wide.remove("causal");
  wide.set_int("causal", 0, PluginFieldType::kINT64);
  IPluginV3* from_int64 = c1->createPlugin("harness_layer", wide.collection(), TensorRTPhase::kBUILD);
  check(from_int64 != nullptr, "createPlugin accepts an int64 field");
  delete from_int64;

  // Refusals: each with its reason in the logger.
  {
    Fields f = v1_fields(4, 2, 64);
    f.set_int("window", 3);
    expect_refused(c1, f, log, "an unknown field", "window");
  }
  expect_refused(c1, v1_fields(4, 2, 96), log, "a head dim the kernel lacks", "head_dim");
  expect_refused(c1, v1_fields(4, 3, 64), log, "kv heads that do not divide the heads", "num_kv_heads");
  {
    Fields f = v1_fields(4, 2, 64);
    f.remove("num_heads");
    expect_refused(c1, f, log, "a missing required field", "num_heads");
  }
  {
    Fields f = v1_fields(4, 2, 64);
    f.remove("scale");
    f.set_float("scale", std::nanf(""));
    expect_refused(c1, f, log, "a NaN scale", "scale");
  }
  {
    Fields f = v1_fields(4, 2, 64);
    f.set_chars("logit_bits", "8");
    expect_refused(c1, f, log, "a field of the wrong type", "logit_bits");
  }
  {
    Fields f = v1_fields(4, 2, 64);
    f.set_int("logit_bits", 5);
    expect_refused(c1, f, log, "logit_bits 5", "logit_bits");
  }
  {
    Fields f = v1_fields(4, 2, 64);
    f.set_int("causal", 0);
    expect_refused(c1, f, log, "a duplicated field", "causal");
  }
  const int before_null = log.errors;
  check(c1->createPlugin("harness_layer", nullptr, TensorRTPhase::kBUILD) == nullptr && log.errors == before_null + 1,
        "createPlugin refuses a null field collection");

  // Capabilities and identity.
  Capabilities cap = capabilities(plugin);
  check(cap.core && cap.build && cap.runtime, "getCapabilityInterface hands core, build and runtime");
  check(cap.core && std::string(cap.core->getPluginName()) == "DiffAttention" &&
            std::string(cap.core->getPluginVersion()) == "1" &&
            std::string(cap.core->getPluginNamespace()) == "diffexport",
        "core: name DiffAttention, version 1, namespace diffexport");
  check(cap.build->getNbOutputs() == 1, "getNbOutputs is 1");
  const std::string timing_id = cap.build->getTimingCacheID() ? cap.build->getTimingCacheID() : "";
  check(timing_id.find("num_heads=4") != std::string::npos, "getTimingCacheID names the fields: " + timing_id);

  // Output types: the query's.
  for (DataType t : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT}) {
    DataType in[5] = {t, t, t, t, DataType::kFLOAT}, out = DataType::kINT8;
    check(cap.build->getOutputDataTypes(&out, 1, in, 5) == 0 && out == t,
          "getOutputDataTypes: output type is query's (" + std::to_string(int(t)) + ")");
  }
  DataType in6[6] = {}, out6 = DataType::kFLOAT;
  check(cap.build->getOutputDataTypes(&out6, 1, in6, 6) != 0, "getOutputDataTypes refuses 6 inputs on version 1");

  // Output shapes through an expression builder: batch and length pass through (also as runtime
  // symbols), the width is the constant H*Dv.
  {
    ExprBuilder builder;
    DimsExprs in[5]{};
    const IDimensionExpr* batch = builder.symbol();
    const IDimensionExpr* q_len = builder.symbol();
    const int64_t widths[5][3] = {{0, 0, 512}, {0, 0, 256}, {0, 0, 256}, {1, 0, 0}, {128, 0, 0}};
    for (int i = 0; i < 5; ++i) {
      in[i].nbDims = i < 3 ? 3 : 1;
      if (i < 3) {
        in[i].d[0] = batch;
        in[i].d[1] = i == 0 ? q_len : builder.symbol();
        in[i].d[2] = builder.constant(widths[i][2]);
      } else {
        in[i].d[0] = builder.constant(widths[i][0]);
      }
    }
    DimsExprs out{};
    const int rc = cap.build->getOutputShapes(in, 5, nullptr, 0, &out, 1, builder);
    check(rc == 0 && out.nbDims == 3 && out.d[0] == batch && out.d[1] == q_len && out.d[2]->isConstant() &&
              out.d[2]->getConstantValue() == 4 * 128,
          "getOutputShapes: [batch, q_len, num_heads*Dv = 512] from runtime batch and length");
    DimsExprs flat[5] = {in[0], in[1], in[2], in[3], in[4]};
    flat[0].nbDims = 2;
    const int before = log.errors;
    check(cap.build->getOutputShapes(flat, 5, nullptr, 0, &out, 1, builder) != 0 && log.errors == before + 1,
          "getOutputShapes refuses a 2-D query with a logged reason");
  }

  // supportsFormatCombination over every type and format at every position, the others good.
  {
    Shapes s = v1_shapes(DataType::kHALF, 2, 17, 33, false);
    std::vector<DynamicPluginTensorDesc> io;
    for (auto& t : s.in) io.push_back(dynamic(t, t.dims, t.dims));
    io.push_back(dynamic(s.out, s.out.dims, s.out.dims));
    int wrong = 0, tried = 0;
    std::string first_wrong;
    for (int query_type : {int(DataType::kHALF), int(DataType::kBF16), int(DataType::kFLOAT)}) {
      for (int pos = 0; pos < 6; ++pos) {
        for (int type = 0; type < nvinfer1::EnumMax<DataType>(); ++type) {
          for (int format = 0; format < nvinfer1::EnumMax<TensorFormat>(); ++format) {
            std::vector<DynamicPluginTensorDesc> probe = io;
            for (int i = 0; i < 6; ++i)
              if (i != 4) probe[size_t(i)].desc.type = DataType(query_type);
            probe[size_t(pos)].desc.type = DataType(type);
            probe[size_t(pos)].desc.format = TensorFormat(format);
            const bool linear = format == int(TensorFormat::kLINEAR);
            bool expected;
            if (pos == 0) expected = linear && (type == int(DataType::kHALF) || type == int(DataType::kBF16) ||
                                                type == int(DataType::kFLOAT));
            else if (pos == 4) expected = linear && type == int(DataType::kFLOAT);
            else expected = linear && type == query_type;
            const bool got = cap.build->supportsFormatCombination(pos, probe.data(), 5, 1);
            ++tried;
            if (got != expected) {
              if (!wrong++)
                first_wrong = "pos " + std::to_string(pos) + " type " + std::to_string(type) + " format " +
                              std::to_string(format) + (got ? " accepted" : " refused");
            }
          }
        }
      }
    }
    check(wrong == 0, "supportsFormatCombination: " + std::to_string(tried) + " combinations as documented" +
                          (wrong ? ", first wrong: " + first_wrong : ""));
    check(!cap.build->supportsFormatCombination(6, io.data(), 5, 1) &&
              !cap.build->supportsFormatCombination(-1, io.data(), 5, 1),
          "supportsFormatCombination refuses positions out of range");
  }

  // configurePlugin, getWorkspaceSize: good and bad shapes; -1 (unknown) dims at build time.
  {
    Shapes s = v1_shapes(DataType::kHALF, 2, 17, 33, false);
    auto [in, out] = fixed(s);
    check(cap.build->configurePlugin(in.data(), 5, &out, 1) == 0, "configurePlugin accepts good shapes");
    std::vector<DynamicPluginTensorDesc> unknown = in;
    unknown[0].desc.dims.d[1] = -1;
    unknown[1].desc.dims.d[1] = -1;
    unknown[2].desc.dims.d[1] = -1;
    check(cap.build->configurePlugin(unknown.data(), 5, &out, 1) == 0, "configurePlugin accepts -1 lengths");
    std::vector<DynamicPluginTensorDesc> bad = in;
    bad[0].desc.dims.d[2] = 500;
    int before = log.errors;
    bool refused = cap.build->configurePlugin(bad.data(), 5, &out, 1) != 0 && log.errors == before + 1 &&
                   log.last().find("query width") != std::string::npos;
    check(refused, "configurePlugin refuses a wrong query width: " + log.last());
    bad = in;
    bad[2].desc.dims.d[1] = 34;
    before = log.errors;
    refused = cap.build->configurePlugin(bad.data(), 5, &out, 1) != 0 && log.errors == before + 1 &&
              log.last().find("lengths differ") != std::string::npos;
    check(refused, "configurePlugin refuses key and value lengths that differ: " + log.last());
    check(cap.build->configurePlugin(in.data(), 4, &out, 1) != 0, "configurePlugin refuses 4 inputs");
    check(cap.build->getWorkspaceSize(in.data(), 5, &out, 1) == 0,
          "getWorkspaceSize: 0 for fp16 prefill shapes (no decode rows in the profile)");
    // A profile that reaches decode-sized queries needs the split-KV partial states.
    std::vector<DynamicPluginTensorDesc> decode = in;
    decode[0].min.d[1] = 1;
    const size_t ws = cap.build->getWorkspaceSize(decode.data(), 5, &out, 1);
    check(ws > 0, "getWorkspaceSize: " + std::to_string(ws) + " bytes when the profile reaches 1-token queries");
  }
  {
    Fields f = v1_fields(4, 2, 64);
    f.set_int("logit_bits", 8);
    IPluginV3* int8 = c1->createPlugin("harness_layer", f.collection(), TensorRTPhase::kBUILD);
    check(int8 != nullptr, "createPlugin accepts logit_bits 8");
    if (int8) {
      Shapes s = v1_shapes(DataType::kBF16, 2, 100, 300, false);
      auto [in, out] = fixed(s);
      const size_t ws = capabilities(int8).build->getWorkspaceSize(in.data(), 5, &out, 1);
      check(ws > 0, "getWorkspaceSize: " + std::to_string(ws) + " bytes for INT8 logits");
      delete int8;
    }
  }

  // Serialisation round trip: the runtime plugin rebuilt from getFieldsToSerialize serialises the same.
  {
    const PluginFieldCollection* fc = cap.runtime->getFieldsToSerialize();
    check(fc && fc->nbFields == 11, "getFieldsToSerialize writes 11 fields");
    IPluginV3* again = c1->createPlugin("harness_layer", fc, TensorRTPhase::kRUNTIME);
    check(again != nullptr, "createPlugin(kRUNTIME) accepts the serialised fields");
    if (again) {
      check(serialised_bytes(capabilities(again).runtime->getFieldsToSerialize()) == serialised_bytes(fc),
            "the rebuilt plugin serialises byte for byte the same");
      delete again;
    }
    if (fc && fc->nbFields == 11) {
      PluginFieldCollection truncated{fc->nbFields - 10, fc->fields};  // only 'variant'
      const int before = log.errors;
      const bool refused = c1->createPlugin("harness_layer", &truncated, TensorRTPhase::kRUNTIME) == nullptr &&
                           log.errors == before + 1 && log.last().find("missing") != std::string::npos;
      check(refused, "truncated plugin data is refused: " + log.last());
    }
  }

  // clone, attachToContext, onShapeChange and enqueue's refusals reach the context's error recorder.
  {
    IPluginV3* copy = plugin->clone();
    check(copy && serialised_bytes(capabilities(copy).runtime->getFieldsToSerialize()) ==
                      serialised_bytes(cap.runtime->getFieldsToSerialize()),
          "clone serialises the same fields");
    RecordingErrorRecorder recorder;
    ResourceContext context(&recorder);
    IPluginV3* attached = copy ? capabilities(copy).runtime->attachToContext(&context) : nullptr;
    check(attached != nullptr, "attachToContext hands a plugin");
    if (attached) {
      IPluginV3OneRuntime* rt = capabilities(attached).runtime;
      Shapes s = v1_shapes(DataType::kHALF, 2, 17, 33, false);
      check(rt->onShapeChange(s.in.data(), 5, &s.out, 1) == 0 && recorder.getNbErrors() == 0,
            "onShapeChange accepts good shapes");
      Shapes bad = s;
      bad.in[3].dims = dims({2});
      const bool refused = rt->onShapeChange(bad.in.data(), 5, &bad.out, 1) != 0 && recorder.getNbErrors() == 1 &&
                           std::string(recorder.getErrorDesc(0)).find("lambda_full") != std::string::npos;
      check(refused, std::string("onShapeChange refuses lambda_full [2] through the error recorder: ") +
                         (recorder.getNbErrors() ? recorder.getErrorDesc(0) : ""));
      recorder.clear();
      check(rt->enqueue(s.in.data(), &s.out, nullptr, nullptr, nullptr, nullptr) != 0 && recorder.getNbErrors() == 1,
            "enqueue without tensors returns an error through the recorder");
      delete attached;
    }
    delete copy;
  }

  // Version 2: six inputs, the last int64 [batch, keys].
  {
    Fields f = v1_fields(4, 2, 64);
    IPluginV3* v2 = c2->createPlugin("harness_layer", f.collection(), TensorRTPhase::kBUILD);
    check(v2 != nullptr && std::string(capabilities(v2).core->getPluginVersion()) == "2", "version 2 plugin");
    if (v2) {
      IPluginV3OneBuild* b = capabilities(v2).build;
      Shapes s = v1_shapes(DataType::kBF16, 2, 1, 40, true);
      auto [in, out] = fixed(s);
      in.push_back(out);
      check(b->supportsFormatCombination(5, in.data(), 6, 1), "version 2: key_mask int64 accepted");
      in[5].desc.type = DataType::kINT32;
      check(!b->supportsFormatCombination(5, in.data(), 6, 1), "version 2: key_mask int32 refused");
      in[5].desc.type = DataType::kINT64;
      check(b->configurePlugin(in.data(), 6, &out, 1) == 0, "version 2: configurePlugin with key_mask");
      in[5].desc.dims = dims({2, 41});
      check(b->configurePlugin(in.data(), 6, &out, 1) != 0, "version 2: a key_mask longer than the keys is refused");
      check(b->configurePlugin(in.data(), 5, &out, 1) != 0, "version 2: 5 inputs refused");
      delete v2;
    }
  }

  // Version 3: eight inputs, key and value an 8-bit cache's codes (int8 or fp8, the same for both),
  // k_scale [key width] and v_scale [value width] float32.
  {
    Fields f = v1_fields(4, 2, 64);
    IPluginV3* v3 = c3->createPlugin("harness_layer", f.collection(), TensorRTPhase::kBUILD);
    check(v3 != nullptr && std::string(capabilities(v3).core->getPluginVersion()) == "3", "version 3 plugin");
    if (v3) {
      IPluginV3OneBuild* b = capabilities(v3).build;
      Shapes s = v1_shapes(DataType::kBF16, 2, 1, 40, true);
      s.in[1].type = s.in[2].type = DataType::kINT8;
      s.in.push_back(desc(dims({2 * 2 * 64}), DataType::kFLOAT));
      s.in.push_back(desc(dims({2 * 128}), DataType::kFLOAT));
      auto [in, out] = fixed(s);
      in.push_back(out);
      bool all = true;
      for (int pos = 0; pos <= 8; ++pos) all = all && b->supportsFormatCombination(pos, in.data(), 8, 1);
      check(all, "version 3: int8 key and value, float32 scales accepted at every position");
      in[1].desc.type = in[2].desc.type = DataType::kFP8;
      check(b->supportsFormatCombination(1, in.data(), 8, 1) && b->supportsFormatCombination(2, in.data(), 8, 1),
            "version 3: fp8 key and value accepted");
      in[2].desc.type = DataType::kINT8;
      check(!b->supportsFormatCombination(2, in.data(), 8, 1), "version 3: a value of another code type refused");
      in[1].desc.type = DataType::kBF16;
      check(!b->supportsFormatCombination(1, in.data(), 8, 1), "version 3: a bf16 key refused (codes only)");
      in[1].desc.type = DataType::kINT8;
      in[6].desc.type = DataType::kHALF;
      check(!b->supportsFormatCombination(6, in.data(), 8, 1), "version 3: an fp16 k_scale refused");
      in[6].desc.type = DataType::kFLOAT;
      check(b->configurePlugin(in.data(), 8, &out, 1) == 0, "version 3: configurePlugin");
      check(b->getWorkspaceSize(in.data(), 8, &out, 1) > 0, "version 3: a decode call's workspace");
      in[6].desc.dims = dims({128});
      check(b->configurePlugin(in.data(), 8, &out, 1) != 0, "version 3: a k_scale narrower than the key refused");
      check(b->configurePlugin(in.data(), 6, &out, 1) != 0, "version 3: 6 inputs refused");
      delete v3;
    }
  }
  delete plugin;
}

// ------------------------------------------------------------------------------ one case

struct Tensor {
  DataType type = DataType::kFLOAT;
  Dims shape{};
  std::vector<char> host;
  void* device = nullptr;
  size_t bytes() const {
    size_t n = type == DataType::kFLOAT ? 4 : type == DataType::kINT64 ? 8
               : type == DataType::kINT8 || type == DataType::kFP8 ? 1 : 2;
    for (int i = 0; i < shape.nbDims; ++i) n *= size_t(shape.d[i]);
    return n;
  }
};

bool parse_type(const std::string& name, DataType* type) {
  if (name == "float") *type = DataType::kFLOAT;
  else if (name == "half") *type = DataType::kHALF;
  else if (name == "bf16") *type = DataType::kBF16;
  else if (name == "int64") *type = DataType::kINT64;
  else if (name == "int8") *type = DataType::kINT8;  // an 8-bit KV cache's codes (version 3)
  else if (name == "fp8") *type = DataType::kFP8;
  else return false;
  return true;
}

bool cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) std::fprintf(stderr, "error: %s: %s\n", what, cudaGetErrorString(err));
  return err == cudaSuccess;
}

int run_case(const Library& lib, RecordingLogger& log, const std::string& case_path, const std::string& output_path) {
  std::ifstream in(case_path);
  if (!in) {
    std::fprintf(stderr, "error: cannot read %s\n", case_path.c_str());
    return 2;
  }
  const std::string folder = case_path.substr(0, case_path.find_last_of('/') + 1);
  std::string version = "1";
  Fields fields;
  std::vector<Tensor> inputs;
  Tensor output;
  int64_t min_q_len = -1;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind;
    words >> kind;
    if (kind == "version") {
      words >> version;
    } else if (kind == "field") {
      std::string name, type;
      words >> name >> type;
      if (type == "i") {
        int32_t v;
        words >> v;
        fields.set_int(name, v);
      } else {
        float v;
        words >> v;
        fields.set_float(name, v);
      }
    } else if (kind == "input" || kind == "output") {
      Tensor t;
      std::string type, file;
      int index = 0;
      if (kind == "input") words >> index;
      words >> type >> t.shape.nbDims;
      if (!parse_type(type, &t.type) || t.shape.nbDims < 1 || t.shape.nbDims > 3) {
        std::fprintf(stderr, "error: bad tensor line: %s\n", line.c_str());
        return 2;
      }
      for (int i = 0; i < t.shape.nbDims; ++i) words >> t.shape.d[i];
      if (kind == "output") {
        output = t;
        continue;
      }
      words >> file;
      std::ifstream data(folder + file, std::ios::binary);
      t.host.resize(t.bytes());
      if (!data.read(t.host.data(), std::streamsize(t.host.size()))) {
        std::fprintf(stderr, "error: %s holds fewer than %zu bytes\n", file.c_str(), t.bytes());
        return 2;
      }
      if (index != int(inputs.size())) {
        std::fprintf(stderr, "error: inputs out of order\n");
        return 2;
      }
      inputs.push_back(std::move(t));
    } else if (kind == "min_q_len") {
      words >> min_q_len;
    }
  }
  const int n_in = int(inputs.size());
  IPluginCreatorV3One* creator = creator_for(lib, version);
  check(creator != nullptr, "creator for version " + version);
  if (!creator) return 1;

  // Build phase, as the builder does it: create, types, shapes, formats, configure, workspace.
  IPluginV3* built = creator->createPlugin("harness_layer", fields.collection(), TensorRTPhase::kBUILD);
  check(built != nullptr, "createPlugin (build) accepts the case's fields: " + log.last());
  if (!built) return 1;
  Capabilities b = capabilities(built);
  std::vector<DataType> in_types;
  for (auto& t : inputs) in_types.push_back(t.type);
  DataType out_type = DataType::kINT8;
  check(b.build->getOutputDataTypes(&out_type, 1, in_types.data(), n_in) == 0 && out_type == output.type,
        "getOutputDataTypes gives the output's type");
  {
    ExprBuilder builder;
    std::vector<DimsExprs> exprs(static_cast<size_t>(n_in), DimsExprs{});
    for (int i = 0; i < n_in; ++i) {
      exprs[size_t(i)].nbDims = inputs[size_t(i)].shape.nbDims;
      for (int j = 0; j < inputs[size_t(i)].shape.nbDims; ++j)
        exprs[size_t(i)].d[j] = builder.constant(inputs[size_t(i)].shape.d[j]);
    }
    DimsExprs out{};
    bool same = b.build->getOutputShapes(exprs.data(), n_in, nullptr, 0, &out, 1, builder) == 0 &&
                out.nbDims == output.shape.nbDims;
    for (int j = 0; same && j < out.nbDims; ++j)
      same = out.d[j]->isConstant() && out.d[j]->getConstantValue() == output.shape.d[j];
    check(same, "getOutputShapes gives the output's shape");
  }
  std::vector<DynamicPluginTensorDesc> dyn;
  for (auto& t : inputs) {
    PluginTensorDesc d = desc(t.shape, t.type);
    Dims min = t.shape;
    if (min_q_len > 0 && &t == &inputs[0]) min.d[1] = min_q_len;
    dyn.push_back(dynamic(d, min, t.shape));
  }
  DynamicPluginTensorDesc out_dyn = dynamic(desc(output.shape, output.type), output.shape, output.shape);
  std::vector<DynamicPluginTensorDesc> io = dyn;
  io.push_back(out_dyn);
  bool formats = true;
  for (int pos = 0; pos <= n_in; ++pos) formats = formats && b.build->supportsFormatCombination(pos, io.data(), n_in, 1);
  check(formats, "supportsFormatCombination accepts the case's types at every position");
  check(b.build->configurePlugin(dyn.data(), n_in, &out_dyn, 1) == 0, "configurePlugin");
  const size_t workspace_bytes = b.build->getWorkspaceSize(dyn.data(), n_in, &out_dyn, 1);
  std::printf("workspace: %zu bytes\n", workspace_bytes);

  // The engine is "serialised": the fields, then a runtime plugin from them, attached to a context.
  IPluginV3* clone = built->clone();
  IPluginV3* restored =
      creator->createPlugin("harness_layer", b.runtime->getFieldsToSerialize(), TensorRTPhase::kRUNTIME);
  check(clone && restored, "clone and createPlugin(kRUNTIME) from getFieldsToSerialize");
  if (!clone || !restored) return 1;
  RecordingErrorRecorder recorder;
  ResourceContext context(&recorder);
  IPluginV3* runs[2] = {capabilities(clone).runtime->attachToContext(&context),
                        capabilities(restored).runtime->attachToContext(&context)};
  check(runs[0] && runs[1], "attachToContext");
  if (!runs[0] || !runs[1]) return 1;

  // Device buffers: inputs copied, the workspace poisoned, the output filled with NaN bytes (0xFF).
  std::vector<PluginTensorDesc> in_desc;
  std::vector<const void*> in_ptrs;
  for (auto& t : inputs) {
    if (!cuda_ok(cudaMalloc(&t.device, t.bytes()), "cudaMalloc") ||
        !cuda_ok(cudaMemcpy(t.device, t.host.data(), t.bytes(), cudaMemcpyHostToDevice), "cudaMemcpy"))
      return 2;
    in_desc.push_back(desc(t.shape, t.type));
    in_ptrs.push_back(t.device);
  }
  PluginTensorDesc out_desc = desc(output.shape, output.type);
  void* workspace = nullptr;
  if (workspace_bytes && !cuda_ok(cudaMalloc(&workspace, workspace_bytes), "cudaMalloc workspace")) return 2;
  if (workspace) cudaMemset(workspace, 0xFF, workspace_bytes);
  cudaStream_t stream;
  if (!cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate") ||
      !cuda_ok(cudaMalloc(&output.device, output.bytes()), "cudaMalloc output"))
    return 2;
  std::vector<std::vector<char>> results(2, std::vector<char>(output.bytes()));
  for (int r = 0; r < 2; ++r) {
    IPluginV3OneRuntime* rt = capabilities(runs[r]).runtime;
    check(rt->onShapeChange(in_desc.data(), n_in, &out_desc, 1) == 0, "onShapeChange");
    cudaMemset(output.device, 0xFF, output.bytes());
    void* outs[1] = {output.device};
    const int32_t rc = rt->enqueue(in_desc.data(), &out_desc, in_ptrs.data(), outs, workspace, stream);
    const bool synced = cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    check(rc == 0 && synced, std::string("enqueue (") + (r ? "restored" : "clone") + ") returns 0" +
                                 (recorder.getNbErrors() ? std::string(": ") + recorder.getErrorDesc(0) : ""));
    cudaMemcpy(results[size_t(r)].data(), output.device, output.bytes(), cudaMemcpyDeviceToHost);
  }
  check(results[0] == results[1], "the restored plugin's output equals the clone's, bit for bit");
  check(recorder.getNbErrors() == 0 && log.errors == 0, "no error recorded or logged");
  std::ofstream out(output_path, std::ios::binary);
  out.write(results[1].data(), std::streamsize(results[1].size()));
  for (IPluginV3* p : {runs[0], runs[1], clone, restored, built}) delete p;
  for (auto& t : inputs) cudaFree(t.device);
  cudaFree(output.device);
  cudaFree(workspace);
  cudaStreamDestroy(stream);
  return out ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || (std::string(argv[2]) == "run" && argc != 5) ||
      (std::string(argv[2]) != "api" && std::string(argv[2]) != "run")) {
    std::fprintf(stderr, "usage: %s LIB api | %s LIB run CASE OUTPUT\n", argv[0], argv[0]);
    return 2;
  }
  RecordingLogger log;
  Finder finder(&log);
  Library lib;
  if (!load(argv[1], &finder, &lib)) return 2;
  int rc = 0;
  if (std::string(argv[2]) == "api") {
    api_checks(lib, log);
  } else {
    rc = run_case(lib, log, argv[3], argv[4]);
  }
  std::printf("%d check(s) failed\n", g_failures);
  if (rc) return rc;
  return g_failures > 100 ? 100 : g_failures;
}
