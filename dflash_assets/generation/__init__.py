"""Stage 2, completions: the fleet of generation engines (`fleet`), shard regeneration with a journal (`completions`), the cost plan (`plan`)."""
