"""The TensorRT plugin's field list against the op contract, and a fuzz test of the field parser
the plugin creator runs for createPlugin and for deserialisation. Needs no TensorRT and no GPU:
the parser (plugins/tensorrt/plugin_fields.cpp) is built without TensorRT, by CMake or here."""

import ctypes
import math
import random
import re
from pathlib import Path

import pytest
from helpers import host_library

from diffexport.core import contract

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = ROOT / "plugins" / "tensorrt"
BUILT = ROOT / "build" / "plugins" / "tensorrt" / "libdiffexport_plugin_fields.so"
N = len(contract.PLUGIN_FIELDS)
INT32, FLOAT32, FLOAT64, INT8, INT16, INT64, CHAR, FLOAT16, UNKNOWN = 5, 1, 2, 3, 4, 10, 6, 0, 8


class RawField(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.c_void_p), ("type", ctypes.c_int32),
                ("length", ctypes.c_int32)]


@pytest.fixture(scope="module")
def parser(tmp_path_factory):
    path = host_library(tmp_path_factory, "DIFFEXPORT_PLUGIN_FIELDS_LIB", BUILT, "diffexport_plugin_fields",
                        [PLUGIN_DIR / "plugin_fields.cpp", PLUGIN_DIR / "plugin_fields_c.cpp"],
                        ["-std=c++17", f"-I{PLUGIN_DIR}"])
    lib = ctypes.CDLL(str(path))
    lib.diffx_plugin_parse_fields.argtypes = [ctypes.POINTER(RawField), ctypes.c_int32, ctypes.c_int32,
                                              ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float),
                                              ctypes.c_char_p, ctypes.c_int32]
    lib.diffx_plugin_roundtrip.argtypes = [ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)] * 2
    lib.diffx_plugin_field_name.restype = ctypes.c_char_p
    return lib


def parse(lib, fields, check=True):
    """fields: [(name, type, value or bytes, length)] -> (values dict or None, error text)."""
    keep = []
    raw = (RawField * max(1, len(fields)))()
    for i, (name, ftype, value, length) in enumerate(fields):
        if isinstance(value, bytes):
            buf = ctypes.create_string_buffer(value, max(len(value), 1))
        else:
            ctype = {INT32: ctypes.c_int32, INT8: ctypes.c_int8, INT16: ctypes.c_int16, INT64: ctypes.c_int64,
                     FLOAT32: ctypes.c_float, FLOAT64: ctypes.c_double}[ftype]
            buf = (ctype * max(1, length))(*([value] * max(1, length)))
        keep.append(buf)
        raw[i] = RawField(None if name is None else name.encode(), ctypes.cast(buf, ctypes.c_void_p), ftype, length)
    ints, floats = (ctypes.c_int32 * N)(), (ctypes.c_float * N)()
    err = ctypes.create_string_buffer(512)
    status = lib.diffx_plugin_parse_fields(raw, len(fields), int(check), ints, floats, err, 512)
    if status:
        return None, err.value.decode()
    values = {a.name: (ints[i] if a.kind == "int" else floats[i]) for i, a in enumerate(contract.PLUGIN_FIELDS)}
    return values, ""


def field(name, value):
    spec = next(a for a in contract.PLUGIN_FIELDS if a.name == name)
    return (name, INT32 if spec.kind == "int" else FLOAT32, value, 1)


REQUIRED = [field("num_heads", 4), field("num_kv_heads", 2), field("head_dim", 64)]


def test_generated_header_matches_the_contract():
    """plugins/tensorrt/generated/contract_fields.h is what tools/gen_plugin_fields.py makes of the contract."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_plugin_fields", ROOT / "tools" / "gen_plugin_fields.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = (PLUGIN_DIR / "generated" / "contract_fields.h").read_text()
    assert committed == gen.render(), "contract changed: run `python tools/gen_plugin_fields.py` and commit the header"


def test_plugin_sources_take_names_from_the_generated_header():
    """No field or plugin name is spelled out in the plugin's C++: they all come from contract_fields.h."""
    for source in ("DiffAttentionPlugin.cpp", "DiffAttentionPlugin.h", "plugin_fields.cpp", "plugin_library.cpp"):
        text = (PLUGIN_DIR / source).read_text()
        for name in (*contract.PLUGIN_FIELD_NAMES, contract.PLUGIN_NAME, contract.PLUGIN_NAMESPACE):
            assert not re.search(rf'"{name}"', text), f"{source} hard-codes \"{name}\""


def test_field_names_and_order(parser):
    names = [parser.diffx_plugin_field_name(i).decode() for i in range(parser.diffx_plugin_field_count())]
    assert names == list(contract.PLUGIN_FIELD_NAMES)
    assert names[: len(contract.ATTRIBUTES)] == list(contract.ATTRIBUTE_NAMES)


def test_defaults_and_accepted_types(parser):
    values, err = parse(parser, REQUIRED)
    assert err == ""
    for spec in contract.PLUGIN_FIELDS:
        if spec.default is not None:
            assert values[spec.name] == pytest.approx(spec.default)
    # what TensorRT's ONNX parser hands over: INT32 for ints, FLOAT32 for floats; wider types are accepted too
    values, err = parse(parser, [("num_heads", INT64, 8, 1), ("num_kv_heads", INT8, 2, 1), ("head_dim", INT16, 128, 1),
                                 ("scale", FLOAT64, 0.125, 1), ("plugin_namespace", CHAR, b"diffexport", 10)])
    assert err == "" and values["num_heads"] == 8 and values["head_dim"] == 128 and values["scale"] == 0.125


