"""The format layer: what diffexport's artifacts look like, defined once, at the bottom of the package.

Everything above (export, passes, backends, validation, the CLI) reads these names and rules from
here; this layer imports only contract, errors, files and the model configuration
(docs/ARCHITECTURE.md). Modules:
  names     I/O and KV-cache names of a decoder graph, the folder's file names, the export dtypes,
            the metadata key prefix
  nodes     DiffAttention nodes in an ONNX graph: recognising one, reading its contract attributes
  metadata  the metadata an export stamps into its ONNX file: read and validated in one place
  decoders  the decoder formats (diffattention, gqa): everything that differs between them
"""
