"""Stage 3, tokenized samples: fast segment-wise encoding (`encoder`), samples with loss masks (`samples`), the
sample checks with the quality gate the GPU stages obey (`quality`), and the stage over the store that tokenizes,
checks and publishes one partition (`stage`)."""
