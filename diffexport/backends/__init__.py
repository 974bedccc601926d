"""Running artifacts: the runtimes a decoder folder runs on (`runtimes`: the registry; `base`: the
Runtime and DecoderRunner protocols and the records a run returns), the onnxruntime step loop
(`step_loop`) and in-flight batching over any runner (`inflight`), onnxruntime-genai (`genai`),
TensorRT(-RTX) engines built and stepped (`tensorrt`), and how fast an artifact runs beside the
machine's bound (`speed`)."""
