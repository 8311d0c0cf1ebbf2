"""The target model: its spec and checks (`spec`), the Qwen3.5/3.6 tokenizer of the embedded default (`tokenizer`),
the one chat renderer and reasoning splitter (`chat_template`), the target's one chat object handed to engines,
tokenization and evaluation (`chat`: tokenizer, renderer, conventions, stop ids, thinking flag), the DFlash layer
rule and mask token (`conventions`), the one layer capture with the decoder cut (`layer_capture`), and loading a
causal LM from a directory (`loading`)."""
