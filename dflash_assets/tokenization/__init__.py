"""Stage 3, tokenized samples: fast segment-wise encoding (`encoder`), samples with loss masks and their quality checks (`samples`)."""
