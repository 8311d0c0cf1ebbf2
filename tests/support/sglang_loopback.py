"""A loopback HTTP server that answers as SGLang 0.5.23 does, for the routes the project uses.

For tests and benchmarks of the generation client where SGLang itself cannot
be installed (it needs CUDA). It lives with the tests (not installed with the
package); bench/ scripts import it from the checkout. Each behaviour below follows the 0.5.23
wheel (``pip download --no-deps sglang==0.5.23``; paths under ``sglang/srt/``)
and is cited where it is implemented. Routes:

- ``POST /generate``: ``{"input_ids": [...] | [[...], ...], "sampling_params": {...}}``
  (or ``text``) -> ``{"text", "output_ids", "meta_info": {"id",
  "finish_reason": {"type": "stop", "matched": id} | {"type": "length",
  "length": n}, "prompt_tokens", "completion_tokens", "cached_tokens",
  "e2e_latency"}}``, a list of those for a batch. A prompt of
  ``context_length`` tokens or more, or prompt + ``max_new_tokens`` above it,
  is refused with 400 ``{"error": {"message"}}``.
- ``GET /health``, ``GET /health_generate``: 200, never behind the API key;
  503 for ``health_503_s`` after start (a starting server); ``health_delay_s``
  plays the one-token health generation. ``router``: always 200 (the router's
  liveness answer, whatever its workers do), and ``GET /readiness`` 200 or 503
  by ``router_workers_healthy`` (sgl-model-gateway ``src/server.rs``).
- ``GET /model_info`` and the deprecated ``/get_model_info``: ``{"model_path",
  "served_model_name", "tokenizer_path", "is_generation", "reasoning_parser",
  "tool_call_parser", ...}``. ``GET /server_info`` / ``/get_server_info``: the
  server's flags (``enable_deterministic_inference``, ``context_length``,
  ``reasoning_parser``, ``tool_call_parser``, ``version``). ``missing_routes``
  answers 404 on the routes named (an older server, or the router without the alias).
- ``GET /v1/models``: ``{"object": "list", "data": [{"id": served name,
  "max_model_len": context_length, ...}]}``.
- ``POST /v1/chat/completions``: OpenAI shape. With ``reasoning_parser``
  (default ``qwen3``, as started with ``--reasoning-parser qwen3``) the text is
  split as SGLang's Qwen3 detector splits it and ``reasoning_content`` is null
  when the reasoning is empty; without, the raw text (think block included) is
  the content and ``reasoning_content`` is null. ``model`` echoes the request's
  (no check), ``usage`` counts tokens of a ChatML rendering of the messages,
  each tool's ``parameters`` must pass Draft 2020-12 ``check_schema`` (400
  otherwise), and the context rule of ``/generate`` holds (400).
- Error bodies per route: ``{"error": "Unauthorized"}`` (401),
  ``{"error": {"message"}}`` on ``/generate``, ``{"object": "error",
  "message", "type", "param", "code"}`` on the chat route.
- ``GET /loopback/stats``: request counters (not an SGLang route; tests use
  it to count requests at the server).

Seeds: a request's seed (``sampling_seed``, chat ``seed``) changes the output
only when the server is ``deterministic`` (started with
``--enable-deterministic-inference``); otherwise it is ignored, as SGLang
ignores it (``sampling/sampling_batch_info.py`` passes it to the sampler only then).

Tool calls (``LoopbackConfig.tool_rules``): ``(trigger, name, arguments)``
rules; when the prompt's last message (the text between its last two
``<|im_start|>``, i.e. before the generation prompt; on the chat route the
last message's content) contains a rule's trigger, the reply's content is
``I will call NAME.`` and a Qwen3.5/3.6 ``<tool_call>`` block calling
``name`` with ``arguments`` (the first rule that matches). ``/generate``
needs ``tokenizer_json`` to read the prompt. ``tool_call_parser``: the chat
route answers the call as parsed OpenAI ``tool_calls`` (finish
``tool_calls``) when the request carries ``tools``, as SGLang does when
started with ``--tool-call-parser``. ``tool_call_without_think_end``: the
block opens inside the reasoning without ``</think>`` (Qwen3.5 does this;
SGLang's Qwen3 reasoning parser ends the reasoning at ``<tool_call>``).

Misbehaviour modes (``LoopbackConfig``) play a broken or hostile engine:
replies of the wrong shape, redirects, padded bodies, another model's name,
a plain-text ``/health``, a required bearer token; ``delay_s`` plays a hung one.

"Generation" is deterministic: the output for a prompt is derived from a hash
of its ids (plus the sampling seed when ``deterministic``): ``R`` reasoning tokens, ``</think>``,
``C`` content tokens, end-of-turn, cut at ``max_new_tokens`` (finish
``length``). The same prompt always gives the same output, so a resumed run
can be compared with an uninterrupted one. Latency, failures and an instant
mode are configurable. Text is decoded with a ``tokenizer.json`` when one is
given (through the ``tokenizers`` library), else text is encoded one id per
UTF-8 byte (ids 256-511) and ordinary ids are rendered as ``<id>`` words.

Run: ``python -m tests.support.sglang_loopback --port 30000 --model-path /models/X``
(prints one JSON line ``{"ready": url}`` when listening). In-process:
``with LoopbackServer(...) as srv: srv.url``. Reads/writes nothing on disk.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    import subprocess


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


_loads = orjson.loads

__all__ = ["LoopbackConfig", "LoopbackServer", "LoopbackProcess", "build_app", "main", "QWEN3_6_IDS"]

# Special ids of the Qwen3.5/3.6 tokenizer (the embedded default target).
QWEN3_6_IDS = {"think_start": 248068, "think_end": 248069, "im_end": 248046, "endoftext": 248044}
THINK_START, THINK_END, TOOL_CALL_START = "<think>", "</think>", "<tool_call>"
_ROUTER_PUBLIC = frozenset({"/liveness", "/readiness", "/v1/models", "/model_info", "/get_model_info", "/server_info",
                            "/get_server_info", "/engine_metrics"})
_BYTE_ID0 = 256  # without a tokenizer, byte b of a text is id 256 + b (below token_lo: never a random token)


@dataclass
class LoopbackConfig:
    model_path: str = "/models/loopback-model"
    served_model_name: str | None = None
    think_end_id: int = QWEN3_6_IDS["think_end"]
    eos_id: int = QWEN3_6_IDS["im_end"]
    token_lo: int = 1000  # ordinary tokens are drawn from [token_lo, token_hi)
    token_hi: int = 30000
    reasoning_tokens: tuple[int, int] = (4, 12)  # inclusive range
    content_tokens: tuple[int, int] = (3, 10)
    delay_s: float = 0.0  # fixed latency per /generate request
    per_token_s: float = 0.0  # extra latency per generated token
    instant: bool = False  # answer a fixed 2-token reply without hashing (benchmarks)
    fail_every: int = 0  # every Nth generate request answers fail_status (0: never)
    fail_status: int = 503
    output_ids: bool = True  # False: behave like older SGLang (text only)
    reasoning_parser: str | None = "qwen3"  # chat route: None = started without --reasoning-parser
    tokenizer_json: str | None = None
    stub_ratio: float = 0.0  # share of prompts answered with the stub "\n</think>\n\nOK.<|im_end|>" (empty reasoning)
    # Misbehaviour of a broken or hostile engine (generate and chat routes):
    bad_shape_every: int = 0  # every Nth request answers valid JSON in the wrong shape (0: never)
    redirect_to: str | None = None  # answer 307 to this base URL (+ the same path) instead of generating
    pad_reply_bytes: int = 0  # add a padding field of this many bytes to every reply
    chunked: bool = False  # send replies with Transfer-Encoding: chunked (no Content-Length)
    reply_model: str | None = None  # the model a reply names (default: the served name; /generate names none)
    health_body: str = ""  # GET /health body (e.g. "ok" as plain text, as some servers answer)
    api_key: str | None = None  # require "Authorization: Bearer <key>" on every route but /health* (401 otherwise)
    # Tool calls: ((trigger, name, arguments), ...), see the module docstring.
    tool_rules: tuple = ()
    tool_call_parser: bool = False  # chat route: answer parsed `tool_calls` instead of the call's text
    tool_call_without_think_end: bool = False  # a call opened without closing </think> first (Qwen3.5 does this)
    # The server as started (and what it reports at /model_info, /server_info, /v1/models):
    deterministic: bool = False  # --enable-deterministic-inference: only then does a seed change the output
    context_length: int = 32768  # the model's context length (max_model_len)
    missing_routes: tuple = ()  # routes answered with 404, e.g. ("/model_info",) for an older server
    version: str = "0.5.23"
    health_503_s: float = 0.0  # /health answers 503 for this long after start (a starting server)
    health_delay_s: float = 0.0  # each /health takes this long (the real one generates a token: >= 1 s)
    router: bool = False  # sglang-router in front: /health is always 200, /readiness tells
    router_workers_healthy: bool = True  # router: whether /readiness finds a healthy worker


@dataclass
class _Stats:
    generate_requests: int = 0
    generate_prompts: int = 0
    chat_requests: int = 0
    model_info_requests: int = 0  # identity probes (GET /model_info or /get_model_info)
    health_requests: int = 0
    failed: int = 0
    unauthorized: int = 0  # requests refused for a missing or wrong bearer token
    redirected: int = 0
    prompts_seen: dict[str, int] = field(default_factory=dict)
    last_body: dict | None = None


class _Generator:
    def __init__(self, cfg: LoopbackConfig):
        self.cfg = cfg
        self._tok = None
        if cfg.tokenizer_json:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(cfg.tokenizer_json)

    def count(self, text: str) -> int:
        """Tokens of ``text`` (without building the id list when there is no tokenizer: one per UTF-8 byte)."""
        return len(self.encode(text)) if self._tok is not None else len(text.encode())

    def encode(self, text: str) -> list[int]:
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=False).ids
        return [_BYTE_ID0 + b for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=False)
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if _BYTE_ID0 <= i < _BYTE_ID0 + 256:
                run.append(i - _BYTE_ID0)
                continue
            if run:
                parts.append(run.decode("utf-8", "replace"))
                run = bytearray()
            parts.append("</think>" if i == self.cfg.think_end_id else "<|im_end|>" if i == self.cfg.eos_id else f"<{i}>")
        if run:
            parts.append(run.decode("utf-8", "replace"))
        return "".join(parts)

    def tool_rule(self, last_message: str) -> tuple[str, dict] | None:
        """(name, arguments) of the first tool rule whose trigger is in the prompt's last message."""
        for trigger, name, arguments in self.cfg.tool_rules:
            if trigger in last_message:
                return name, dict(arguments)
        return None

    def last_message(self, ids: list[int]) -> str:
        if not self.cfg.tool_rules:
            return ""
        if self._tok is None:
            raise ValueError("loopback tool_rules on /generate need tokenizer_json (to read the prompt)")
        parts = self._tok.decode(ids, skip_special_tokens=False).split("<|im_start|>")
        return parts[-2] if len(parts) >= 2 else parts[-1]

    @staticmethod
    def call_block(name: str, arguments: dict) -> str:
        """A Qwen3.5/3.6 ``<tool_call>`` block calling ``name``."""
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    @classmethod
    def call_text(cls, name: str, arguments: dict) -> str:
        """The reply's content for a call: a sentence, then the Qwen3.5/3.6 block."""
        return f"I will call {name}.\n\n" + cls.call_block(name, arguments)

    def full_output(self, key: bytes, tool: tuple[str, dict] | None = None) -> list[int]:
        """The untruncated deterministic output for a prompt key (a tool call's, given ``tool``)."""
        c = self.cfg
        if tool is not None:
            rng = random.Random(hashlib.blake2b(key, digest_size=8).digest())
            reasoning = [rng.randrange(c.token_lo, c.token_hi) for _ in range(rng.randint(*c.reasoning_tokens))]
            if c.tool_call_without_think_end:  # the block opens inside the reasoning, at a line start
                return reasoning + self.encode(("\n" if reasoning else "") + self.call_block(*tool)) + [c.eos_id]
            return reasoning + [c.think_end_id] + self.encode("\n\n" + self.call_text(*tool)) + [c.eos_id]
        if c.instant:
            return [c.token_lo, c.think_end_id, c.token_lo + 1, c.eos_id]
        rng = random.Random(hashlib.blake2b(key, digest_size=8).digest())
        if c.stub_ratio and rng.random() < c.stub_ratio:
            # The failure DFlash data pipelines hit: a 6-token loss mask `</think>\n\nOK.<|im_end|>\n`.
            return self.encode("\n") + [c.think_end_id] + self.encode("\n\nOK.") + [c.eos_id]
        n_r = rng.randint(*c.reasoning_tokens)
        n_c = rng.randint(*c.content_tokens)
        body = [rng.randrange(c.token_lo, c.token_hi) for _ in range(n_r + n_c)]
        return body[:n_r] + [c.think_end_id] + body[n_r:] + [c.eos_id]

    def generate(self, key: bytes, params: dict, tool: tuple[str, dict] | None = None) -> tuple[list[int], dict]:
        full = self.full_output(key, tool)
        max_new = int(params.get("max_new_tokens") or 128)
        stops = set(params.get("stop_token_ids") or ()) | {self.cfg.eos_id}
        if params.get("ignore_eos"):
            # keep generating past end-of-turn, as a real engine would, up to max_new_tokens
            body = [t for t in full if t not in stops]
            out = (body * (max_new // max(len(body), 1) + 1))[:max_new]
            return out, {"type": "length", "length": max_new}
        out: list[int] = []
        for t in full:
            if len(out) >= max_new:
                return out, {"type": "length", "length": max_new}
            out.append(t)
            if t in stops:
                return out, {"type": "stop", "matched": t}
        return out, {"type": "stop", "matched": None}


def _prompt_key(ids: list[int] | None, text: str | None, seed: Any) -> bytes:
    base = _dumps(ids) if ids is not None else (text or "").encode()
    return base + b"|" + str(seed).encode()


def split_reasoning_qwen3(text: str, force_reasoning: bool) -> tuple[str, str]:
    """(reasoning, content) as SGLang's ``--reasoning-parser qwen3`` splits a reply's text.

    ``parser/reasoning_parser.py``: ``BaseReasoningFormatDetector._detect_and_parse_impl`` with the
    ``Qwen3Detector``'s tokens (``<think>``/``</think>``, ``<tool_call>`` as an implicit end of the reasoning).
    In reasoning when forced (thinking on) or when the text opens ``<think>``; leading ``<think>`` dropped; cut
    at the first ``</think>``; without one, a ``<tool_call>`` at a line start ends the reasoning, else all of
    it is reasoning (cut by the length limit). Nothing is stripped.
    """
    if not (force_reasoning or THINK_START in text):
        return "", text
    while text.startswith(THINK_START):
        text = text[len(THINK_START):]
    if THINK_END in text:
        reasoning, content = text.split(THINK_END, 1)
        return reasoning, content
    idx = text.find(TOOL_CALL_START)
    while idx != -1 and idx > 0 and text[idx - 1] != "\n":
        idx = text.find(TOOL_CALL_START, idx + 1)
    if idx != -1:
        return text[:idx], text[idx:]
    return text, ""


def _chatml(messages: list, tools: list | None, thinking: bool) -> str:
    """A ChatML rendering of a chat request (tools in a system turn), for counting its prompt tokens."""
    parts = []
    if tools:
        parts.append("<|im_start|>system\n# Tools\n" + json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
                     + "<|im_end|>\n")
    for m in messages:
        m = m if isinstance(m, dict) else {}
        calls = json.dumps(m["tool_calls"], ensure_ascii=False, separators=(",", ":")) if m.get("tool_calls") else ""
        parts.append(f"<|im_start|>{m.get('role', '')}\n{m.get('content') or ''}{calls}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n<think>\n" + ("" if thinking else "\n</think>\n\n"))
    return "".join(parts)


def _context_error(cfg: LoopbackConfig, prompt_tokens: int, max_new_tokens: Any) -> str | None:
    """SGLang's refusal of a request that does not fit (``managers/tokenizer_manager.py``, the input-length and
    total-token checks of ``_validate_one_request``; no auto-truncation by default), else None."""
    ctx = cfg.context_length
    if prompt_tokens >= ctx:
        return f"The input ({prompt_tokens} tokens) is longer than the model's context length ({ctx} tokens)."
    if isinstance(max_new_tokens, int) and max_new_tokens + prompt_tokens > ctx:
        return (f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
                f"a total of {max_new_tokens + prompt_tokens} tokens: {prompt_tokens} tokens from the input messages "
                f"and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit.")
    return None


def _tool_schema_error(tools: list) -> str | None:
    """SGLang's check of each tool's ``parameters`` (``entrypoints/openai/serving_chat.py``,
    ``_validate_request``: ``Draft202012Validator.check_schema``), else None."""
    if not tools:
        return None
    from jsonschema import Draft202012Validator, SchemaError

    for i, tool in enumerate(tools):
        params = ((tool or {}).get("function") or {}).get("parameters") if isinstance(tool, dict) else None
        if params is None:
            continue
        try:
            Draft202012Validator.check_schema(params)
        except SchemaError as e:
            return f"Tool {i} function has invalid 'parameters' schema: {e}"
        except RecursionError:
            return f"Tool {i} function 'parameters' schema is too deeply nested or contains a cycle."
    return None


def build_app(cfg: LoopbackConfig, stats: _Stats | None = None):
    """The aiohttp application (exposed for embedding)."""
    from aiohttp import web

    gen = _Generator(cfg)
    stats = stats if stats is not None else _Stats()
    served = cfg.served_model_name or cfg.model_path
    counter = {"n": 0}
    started = time.monotonic()

    def jresp(obj: Any, status: int = 200) -> "web.Response":
        resp = web.Response(body=_dumps(obj), status=status, content_type="application/json")
        if cfg.chunked:
            resp.enable_chunked_encoding()
        return resp

    def generate_error(message: str, status: int = 400) -> "web.Response":
        # http_server.py `_create_error_response`: a ValueError of /generate
        return jresp({"error": {"message": message}}, status)

    def chat_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> "web.Response":
        # entrypoints/openai/serving_base.py `create_error_response` (protocol.py `ErrorResponse`)
        return jresp({"object": "error", "message": message, "type": err_type, "param": None, "code": status}, status)

    def maybe_fail(request: "web.Request") -> "web.Response | None":
        counter["n"] += 1
        chat_route = request.path.startswith("/v1/")
        if cfg.fail_every and counter["n"] % cfg.fail_every == 0:
            stats.failed += 1
            message = "loopback: injected failure"
            return (chat_error(message, cfg.fail_status, "ServiceUnavailableError") if chat_route
                    else generate_error(message, cfg.fail_status))
        if cfg.redirect_to:
            stats.redirected += 1
            raise web.HTTPTemporaryRedirect(cfg.redirect_to.rstrip("/") + request.path)
        if cfg.bad_shape_every and counter["n"] % cfg.bad_shape_every == 0:
            stats.failed += 1
            wrong = ({"choices": ["not an object"], "model": served} if chat_route
                     else {"output_ids": "not ids", "meta_info": []})
            return jresp(wrong)
        return None

    def finish_reply(obj: Any) -> Any:
        if cfg.pad_reply_bytes:
            for item in obj if isinstance(obj, list) else [obj]:
                item["padding"] = "x" * cfg.pad_reply_bytes
        return obj

    async def delay(n_tokens: int) -> None:
        wait = cfg.delay_s + cfg.per_token_s * n_tokens
        if wait > 0:
            await asyncio.sleep(wait)

    def seed_of(value: Any) -> Any:
        # sampling/sampling_batch_info.py: the batch carries a request's sampling_seed only with
        # --enable-deterministic-inference (chat `seed` becomes sampling_seed: entrypoints/openai/protocol.py)
        return value if cfg.deterministic else None

    def one(ids: list[int] | None, text: str | None, params: dict, t0: float, rid: int) -> dict:
        if ids is None:
            ids = gen.encode(text or "")
        key = _prompt_key(ids, None, seed_of(params.get("sampling_seed")))
        out, finish = gen.generate(key, params, gen.tool_rule(gen.last_message(ids)) if cfg.tool_rules else None)
        digest = hashlib.blake2b(_dumps(ids), digest_size=8).hexdigest()
        stats.prompts_seen[digest] = stats.prompts_seen.get(digest, 0) + 1
        item = {
            "text": gen.decode([t for t in out if t != cfg.eos_id]),
            "meta_info": {
                "id": f"loopback-{rid}",
                "finish_reason": finish,
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "e2e_latency": time.perf_counter() - t0,
            },
        }
        if cfg.output_ids:
            item["output_ids"] = out
        return item

    async def generate(request: "web.Request") -> "web.Response":
        t0 = time.perf_counter()
        body = _loads(await request.read())
        stats.generate_requests += 1
        stats.last_body = body
        if (failed := maybe_fail(request)) is not None:
            return failed
        params = body.get("sampling_params") or {}
        ids, text = body.get("input_ids"), body.get("text")
        batch = isinstance(ids, list) and ids and isinstance(ids[0], list) or isinstance(text, list)
        items = (ids if ids is not None else text) if batch else [ids if ids is not None else text]
        for x in items:
            n_prompt = len(x) if ids is not None else gen.count(x or "")
            if (error := _context_error(cfg, n_prompt, params.get("max_new_tokens"))) is not None:
                return generate_error(error)
        if batch:
            stats.generate_prompts += len(items)
            outs = [one(x if ids is not None else None, None if ids is not None else x, params, t0, stats.generate_requests)
                    for x in items]
            await delay(max(o["meta_info"]["completion_tokens"] for o in outs))
            for o in outs:
                o["meta_info"]["e2e_latency"] = time.perf_counter() - t0
            return jresp(finish_reply(outs))
        stats.generate_prompts += 1
        out = one(ids, text, params, t0, stats.generate_requests)
        await delay(out["meta_info"]["completion_tokens"])
        out["meta_info"]["e2e_latency"] = time.perf_counter() - t0
        if cfg.reply_model:
            out["model"] = cfg.reply_model
        return jresp(finish_reply(out))

    async def chat(request: "web.Request") -> "web.Response":
        t0 = time.perf_counter()
        body = _loads(await request.read())
        stats.chat_requests += 1
        stats.last_body = body
        if (failed := maybe_fail(request)) is not None:
            return failed
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)] or [{}]
        tools = body.get("tools") or []
        if (error := _tool_schema_error(tools)) is not None:
            return chat_error(error)
        think = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
        n_prompt = gen.count(_chatml(messages, tools, think))
        max_new = body.get("max_completion_tokens") or body.get("max_tokens")
        if (error := _context_error(cfg, n_prompt, max_new)) is not None:
            return chat_error(error)
        key = _prompt_key(None, json.dumps(body.get("messages"), sort_keys=True), seed_of(body.get("seed")))
        params = {"max_new_tokens": max_new or 128, "ignore_eos": body.get("ignore_eos")}
        tool = gen.tool_rule(str(messages[-1].get("content") or "")) if cfg.tool_rules else None
        out, finish = gen.generate(key, params, tool)
        await delay(len(out))
        text = gen.decode([t for t in out if t != cfg.eos_id])
        reasoning, content = split_reasoning_qwen3(text, think) if cfg.reasoning_parser else ("", text)
        tool_calls = None
        # serving_chat.py: the tool-call parser runs when the server has one and the request carries tools;
        # the text before the first call stays the content, the finish reason becomes tool_calls.
        if (tool is not None and cfg.tool_call_parser and tools and finish["type"] == "stop"
                and TOOL_CALL_START in content):
            content = content[: content.index(TOOL_CALL_START)].rstrip("\n")
            tool_calls = [{"id": f"call_{stats.chat_requests}_0", "type": "function", "index": 0,
                           "function": {"name": tool[0], "arguments": json.dumps(tool[1])}}]
            finish = {"type": "tool_calls"}
        # serving_chat.py: `content=text if text else ""`, and
        # `reasoning_content=reasoning_text if reasoning_text ... else None`: empty reasoning is null
        message = {"role": "assistant", "content": content or "", "reasoning_content": reasoning or None,
                   "tool_calls": tool_calls}
        return jresp(finish_reply({
            "id": f"loopback-{stats.chat_requests}", "object": "chat.completion", "created": int(time.time()),
            # serving_chat.py: `model=request.model` (the request's, default "default"): echoed, never checked
            "model": cfg.reply_model or body.get("model") or "default",
            "choices": [{"index": 0, "finish_reason": finish["type"], "message": message,
                         "matched_stop": finish.get("matched")}],
            # usage_processor.py: prompt and completion tokens as the engine counted them
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(out), "total_tokens": n_prompt + len(out)},
        }))

    async def health(_request: "web.Request") -> "web.Response":
        stats.health_requests += 1
        if cfg.router:  # sgl-model-gateway src/server.rs `health` = `liveness`: 200 "OK" whatever the workers do
            return web.Response(status=200, text="OK")
        # http_server.py `health_generate`: 503 while starting; otherwise a one-token generation
        if time.monotonic() - started < cfg.health_503_s:
            return web.Response(status=503)
        if cfg.health_delay_s:
            await asyncio.sleep(cfg.health_delay_s)
        if cfg.health_body:
            return web.Response(status=200, text=cfg.health_body)  # text/plain
        return web.Response(status=200)

    async def readiness(_request: "web.Request") -> "web.Response":
        # sgl-model-gateway src/server.rs `readiness`: 503 unless a worker is healthy
        if cfg.router_workers_healthy:
            return jresp({"status": "ready", "healthy_workers": 1, "total_workers": 1})
        return jresp({"status": "not ready", "reason": "insufficient healthy workers"}, 503)

    @web.middleware
    async def bearer_auth(request: "web.Request", handler: Any) -> "web.StreamResponse":
        # utils/auth.py: /health*, /ready*, /metrics* never need the key; 401 {"error": "Unauthorized"}.
        # The router (sgl-model-gateway src/server.rs `public_routes`) also leaves its info routes open.
        public = request.path.startswith(("/health", "/ready", "/metrics")) or (cfg.router and request.path in _ROUTER_PUBLIC)
        if cfg.api_key and not public and request.headers.get("Authorization") != f"Bearer {cfg.api_key}":
            stats.unauthorized += 1
            return jresp({"error": "Unauthorized"}, 401)
        if request.path in cfg.missing_routes:
            return jresp({"detail": "Not Found"}, 404)  # FastAPI's answer for a route it does not have
        return await handler(request)

    async def model_info(_request: "web.Request") -> "web.Response":
        # http_server.py `model_info` (`/get_model_info` is its deprecated alias)
        stats.model_info_requests += 1
        return jresp({"model_path": cfg.model_path, "served_model_name": served, "tokenizer_path": cfg.model_path,
                      "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                      "load_format": "auto", "reasoning_parser": cfg.reasoning_parser,
                      "tool_call_parser": "qwen3_coder" if cfg.tool_call_parser else None,
                      "disaggregation_mode": "null", "has_image_understanding": False,
                      "has_audio_understanding": False, "model_type": "qwen3_5", "architectures": None})

    async def server_info(_request: "web.Request") -> "web.Response":
        # http_server.py `server_info`: the resolved server arguments (utils/common.py `build_server_info`)
        return jresp({"model_path": cfg.model_path, "served_model_name": served, "tokenizer_path": cfg.model_path,
                      "context_length": None, "reasoning_parser": cfg.reasoning_parser,
                      "tool_call_parser": "qwen3_coder" if cfg.tool_call_parser else None,
                      "enable_deterministic_inference": cfg.deterministic, "api_key": None,
                      "internal_states": [], "version": cfg.version, "frontend": "python"})

    async def models(_request: "web.Request") -> "web.Response":
        # http_server.py `available_models`: one card, max_model_len = the model's context length
        return jresp({"object": "list", "data": [{"id": served, "object": "model", "created": int(time.time()),
                                                   "owned_by": "sglang", "root": served,
                                                   "max_model_len": cfg.context_length}]})

    async def get_stats(_request: "web.Request") -> "web.Response":
        return jresp({"generate_requests": stats.generate_requests, "generate_prompts": stats.generate_prompts,
                      "chat_requests": stats.chat_requests, "failed": stats.failed,
                      "distinct_prompts": len(stats.prompts_seen)})

    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[bearer_auth])
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    if cfg.router:  # the router's routes; SGLang itself has no /readiness (404)
        app.router.add_get("/readiness", readiness)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/loopback/stats", get_stats)
    return app


