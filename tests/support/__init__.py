"""Test support that is not a fixture of one test file, and is not installed with the package: a loopback server
speaking SGLang's and OpenAI's HTTP shapes (`sglang_loopback`); ShareGPT as a completions table (`sharegpt`). The
bench/ scripts import them from the checkout."""
