"""The format layer: what diffexport's artifacts look like, defined once, near the bottom of the package.

Everything above (export, passes, backends, validation, generation, serving, the CLI) reads these
names and rules from here; this layer imports only core and the model layer (docs/ARCHITECTURE.md).
Modules:
  names            I/O and KV-cache names of a decoder graph, the folder's file names, the export
                   dtypes, the metadata key prefix
  nodes            DiffAttention nodes in an ONNX graph: recognising one, reading its contract attributes;
                   what a node reads (its If branches' outer names too), and a graph sorted by it
  metadata_keys    the keys of that metadata, each named once (light: no imports)
  metadata         the metadata an export stamps into its ONNX file: read and validated in one place
                   into a typed record (ExportMetadata: the stored strings, and .model_config,
                   .dtype, .is_decoder, .attention, .record(WEIGHT_QUANT) ...)
  decoders         the decoder-format registry (diffattention, gqa): everything that differs between them
  genai_config     a folder's genai_config.json read with bounds and held to the keys diffexport writes
  decoder_folder   a decoder folder: the genai_config writer and the typed reader (DecoderFolder)
  model_card       a decoder folder's README.md in the Hub's format, and its results section
  tokenizer_rules  the regular expressions a stranger's tokenizer.json may hold
"""