@pytest.mark.parametrize("fields,message", [
    ([], "required field num_heads is missing"),
    (REQUIRED[:2], "required field head_dim is missing"),
    (REQUIRED + [field("causal", 2)], "causal=2 is not one of {0, 1}"),
    (REQUIRED + [field("variant", 3)], "variant=3 is not one of {1, 2}"),
    (REQUIRED + [field("logit_bits", 5)], "logit_bits=5 is not one of {16, 8, 6, 4}"),
    (REQUIRED + [field("norm_eps", 0.0)], "norm_eps=0 must be > 0"),
    (REQUIRED + [field("scale", -1.0)], "scale=-1 must be >= 0"),
    (REQUIRED + [field("scale", math.nan)], "scale must be finite"),
    (REQUIRED + [field("output_scale", math.inf)], "output_scale must be finite"),
    (REQUIRED + [("scale", INT32, 1, 1)], "scale must be a float"),
    (REQUIRED + [("causal", FLOAT32, 1.0, 1)], "causal must be an integer"),
    (REQUIRED + [("causal", INT32, 1, 2)], "causal has 2 values, expected 1"),
    (REQUIRED + [("causal", INT32, 1, 0)], "causal has 0 values"),
    (REQUIRED + [field("num_heads", 4)], "num_heads appears twice"),
    (REQUIRED + [("num_head", INT32, 4, 1)], "unknown field 'num_head'"),
    ([(None, INT32, 1, 1)], "field #0 has no name"),
    ([("num_heads", INT64, 2**40, 1)] + REQUIRED[1:], "num_heads does not fit in int32"),
    ([field("num_heads", 0)] + REQUIRED[1:], "num_heads=0 must be >= 1"),
])
def test_bad_fields_are_refused_with_one_line(parser, fields, message):
    values, err = parse(parser, fields)
    assert values is None and message in err and "\n" not in err


@pytest.mark.parametrize("fields,message", [
    ([field("num_heads", 4), field("num_kv_heads", 3), field("head_dim", 64)],
     "num_kv_heads=3 must divide num_heads=4"),
    (REQUIRED + [field("variant", 2)], "variant 2 (DIFF V2) has no per-head norm"),
    ([field("num_heads", 4), field("num_kv_heads", 2), field("head_dim", 96)], "head_dim=96 is not supported"),
])
def test_configurations_the_kernel_cannot_run_are_refused(parser, fields, message):
    assert parse(parser, fields, check=False)[1] == ""  # each field is in range ...
    assert message in parse(parser, fields)[1]  # ... but createPlugin refuses the combination


def test_serialised_fields_round_trip(parser):
    values, _ = parse(parser, REQUIRED + [field("variant", 2), field("norm", 0), field("scale", 0.07),
                                          field("logit_bits", 6), field("smooth_k", 0), field("causal", 0)])
    ints = (ctypes.c_int32 * N)(*[int(values[a.name]) if a.kind == "int" else 0 for a in contract.PLUGIN_FIELDS])
    floats = (ctypes.c_float * N)(*[float(values[a.name]) if a.kind == "float" else 0 for a in contract.PLUGIN_FIELDS])
    ints2, floats2 = (ctypes.c_int32 * N)(), (ctypes.c_float * N)()
    assert parser.diffx_plugin_roundtrip(ints, floats, ints2, floats2) == 0
    assert list(ints2) == list(ints) and list(floats2) == list(floats)


def test_fuzzed_field_collections_never_crash_and_explain_every_refusal(parser):
    """Random names, types, lengths, values and truncated byte payloads: each collection is either
    accepted with in-range values or refused with a one-line reason. Seeded: reproducible."""
    rng = random.Random(20261121)
    names = list(contract.PLUGIN_FIELD_NAMES) + ["plugin_version", "bogus", "", "num_heads\x01"]
    types = [INT32, FLOAT32, FLOAT64, INT8, INT16, INT64, CHAR, FLOAT16, UNKNOWN, 7, 99, -1]
    accepted = refused = 0
    for _ in range(3000):
        fields = []
        for _ in range(rng.randrange(0, 14)):
            ftype = rng.choice(types)
            length = rng.choice([1, 1, 1, 0, 2, -1])
            if ftype in (INT32, INT8, INT16, INT64) and rng.random() < 0.8:
                value = rng.choice([0, 1, 2, 4, 6, 8, 16, 64, 128, -1, 2**31 - 1, rng.randrange(-1000, 1000)])
                if ftype == INT8:
                    value = max(-128, min(127, value))
                if ftype == INT16:
                    value = max(-32768, min(32767, value))
            elif ftype in (FLOAT32, FLOAT64) and rng.random() < 0.8:
                huge = 1e39 if ftype == FLOAT64 else 3e38
                value = rng.choice([0.0, 1e-5, 0.125, 1.0, -0.5, math.nan, math.inf, huge])
            else:  # raw bytes, possibly shorter than the type: TensorRT passes pointers, we copy by type size
                value = bytes(rng.randrange(256) for _ in range(8))
                ftype = rng.choice(types)
            fields.append((rng.choice(names), ftype, value, length))
        values, err = parse(parser, fields)
        if values is None:
            refused += 1
            assert err and "\n" not in err and len(err) < 400
        else:
            accepted += 1
            for spec in contract.PLUGIN_FIELDS:
                v = values[spec.name]
                assert math.isfinite(v)
                if spec.choices:
                    assert v in spec.choices
            assert values["num_heads"] % values["num_kv_heads"] == 0 and values["head_dim"] in (64, 128)
    assert refused > 100  # the fuzzer reached the error paths
