"""Runtimes that execute exported artifacts (ONNX Runtime today; TensorRT joins with the plugin)."""
