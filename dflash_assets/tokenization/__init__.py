"""Stage 3, tokenized samples: fast segment-wise encoding (`encoder`), samples with loss masks (`samples`), and the
sample checks with the quality gate the GPU stages obey (`quality`)."""
