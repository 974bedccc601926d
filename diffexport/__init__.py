"""diffexport: Differential Transformer models from PyTorch to ONNX, ONNX Runtime and TensorRT.

Heavy modules (torch, onnx) are imported by the submodules that need them, never here,
so `diffexport --help` answers without loading torch.
"""

__version__ = "0.4.0"