class LoopbackServer:
    """The loopback app on 127.0.0.1 in a background thread with its own event loop."""

    def __init__(self, cfg: LoopbackConfig | None = None, port: int = 0, host: str = "127.0.0.1", **overrides):
        self.cfg = cfg or LoopbackConfig(**overrides)
        self.host, self.port = host, port
        self.stats = _Stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LoopbackServer":
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            from aiohttp import web

            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                self._runner = web.AppRunner(build_app(self.cfg, self.stats), access_log=None)
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
                loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            except BaseException as e:  # noqa: BLE001
                error.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="sglang-loopback", daemon=True)
        self._thread.start()
        ready.wait(30)
        if error:
            raise error[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def __enter__(self) -> "LoopbackServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LoopbackProcess:
    """The loopback server in its own process (own GIL; can be SIGKILLed). ``args``: CLI flags."""

    def __init__(self, *args: str, port: int = 0, python: str | None = None, startup_timeout_s: float = 60.0):
        self.argv = [python or sys.executable, "-m", "tests.support.sglang_loopback", "--port", str(port), *args]
        self.startup_timeout_s = startup_timeout_s
        self.proc: "subprocess.Popen | None" = None
        self.url = ""

    def start(self) -> "LoopbackProcess":
        import os
        import subprocess

        from pathlib import Path

        root = str(Path(__file__).resolve().parents[2])  # the checkout: `tests.support` is importable from there
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": root + (os.pathsep + path if path else "")}
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        box: dict[str, str] = {}

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            box["line"] = self.proc.stdout.readline()

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(self.startup_timeout_s)
        line = box.get("line", "")
        if not line.startswith("{"):
            self.stop()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"loopback server did not start: {line!r} {err[-2000:]}")
        self.url = json.loads(line)["ready"]
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crashed host would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:  # noqa: BLE001
                self.kill()

    def __enter__(self) -> "LoopbackProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.support.sglang_loopback", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model-path", default=LoopbackConfig.model_path)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--per-token-s", type=float, default=0.0)
    p.add_argument("--instant", action="store_true", help="fixed 4-token reply, no hashing (benchmarks)")
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--fail-status", type=int, default=503)
    p.add_argument("--no-output-ids", action="store_true", help="answer text only, like older SGLang")
    p.add_argument("--no-reasoning-parser", action="store_true", help="chat: no reasoning parser, <think> in content")
    p.add_argument("--deterministic", action="store_true", help="as --enable-deterministic-inference: seeds hold")
    p.add_argument("--context-length", type=int, default=LoopbackConfig.context_length)
    p.add_argument("--tokenizer-json", default=None)
    p.add_argument("--reasoning-tokens", type=int, nargs=2, default=list(LoopbackConfig.reasoning_tokens))
    p.add_argument("--content-tokens", type=int, nargs=2, default=list(LoopbackConfig.content_tokens))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    cfg = LoopbackConfig(model_path=args.model_path, served_model_name=args.served_model_name, delay_s=args.delay_s,
                         per_token_s=args.per_token_s, instant=args.instant, fail_every=args.fail_every,
                         fail_status=args.fail_status, output_ids=not args.no_output_ids,
                         reasoning_parser=None if args.no_reasoning_parser else LoopbackConfig.reasoning_parser,
                         deterministic=args.deterministic, context_length=args.context_length,
                         tokenizer_json=args.tokenizer_json, reasoning_tokens=tuple(args.reasoning_tokens),
                         content_tokens=tuple(args.content_tokens))
    from aiohttp import web


    async def serve() -> None:
        runner = web.AppRunner(build_app(cfg), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port, backlog=2048)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(json.dumps({"ready": f"http://{args.host}:{port}"}), flush=True)
        await asyncio.Event().wait()

    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(serve())
        else:
            uvloop.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
