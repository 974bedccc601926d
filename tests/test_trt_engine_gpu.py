"""Engines with the DiffAttention plugin, built and run where TensorRT and a GPU exist (users'
machines; none of ours): `diffexport trt` then `diffexport check model.engine` for fp16, bf16,
INT8 logits, an fp32 graph and the native path. Marked gpu; skipped without `tensorrt` or the
plugin library (DIFFEXPORT_REQUIRE_KERNELS=1 turns a missing library into a failure)."""

import os

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("tensorrt")

from helpers import run_cli  # noqa: E402

from diffexport.backends.tensorrt import plugin_library_candidates  # noqa: E402
from diffexport.export import export_onnx  # noqa: E402
from diffexport.export.exporter import ExportOptions  # noqa: E402
from diffexport.modeling.checkpoint import load_model, save_checkpoint  # noqa: E402
from diffexport.modeling.families import config_from_dict  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def plugin_library():
    if not any(p.is_file() for p in plugin_library_candidates()):
        message = "plugin library not built (cmake -DTensorRT_ROOT=...)"
        if os.environ.get("DIFFEXPORT_REQUIRE_KERNELS"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module", params=["diff_v1", "diff_v2"])
def model_dir(request, tmp_path_factory):
    """A small model the plugin takes (head dim 64, GQA 2:1), its checkpoint and exports."""
    folder = tmp_path_factory.mktemp(request.param)
    values = {"vocab_size": 512, "d_model": 256, "n_layers": 2, "ffn_hidden": 512, "rope_theta": 10000.0,
              "norm_eps": 1e-5, "n_heads": 2, "n_kv_heads": 1, "head_dim": 64}
    if request.param == "diff_v1":
        values["head_norm_affine"] = True
    loaded = load_model(None, config=config_from_dict(request.param, values), seed=3)
    save_checkpoint(loaded.model, folder / "ckpt.pt")
    for dtype in ("float16", "bfloat16", "float32"):
        export_onnx(loaded, folder / f"{dtype}.onnx", ExportOptions(dtype=dtype), log=lambda _: None)
    return folder


@pytest.mark.parametrize("dtype,extra", [
    ("float16", ()), ("bfloat16", ()), ("float16", ("--int8",)), ("float16", ("--logit-bits", "4")),
    ("float32", ()), ("float16", ("--attention", "native")),
])
def test_engine_builds_runs_and_matches_eager(model_dir, dtype, extra):
    engine = model_dir / f"{dtype}{'_'.join(extra).replace('--', '_')}.engine"
    built = run_cli("trt", model_dir / f"{dtype}.onnx", "-o", engine, "--min", "1x1", "--opt", "2x64", "--max", "4x256",
                    *extra)
    assert built.returncode == 0, built.stderr
    if "native" not in extra:
        assert "2 DiffAttention nodes -> plugin" in built.stdout and "(2 plugin layers)" in built.stdout
    checked = run_cli("check", engine, "--ckpt", model_dir / "ckpt.pt", "--shapes", "1x1,1x17,2x65,3x256")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "PASS" in checked.stdout and "polygraphy run" in checked.stdout


@pytest.mark.parametrize("extra", [(), ("--int8",), ("--attention", "native")])
def test_decoder_engine_steps_like_its_folder(model_dir, extra):
    """A KV-cache folder's engine (plugin version 2, key_mask) stepped 32 times against eager."""
    folder = model_dir / "kv-fp16"
    if not folder.exists():
        exported = run_cli("onnx", model_dir / "ckpt.pt", "--kv-cache", "--fp16", "--context-length", "512",
                           "-o", folder)
        assert exported.returncode == 0, exported.stderr
    engine = model_dir / f"kv{'_'.join(extra).replace('--', '_')}.engine"
    built = run_cli("trt", folder, "-o", engine, "--max", "2x64", "--max-past", "128", *extra)
    assert built.returncode == 0, built.stderr
    checked = run_cli("check", engine, "--ckpt", model_dir / "ckpt.pt")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "greedy tokens engine == eager at 33/33 steps  PASS" in checked.stdout
    generated = run_cli("generate", folder, "--ids", "5,17,42", "--max-new-tokens", "8", "--backend", "tensorrt",
                        "--engine", engine)
    assert generated.returncode == 0 and len(generated.stdout.split()) == 8, generated.stdout + generated.stderr
