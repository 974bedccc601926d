"""ONNX graph rewrites, each a pass over a model: fusing differential attention written in standard
ops into DiffAttention nodes (`fusion`, `optimize`), lowering them back (`lowering`) and cleaning
up (`cleanup`); onnxruntime's GroupQueryAttention form and its fusions (`group_query_attention`,
`onnxruntime_fusions`); weight (`weight_quant`), Q/DQ (`qdq`, with `calibration`) and KV-cache
(`kv_cache_quant`) quantisation; and a decoder folder in any format, its pass handed to the export
(`decoder_formats`)."""
