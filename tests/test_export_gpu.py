"""`diffexport check` on the CUDA execution provider (needs a GPU and onnxruntime-gpu; skipped elsewhere)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

ort = pytest.importorskip("onnxruntime")

from diffexport.export import ExportOptions, export_onnx  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.validation.options import CheckOptions  # noqa: E402
from diffexport.validation.prefill import run_prefill_check  # noqa: E402


def _needs_cuda_provider():
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("preset", ["diff-v1-tiny", "diff-v2-tiny"])
def test_check_on_the_cuda_provider(preset, dtype, tmp_path):
    _needs_cuda_provider()
    loaded = load_model(None, preset=preset, seed=3, dtype=getattr(torch, dtype))
    export_onnx(loaded, tmp_path / "m.onnx", ExportOptions(dtype=dtype), log=lambda _: None)
    report = run_prefill_check(tmp_path / "m.onnx", load_model(None, preset=preset, seed=3),
                               CheckOptions(provider="cuda", shapes=((1, 1), (2, 33), (1, 1023))), log=lambda _: None)
    assert report.passed, report.text()
    assert "--providers cuda" in report.polygraphy_command
