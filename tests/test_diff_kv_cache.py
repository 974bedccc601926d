"""`diffexport quantize FOLDER --kv-cache int8` on a DiffAttention decoder folder (the TensorRT/CUDA
decoders): the cache becomes int8 codes with per-channel scales (K shifted by its mean), each
DiffAttention a version-3 node. In onnxruntime (the function body dequantises the codes) the folder
is checked against eager PyTorch on the float model under the int8 KV-cache budget; its lowered form
and TensorRT's preparation read the same nodes."""

import json

import numpy as np
import onnx
import pytest
from helpers import cli_main

from diffexport.backends.tensorrt import EngineOptions, prepare_graph
from diffexport.core import contract
from diffexport.core.errors import DiffExportError
from diffexport.format import names
from diffexport.format.metadata_keys import KV_CACHE_QUANT, OP_VERSION, stored_key
from diffexport.passes import calibration, diff_kv_cache
from diffexport.passes.lowering import lower_diff_attention

pytestmark = pytest.mark.slow  # exports and an eager comparison

CALIB = ("--calib", "synthetic", "--calib-samples", "8", "--calib-seq-len", "64")


@pytest.fixture(scope="module")
def kv8(artifacts, v1_folder):
    return artifacts.cli_output("quantize", v1_folder, "--kv-cache", "int8", *CALIB, output="kv8")


def attention_nodes(model):
    return [n for n in model.graph.node if n.op_type == contract.OP_NAME and n.domain == contract.ONNX_DOMAIN]


def test_the_folder_holds_version_3_nodes_on_an_int8_cache(artifacts, v1_folder, kv8):
    out = artifacts.cli_stdout("quantize", v1_folder, "--kv-cache", "int8", *CALIB)
    assert "kv cache      int8 codes, one scale per channel (keys: per rotary pair, shifted by their mean)" in out
    cosine = float(out.split("logits vs the float cache: cosine ")[1].split()[0])
    assert cosine >= 0.995  # held-out tokens: a comparison that could have failed (the pass refuses below it)
    model = onnx.load(str(kv8 / "model.onnx"))
    nodes = attention_nodes(model)
    assert nodes and all(len(n.input) == len(contract.KV_CACHE_INPUTS) for n in nodes)
    assert all({a.name: a.s for a in n.attribute}["plugin_version"] == b"3" for n in nodes)
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}
    assert types[names.PAST_KEY % 0] == types[names.PRESENT_VALUE % 0] == onnx.TensorProto.INT8
    assert types[names.LOGITS] == onnx.TensorProto.FLOAT
    opsets = {o.domain: o.version for o in model.opset_import}
    assert opsets[""] >= 19 and opsets[contract.ONNX_DOMAIN] == contract.KV_CACHE_VERSION
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta[stored_key(OP_VERSION)] == "3"
    assert json.loads(meta[stored_key(KV_CACHE_QUANT)])["format"] == "int8"
    scales = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name.startswith("kv_cache.")}
    assert all(np.isfinite(v).all() and (v > 0).all() for k, v in scales.items() if k.endswith(".scale"))
    inspected = cli_main("inspect", kv8)
    assert inspected.returncode == 0 and "plugin_version=3" in inspected.stdout  # (head_dim 16: no plugin here)


def test_the_folder_matches_eager_pytorch_within_the_int8_cache_budget(kv8, v1_ckpt):
    """diffexport check: onnxruntime (codes dequantised by the function body) against eager PyTorch on
    the float model, prefill and decode steps, under an int8 KV cache's budget."""
    out = cli_main("check", kv8, "--ckpt", v1_ckpt)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "budget        an int8 KV cache" in out.stderr
    assert "result        PASS: 33/33 comparisons within tolerance" in out.stdout


def test_lowered_and_function_forms_agree_and_tensorrt_stamps_version_3(kv8):
    model = onnx.load(str(kv8 / "model.onnx"))
    lowered = lower_diff_attention(model).model
    assert not attention_nodes(lowered) and any(n.op_type == "DequantizeLinear" for n in lowered.graph.node)
    ort = pytest.importorskip("onnxruntime")
    ids = np.arange(1, 19, dtype=np.int64).reshape(2, 9) % 50
    logits = []
    for form in (model, lowered):
        session = ort.InferenceSession(form.SerializeToString(), providers=["CPUExecutionProvider"])
        logits.append(session.run([names.LOGITS], calibration.feeds(form, ids))[0])
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    staged, count = prepare_graph(model, EngineOptions())
    assert count == len(attention_nodes(model)) and not staged.functions
    assert all({a.name: a.s for a in n.attribute}["plugin_version"] == b"3" for n in attention_nodes(staged))
    with pytest.raises(DiffExportError, match="do not combine with an 8-bit KV cache"):
        prepare_graph(model, EngineOptions(logit_bits=8))


def test_refusals(artifacts, v1_folder, kv8, tmp_path):
    with pytest.raises(DiffExportError, match="ONNX's Concat, which takes no float8 tensors"):
        diff_kv_cache.quantize_kv_cache(v1_folder, tmp_path / "fp8", diff_kv_cache.KvCacheOptions(
            format="fp8", calib="synthetic"))
    out = cli_main("quantize", v1_folder, "-o", tmp_path / "x", "--kv-cache", "int8", "--method", "hqq", *CALIB)
    assert out.returncode == 2 and "--method belong to weight-only quantisation" in out.stderr
    out = cli_main("quantize", v1_folder, "-o", tmp_path / "y", "--kv-cache", "int8")
    assert out.returncode == 2 and "needs calibration data" in out.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # a folder quantised already: its cache is int8, nothing to calibrate on
    out = cli_main("quantize", kv8, "-o", tmp_path / "z", "--kv-cache", "int8", *CALIB)
    assert out.returncode == 2 and "its cache is int8 codes already" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "z").exists()
    # an output that exists is neither overwritten nor touched without --force
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    out = cli_main("quantize", v1_folder, "-o", taken, "--kv-cache", "int8", *CALIB)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert [p.name for p in taken.iterdir()] == ["mine.txt"] and (taken / "mine.txt").read_text() == "keep"


def test_trt_rtx_builds_the_int8_cache_folder_natively(kv8, tmp_path):
    """TensorRT's parser and builder take the int8 cache's graph (QuantizeLinear per channel, int8
    Concat and network I/O, the lowered version-3 body): TensorRT-RTX builds it on the CPU. (The
    plugin path needs TensorRT and a GPU: the plugin harness's version-3 cases.)"""
    pytest.importorskip("tensorrt_rtx")
    engine = tmp_path / "kv8.engine"
    result = cli_main("trt", kv8, "-o", engine, "--attention", "native", "--builder", "tensorrt-rtx",
                      "--max", "2x64", "--max-past", "256")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DiffAttention nodes -> native" in result.stdout and engine.stat().st_size > 0
