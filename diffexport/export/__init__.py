"""PyTorch -> ONNX: the exporter, the DiffAttention schema and its ONNX function body."""

from diffexport.export.exporter import ExportOptions, ExportSummary, export_onnx

__all__ = ["ExportOptions", "ExportSummary", "export_onnx"]
