"""Graph passes on ONNX models: lowering DiffAttention to standard ops, and cleanup."""
