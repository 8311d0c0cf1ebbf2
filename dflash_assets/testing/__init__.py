"""Test and benchmark helpers that are not fixtures of one test file: a loopback server speaking SGLang's and OpenAI's
HTTP shapes (`sglang_loopback`); ShareGPT as a completions table (`sharegpt`)."""
