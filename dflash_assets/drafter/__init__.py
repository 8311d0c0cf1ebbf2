"""Stage 5, the DFlash drafter: the model (`model`), training (`training`), speculative decoding and acceptance length (`decoding`)."""
