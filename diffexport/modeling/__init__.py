"""The model layer: the families (`families`: the table of configs and models, build_model; one
readable file each: `diff_v1`, `diff_v2`, `transformer`, shared blocks in `common`), checkpoints
(`checkpoint`), layouts, the Hub, presets and summaries. Nothing is imported here: `presets` and
`hub` stay light enough for the CLI's --help."""
