"""Core: what every layer shares and nothing above it defines: the DiffAttention op contract,
errors, safe file handling, progress, eager generation (the search and sampling math every
runtime is held to), tolerances, quantisation math, an onnxruntime session opened with one-line
errors, and native work on a stranger's input where it can be stopped. Nothing is imported here:
each module is imported by name, so a light module stays light."""
