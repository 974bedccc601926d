"""Writes plugins/tensorrt/generated/contract_fields.h from diffexport/core/contract.py.

The TensorRT plugin takes its name, version, namespace, input order and field list (names,
types, defaults, ranges) from this header, so the plugin and the ONNX contract cannot drift:
tests/test_plugin_fields.py regenerates it and fails when the committed file differs.
Run `python tools/gen_plugin_fields.py` after changing the contract.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffexport.core import contract  # noqa: E402

OUTPUT = ROOT / "plugins" / "tensorrt" / "generated" / "contract_fields.h"


def _c_number(value) -> str:
    return repr(float(value)) if value is not None else "0.0"


def render() -> str:
    lines = [
        "// Generated from diffexport/core/contract.py by tools/gen_plugin_fields.py. Do not edit: rerun the tool.",
        "#pragma once",
        "",
        "namespace diffx::contract {",
        "",
        f'constexpr char kPluginName[] = "{contract.PLUGIN_NAME}";',
        f'constexpr char kPluginVersion[] = "{contract.PLUGIN_VERSION}";',
        f'constexpr char kKeyMaskPluginVersion[] = "{contract.KEY_MASK_PLUGIN_VERSION}";  // op version 2: + key_mask',
        f'constexpr char kKvCachePluginVersion[] = "{contract.KV_CACHE_PLUGIN_VERSION}";  '
        "// op version 3: an 8-bit KV cache, + k_scale, v_scale",
        f'constexpr char kPluginNamespace[] = "{contract.PLUGIN_NAMESPACE}";',
        f'constexpr char kOnnxDomain[] = "{contract.ONNX_DOMAIN}";',
        "",
        "// Inputs in contract order (the plugin's input indices); version 2 adds the optional key_mask,",
        "// version 3 the 8-bit KV cache's scales (key and value are then its codes).",
        "enum InputIndex : int {",
    ]
    lines += [f"  kInput_{t.name} = {i}," for i, t in enumerate(contract.KV_CACHE_INPUTS)]
    lines += [f"  kNumInputs = {len(contract.INPUTS)},", f"  kNumInputsKeyMask = {len(contract.ALL_INPUTS)},",
              f"  kNumInputsKvCache = {len(contract.KV_CACHE_INPUTS)}", "};",
              f"constexpr int kNumOutputs = {len(contract.OUTPUTS)};",
              "", "enum class FieldKind { kInt, kFloat };", "",
              "struct FieldSpec {",
              "  const char* name;",
              "  FieldKind kind;",
              "  bool required;          // no default: the node must carry it",
              "  double default_value;",
              "  int num_choices;        // 0: any value allowed by the minimum",
              "  int choices[4];",
              "  bool has_minimum;",
              "  double minimum;",
              "  bool exclusive_minimum;",
              "  bool plugin_only;       // not an op attribute (ignored by the ONNX function body)",
              "};", "",
              "// Field order: the op's attributes, then the plugin-only fields (contract.PLUGIN_FIELDS).",
              "enum FieldIndex : int {"]
    lines += [f"  kField_{a.name} = {i}," for i, a in enumerate(contract.PLUGIN_FIELDS)]
    lines += [f"  kNumFields = {len(contract.PLUGIN_FIELDS)}", "};", "", "constexpr FieldSpec kFields[kNumFields] = {"]
    only = {a.name for a in contract.PLUGIN_ONLY_ATTRIBUTES}
    for a in contract.PLUGIN_FIELDS:
        if len(a.choices) > 4:
            raise SystemExit(f"{a.name}: more than 4 choices do not fit FieldSpec")
        choices = ", ".join(str(int(c)) for c in a.choices) or "0"
        kind = "FieldKind::kInt" if a.kind == "int" else "FieldKind::kFloat"
        lines.append(f'    {{"{a.name}", {kind}, {str(a.default is None).lower()}, {_c_number(a.default)}, '
                     f"{len(a.choices)}, {{{choices}}}, {str(a.minimum is not None).lower()}, "
                     f"{_c_number(a.minimum)}, {str(a.exclusive_minimum).lower()}, {str(a.name in only).lower()}}},")
    lines += ["};", "", "// Node attributes TensorRT's ONNX parser consumes to select the plugin; never plugin fields.",
              "constexpr const char* kSelectorAttributes[] = {"
              + ", ".join(f'"{n}"' for n in contract.PLUGIN_SELECTOR_ATTRIBUTES) + "};",
              f"constexpr int kNumSelectorAttributes = {len(contract.PLUGIN_SELECTOR_ATTRIBUTES)};",
              "", "}  // namespace diffx::contract", ""]
    return "\n".join(lines)


def main() -> int:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
