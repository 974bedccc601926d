"""Serving a KV-cache decoder folder with NVIDIA Triton Inference Server: the model repository
(`repository`: config.pbtxt and a Python-backend model over onnxruntime-genai), the model that
runs inside the server (`triton_model`), and a local server started from the `serve` extra
(`server`). `diffexport triton` is a thin layer over these.
"""
