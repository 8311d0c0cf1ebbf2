"""OpenAI-compatible chat completions as an engine: SGLang, vLLM or ``transformers serve``.

``POST /v1/chat/completions`` with ``chat_template_kwargs: {enable_thinking}``; reads ``reasoning_content`` and
``content``. Whether the server splits the reasoning is decided once, at probe time (``ServerFacts.reasoning_parser``,
or the endpoint's ``reasoning_parser`` setting), never from one reply: a null ``reasoning_content`` from a server
with a parser is empty reasoning (SGLang sends null then), and the content and tool calls stay where they are; only
a server without a parser gets its ``<think>`` block split here. ``transformers serve`` takes its sampling settings
as a GenerationConfig JSON string (its dialect, known from the probe).

Reads: the server's HTTP routes, the target's chat object when given (exact prompt counts). Writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Sequence

from dflash_assets.generation.chat_tokenizer import ChatTokenizer, strip_stop_text
from dflash_assets.generation.config import GenerationConfig, hf_generation_settings
from dflash_assets.generation.engines.http import HttpEngine, json_dumps
from dflash_assets.generation.engines.protocol import ChatResult, EngineError, ServerFacts
from dflash_assets.target_model.chat_template import split_reasoning_text


def _utf8_len(text: Any) -> int:
    """UTF-8 bytes of a message text (0 for None; str(...) of anything else)."""
    if not text:
        return 0
    text = text if isinstance(text, str) else str(text)
    return len(text) if text.isascii() else len(text.encode())


def _openai_message(m: dict) -> dict:
    """A chat message for ``/v1/chat/completions``: role and content; tool calls (arguments as JSON text),
    tool results' ids and an agentic step's reasoning when the message has them."""
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                                if isinstance(c["function"]["arguments"], str)
                                                else json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                             for c in m["tool_calls"]]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


class OpenAIEngine(HttpEngine):
    """``/v1/chat/completions`` of SGLang, vLLM or ``transformers serve``."""

    kind = "openai"
    health_route_optional = True  # some OpenAI-compatible proxies have no /health

    def __init__(self, url: str, *, api_key: str | None = None, extra_sampling_params: bool | None = None,
                 reasoning_parser: bool | None = None, tokenizer: Any = None, **kwargs):
        super().__init__(url, api_key=api_key, **kwargs)
        self.extra_sampling_params = extra_sampling_params  # None: decided by the probe
        self.configured_reasoning_parser = reasoning_parser  # None: decided by the probe
        self.splits_reasoning: bool | None = reasoning_parser
        self.tok = ChatTokenizer(tokenizer) if tokenizer is not None else None  # exact prompt counts, when given

    def _adopt_facts(self, facts: ServerFacts) -> None:
        """The probe's facts, and what they decide here: the dialect (``transformers serve`` tags its
        ``/v1/models`` cards), whether to send SGLang/vLLM's extra sampling fields, and whether the server splits
        the reasoning (``transformers serve`` has no reasoning parser: the ``<think>`` block stays in the
        content); a configured setting wins over the probe's."""
        super()._adopt_facts(facts)
        self.dialect = "transformers_serve" if facts.transformers_serve else "openai"
        if self.extra_sampling_params is None:
            self.extra_sampling_params = self.dialect != "transformers_serve"
        if self.configured_reasoning_parser is None:
            self.splits_reasoning = False if self.dialect == "transformers_serve" else facts.splits_reasoning

    def prompt_tokens(self, messages: Sequence[dict], gen: GenerationConfig, tools: Sequence[dict] | None) -> int:
        """The request's prompt tokens for the context check: counted with the target's tokenizer when the
        engine has one and the cheap bound does not already fit; else that bound, an upper limit (a byte-level
        BPE token is at least one UTF-8 byte): the UTF-8 bytes of every text, 32 tokens per message for its
        frame, 64 for the generation prompt, and with tools their JSON plus 1024 for the template's tool
        instructions."""
        bound = 64 + sum(_utf8_len(m.get("content")) + _utf8_len(m.get("reasoning_content")) + 32
                         + (len(json_dumps(m["tool_calls"])) if m.get("tool_calls") else 0) for m in messages)
        if tools:
            bound += len(json_dumps(list(tools))) + 1024
        fits = self.context_length is None or bound + gen.max_new_tokens <= self.context_length
        if fits or self.tok is None:
            return bound
        return len(self.tok.prompt_ids(messages, gen.enable_thinking, tools))

    def _payload(self, messages: Sequence[dict], gen: GenerationConfig, ignore_eos: bool = False,
                 tools: Sequence[dict] | None = None) -> dict:
        payload: dict[str, Any] = {
            "model": self.served_model or None,
            "messages": [_openai_message(m) for m in messages],
            "max_tokens": gen.max_new_tokens,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "stream": False,
            "chat_template_kwargs": {"enable_thinking": gen.enable_thinking},
        }
        if payload["model"] is None:
            del payload["model"]
        if tools:
            payload["tools"] = list(tools)
        if gen.seed is not None:
            payload["seed"] = gen.seed
        if self.dialect == "transformers_serve":
            # `transformers serve` starts from the model's generation_config.json: `temperature` alone never
            # turns sampling on (a target shipping do_sample=false decodes greedily) and top_k/min_p/
            # repetition_penalty are no request fields there. It takes them as a GenerationConfig JSON string.
            settings = hf_generation_settings(gen)
            if ignore_eos:  # no `ignore_eos` field there: end-of-turn is suppressed up to max_new_tokens instead
                settings["min_new_tokens"] = gen.max_new_tokens
            payload["generation_config"] = json.dumps(settings)
        if self.extra_sampling_params:
            if gen.top_k is not None and gen.top_k > 0:
                payload["top_k"] = gen.top_k
            if gen.min_p is not None:
                payload["min_p"] = gen.min_p
            if gen.repetition_penalty is not None:
                payload["repetition_penalty"] = gen.repetition_penalty
            if gen.stop_token_ids:
                payload["stop_token_ids"] = list(gen.stop_token_ids)
            payload["skip_special_tokens"] = gen.skip_special_tokens
            if ignore_eos:
                payload["ignore_eos"] = True
        return payload

    async def chat(self, messages: Sequence[dict], generation: GenerationConfig, *, ignore_eos: bool = False,
                   tools: Sequence[dict] | None = None) -> ChatResult:
        cut = 0
        if self.context_length:
            generation, cut = self.fit_to_context(self.prompt_tokens(messages, generation, tools), generation)
        t0 = time.perf_counter()
        out = await self._request("POST", "/v1/chat/completions", self._payload(messages, generation, ignore_eos, tools),
                                  read_timeout_s=self.read_timeout_for(generation.max_new_tokens))
        latency = time.perf_counter() - t0
        with self._reply_shape("/v1/chat/completions", out):
            result = self._parse_chat(out, generation, latency)
        return dataclasses.replace(result, max_new_tokens_cut=cut) if cut else result

    def _parse_chat(self, out: Any, generation: GenerationConfig, latency: float) -> ChatResult:
        """The reply's turn. A server that splits reasoning (known from the probe or the endpoint's setting, or
        shown by a non-null reasoning field in this reply) keeps content and tool calls as sent, a null
        reasoning being empty reasoning (SGLang ``serving_chat.py`` sends ``reasoning_content: null`` when the
        parsed reasoning is empty). Only a server without a parser gets the ``<think>`` block split here."""
        self._check_model("/v1/chat/completions", out.get("model"))
        choice = out["choices"][0]
        msg = choice.get("message") or {}
        content = strip_stop_text(msg.get("content") or "")
        reasoning = msg.get("reasoning_content")
        if reasoning is None:
            reasoning = msg.get("reasoning")  # vLLM >= 0.10 names it `reasoning`
        if reasoning is None and not self.splits_reasoning:  # no reasoning parser on the server: split here
            reasoning, content = split_reasoning_text(content, generation.enable_thinking)
        else:
            # a turn that stopped inside its reasoning: `transformers serve` leaves the stop text there
            reasoning, content = strip_stop_text(reasoning or "").strip("\n"), content.lstrip("\n")
        finish = str(choice.get("finish_reason") or "stop")
        if finish == "abort":
            raise EngineError(f"{self.url}: request aborted", retryable=True, endpoint=self.url)
        usage = out.get("usage") or {}
        return ChatResult(content, reasoning, finish, int(usage.get("prompt_tokens", 0)),
                          int(usage.get("completion_tokens", 0)), latency, self.url,
                          str(out.get("model") or self.served_model), msg.get("tool_calls") or None)


# The static-cache engine pads each batch to one of these row counts and its prompt width to one of these widths,
