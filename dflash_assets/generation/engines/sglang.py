"""SGLang's native API as an engine (also behind sglang-router: same API, one URL).

``POST /generate`` with ``input_ids`` (the prompt rendered with the target's chat template and generation prompt,
tokenized here) and ``sampling_params``; reads ``output_ids`` (or ``text``, older servers) and ``meta_info``
(``finish_reason`` {type: stop|length|abort}, ``prompt_tokens``, ``completion_tokens``, ``e2e_latency``). The
reasoning split is done on the ids (``generation.chat_tokenizer.ChatTokenizer``): the generation prompt ends with
``<think>\\n``, so the output is ``reasoning </think> content <|im_end|>`` and is cut at the ``</think>`` id.

Reads: the server's HTTP routes, the target's chat object (or a bare tokenizer object). Writes nothing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from dflash_assets.generation.chat_tokenizer import ChatTokenizer, strip_stop_text
from dflash_assets.generation.config import GenerationConfig
from dflash_assets.generation.engines.http import HttpEngine
from dflash_assets.generation.engines.protocol import ChatResult, EngineError
from dflash_assets.target_model.chat_template import split_reasoning_text


def _sglang_sampling_params(gen: GenerationConfig, stop_ids: Sequence[int], ignore_eos: bool = False) -> dict:
    params: dict[str, Any] = {
        "max_new_tokens": gen.max_new_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "skip_special_tokens": gen.skip_special_tokens,
        "no_stop_trim": False,
    }
    if gen.top_k is not None and gen.top_k > 0:
        params["top_k"] = gen.top_k
    if gen.min_p is not None:
        params["min_p"] = gen.min_p
    if gen.repetition_penalty is not None:
        params["repetition_penalty"] = gen.repetition_penalty
    if stop_ids:
        params["stop_token_ids"] = sorted(set(stop_ids))
    if gen.seed is not None:
        params["sampling_seed"] = gen.seed
    if ignore_eos:
        params["ignore_eos"] = True
    return params


def _finish_type(finish: Any) -> str:
    if finish is None:
        return "stop"
    if isinstance(finish, dict):
        return str(finish.get("type") or "stop")
    return str(finish)


class SGLangEngine(HttpEngine):
    """SGLang's native ``/generate`` API (also sglang-router)."""

    kind = "sglang"

    def __init__(self, url: str, tokenizer: Any, **kwargs):
        super().__init__(url, **kwargs)
        if tokenizer is None:
            raise ValueError("the SGLang native engine needs the target's tokenizer (chat template) to build input_ids")
        self.tok = ChatTokenizer(tokenizer)

    def _stop_ids(self, gen: GenerationConfig) -> list[int]:
        return sorted(self.tok.stop_ids | set(gen.stop_token_ids))

    def _result(self, out: Any, gen: GenerationConfig, t0: float) -> ChatResult:
        with self._reply_shape("/generate", out):
            return self._parse_result(out, gen, t0)

    def _parse_result(self, out: Any, gen: GenerationConfig, t0: float) -> ChatResult:
        if not isinstance(out, dict):
            raise TypeError(f"a reply item is a {type(out).__name__}, not an object")
        self._check_model("/generate", out.get("model"))
        meta = out.get("meta_info") or {}
        finish = _finish_type(meta.get("finish_reason"))
        if finish == "abort":
            message = (meta.get("finish_reason") or {}).get("message", "") if isinstance(meta.get("finish_reason"), dict) else ""
            raise EngineError(f"{self.url}/generate aborted the request: {message}", retryable=True, endpoint=self.url)
        ids = out.get("output_ids")
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise TypeError("output_ids is not a list of token ids")
            reasoning, content = self.tok.split_output_ids(ids, gen.enable_thinking, gen.stop_token_ids)
            n_out = int(meta.get("completion_tokens", len(ids)))
        else:  # older SGLang: text only
            reasoning, content = split_reasoning_text(strip_stop_text(out.get("text", "")), gen.enable_thinking)
            n_out = int(meta.get("completion_tokens", 0))
        latency = float(meta.get("e2e_latency") or (time.perf_counter() - t0))
        return ChatResult(content, reasoning, finish, int(meta.get("prompt_tokens", 0)), n_out, latency,
                          self.url, self.served_model)

    async def generate_ids(self, input_ids: list[int] | list[list[int]], generation: GenerationConfig, *,
                           ignore_eos: bool = False) -> Any:
        """Raw ``POST /generate`` for one prompt or a batch of prompts (a list of id lists)."""
        payload = {"input_ids": input_ids,
                   "sampling_params": _sglang_sampling_params(generation, self._stop_ids(generation), ignore_eos)}
        return await self._request("POST", "/generate", payload,
                                   read_timeout_s=self.read_timeout_for(generation.max_new_tokens))

    async def chat(self, messages: Sequence[dict], generation: GenerationConfig, *, ignore_eos: bool = False,
                   tools: Sequence[dict] | None = None) -> ChatResult:
        ids = self.tok.prompt_ids(messages, generation.enable_thinking, tools)
        fitted, cut = self.fit_to_context(len(ids), generation)
        t0 = time.perf_counter()
        out = await self.generate_ids(ids, fitted, ignore_eos=ignore_eos)
        if isinstance(out, list) and len(out) == 1:
            out = out[0]
        result = self._result(out, fitted, t0)
        return dataclasses.replace(result, max_new_tokens_cut=cut) if cut else result

    async def chat_batch(self, conversations: Sequence[Sequence[dict]], generation: GenerationConfig) -> list[ChatResult]:
        """Several prompts in one ``/generate`` call (``input_ids`` as a batch; one ``max_new_tokens`` for all,
        lowered to what the longest prompt leaves of the context)."""
        batch = [self.tok.prompt_ids(m, generation.enable_thinking) for m in conversations]
        fitted, cut = self.fit_to_context(max(len(b) for b in batch), generation) if batch else (generation, 0)
        t0 = time.perf_counter()
        outs = await self.generate_ids(batch, fitted)
        if not isinstance(outs, list) or len(outs) != len(batch):
            raise EngineError(f"{self.url}/generate: batch of {len(batch)} got {str(outs)[:200]}", retryable=True,
                              endpoint=self.url)
        return [dataclasses.replace(self._result(o, fitted, t0), max_new_tokens_cut=cut) for o in outs]
