"""The target model: its spec and checks (`spec`), tokenizer and chat template, the DFlash conventions, and the one layer capture."""
