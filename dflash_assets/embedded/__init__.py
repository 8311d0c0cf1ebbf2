"""The embedded default: tiny targets with the real Qwen3.6 tokenizer (`tiny_targets`, taught the chat format by `tiny_target_training`) and the engine that serves one on demand (`engine`)."""
