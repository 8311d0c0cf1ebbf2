"""Where every asset's data lives: one store URI (local directory or s3://) with atomic writes (`backends`)."""
