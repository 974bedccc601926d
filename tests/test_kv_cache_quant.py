"""`diffexport quantize FOLDER --kv-cache int8`: GroupQueryAttention's cache as int8 with calibrated
per-channel scales. The folder passes its check within the stated budget, decodes in
onnxruntime-genai and in the onnxruntime loop, its keys' scales are shared by rotary pairs, and
the inputs it cannot take are refused in one line."""

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from helpers import cli_main  # noqa: E402

from diffexport.core import tolerances  # noqa: E402
from diffexport.format import names  # noqa: E402
from diffexport.passes import kv_cache_quant  # noqa: E402

pytestmark = pytest.mark.slow  # exports and checks a folder


@pytest.fixture(scope="module")
def kv8(tmp_path_factory):
    """A gqa folder of the trained text preset (the CPU default), and its int8-weight, int8-cache copy
    calibrated on a text the model reads (its own model card)."""
    root = tmp_path_factory.mktemp("kv8")
    out = cli_main("onnx", "--preset", "diff-text-tiny", "--kv-cache", "-o", root / "kv")
    assert out.returncode == 0, out.stderr
    text = root / "calib.txt"
    text.write_text(((root / "kv" / "README.md").read_text() + "\n") * 20)
    q = cli_main("quantize", root / "kv", "-o", root / "kv8", "--weights", "int8", "--kv-cache", "int8",
                 "--calib", text, "--tokenizer", root / "kv", "--calib-samples", "8")
    assert q.returncode == 0, q.stderr
    assert "kv cache      int8" in q.stdout + q.stderr
    return root


def test_the_cache_is_int8_with_a_scale_per_channel(kv8):
    model = onnx.load(str(kv8 / "kv8" / "model.onnx"))
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}
    assert types[names.PAST_KEY % 0] == types[names.PRESENT_VALUE % 3] == onnx.TensorProto.INT8
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 4
    for node in gqa:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["k_quant_type"], attrs["v_quant_type"], attrs["kv_cache_bit_width"]) == \
            (b"PER_CHANNEL", b"PER_CHANNEL", 8)
        k_scale, v_scale = inits[node.input[12]], inits[node.input[13]]
        past = next(v for v in model.graph.input if v.name == node.input[3])
        heads, width = (d.dim_value for d in past.type.tensor_type.shape.dim[1::2])
        assert k_scale.shape == v_scale.shape == (heads * width,)
        assert (k_scale > 0).all() and (v_scale > 0).all() and np.isfinite(k_scale).all()
        # rotate-half keys: channel i and i + width/2 turn together, so they share one scale
        pairs = k_scale.reshape(heads, 2, width // 2)
        np.testing.assert_array_equal(pairs[:, 0], pairs[:, 1])
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta[kv_cache_quant.META_KEY])["bits"] == 8


def test_the_int8_cache_folder_passes_its_check_and_decodes_in_genai(kv8):
    check = cli_main("check", kv8 / "kv8", "--preset", "diff-text-tiny")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "int8 weights and an int8 KV cache" in check.stdout + check.stderr
    pytest.importorskip("onnxruntime_genai")
    runs = {}
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", kv8 / "kv8", "--prompt", "def main(", "--max-new-tokens", "24", "--greedy",
                       "--backend", backend)
        assert out.returncode == 0, out.stderr
        runs[backend] = out.stdout
    assert runs["genai"] == runs["onnxruntime"]  # the same int8 cache arithmetic in both runtimes


def test_pair_lengths_bound_every_rotation():
    """Keys rotated to any angle stay within the calibrated scale: the pair's length, not the channel's
    own largest value, bounds both channels."""
    rng = np.random.default_rng(0)
    half = 4
    seen = rng.standard_normal((1, 1, 1, 6, 2 * half)).astype(np.float32)  # [layers=1, B, H, T, D]

    class Session:
        def get_outputs(self):
            return [type("O", (), {"name": n})() for n in (names.PRESENT_KEY % 0, names.PRESENT_VALUE % 0)]

        def run(self, _, feeds):
            return [seen[0], seen[0]]

    keys, values = kv_cache_quant.cache_ranges(Session(), [{}], 1, half)
    lengths = np.sqrt(seen[..., :half] ** 2 + seen[..., half:] ** 2).max(axis=(0, 1, 2, 3))
    np.testing.assert_allclose(keys[0], np.concatenate([lengths, lengths]), rtol=1e-6)
    np.testing.assert_allclose(values[0], np.abs(seen).max(axis=(0, 1, 2, 3)), rtol=1e-6)
    for angle in np.linspace(0, np.pi, 7):  # the same key turned: each channel stays under its pair's length
        a, b = seen[..., :half], seen[..., half:]
        turned = np.concatenate([a * np.cos(angle) - b * np.sin(angle), a * np.sin(angle) + b * np.cos(angle)], -1)
        assert (np.abs(turned).max(axis=(0, 1, 2, 3)) <= keys[0] * (1 + 1e-6)).all()


def test_the_budget_adds_the_cache_to_the_weights():
    both = tolerances.quant_budget(weights=json.dumps({"bits": 4}), kv_cache=json.dumps({"bits": 8}))
    assert both.max_kl == pytest.approx(0.055) and both.min_cosine == pytest.approx(0.945)
    assert tolerances.quant_budget(kv_cache=json.dumps({"bits": 8})).max_kl == pytest.approx(0.005)


def test_refusals(artifacts, tmp_path):
    diffattention = artifacts.decoder("diff-v1-gqa")  # a DiffAttention folder: no GroupQueryAttention cache
    cases = [  # (--kv-cache alone on a DiffAttention folder is tests/test_diff_kv_cache.py's)
        ((diffattention, "-o", tmp_path / "a", "--weights", "int4", "--kv-cache", "int8", "--calib", "synthetic"),
         "has none: export the folder with `diffexport onnx CKPT --kv-cache`"),
        ((artifacts.decoder("diff-v1-gqa", "gqa"), "-o", tmp_path / "b", "--kv-cache", "int8"),
         "--kv-cache int8 needs calibration data"),
        ((artifacts.decoder("diff-v1-gqa", "gqa"), "-o", tmp_path / "c", "--kv-cache", "int8", "--qdq", "int8",
          "--calib", "synthetic"), "--kv-cache belong to weight-only quantisation"),
    ]
    for args, message in cases:
        out = cli_main("quantize", *args)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert not any(p.exists() for p in (tmp_path / "a", tmp_path / "b", tmp_path / "c"))
