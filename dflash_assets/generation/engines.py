"""Generation engine clients: one interface over three kinds of engine.

- ``SGLangEngine``: SGLang's native API. ``POST /generate`` with ``input_ids``
  (the prompt rendered with the target's chat template and generation prompt,
  tokenized here) and ``sampling_params``; reads ``output_ids`` (or ``text``)
  and ``meta_info`` (``finish_reason`` {type: stop|length|abort},
  ``prompt_tokens``, ``completion_tokens``, ``e2e_latency``). The reasoning split is done on the ids
  (``generation.chat_tokenizer.ChatTokenizer``): the generation prompt ends
  with ``<think>\\n``, so the output is ``reasoning </think> content <|im_end|>``
  and is cut at the ``</think>`` id.
  Also works behind sglang-router (same API, one URL).
- ``OpenAIEngine``: ``POST /v1/chat/completions`` (SGLang, vLLM,
  ``transformers serve``) with ``chat_template_kwargs: {enable_thinking}``;
  reads ``reasoning_content`` and ``content``. Whether the server splits the
  reasoning is decided once, at probe time (``ServerFacts.reasoning_parser``,
  or the endpoint's ``reasoning_parser`` setting), never from one reply: a
  null ``reasoning_content`` from a server with a parser is empty reasoning
  (SGLang sends null then), and the content and tool calls stay where they
  are; only a server without a parser gets its ``<think>`` block split here.
- ``TransformersEngine``: in-process ``model.generate``, the requests in
  flight batched into one call, on a host that has nothing else (a CPU box,
  one GPU without a server). Explicit opt-in only (an endpoint of kind
  ``transformers`` in the fleet config); nothing ever falls back to it.
  Its engines share one loaded model per process (the next shard's engine
  reuses the weights and compiled graphs of the last).

Probe (``Engine.server_facts`` and ``Engine.wait_healthy``, both HTTP kinds):
identity from ``GET /model_info``, then the deprecated ``/get_model_info``,
then ``GET /v1/models`` (a missing route is skipped, never "unreachable");
the server's flags from ``GET /server_info`` (then ``/get_server_info``):
``enable_deterministic_inference`` (does a seed hold), ``reasoning_parser``,
``tool_call_parser``, ``version``; the context length from ``/v1/models``'
``max_model_len``. Health is ``GET /health`` without the API key (SGLang
exempts it), waited on while it answers 503 (a starting or busy SGLang; its
health check is a one-token generation that may take up to 20 s); behind
sglang-router, whose ``/health`` is always 200, ``/readiness`` says whether a
worker is healthy.

Before a request is sent its prompt tokens plus ``max_new_tokens`` are checked
against the endpoint's context length (``Engine.fit_to_context``): a request
that does not fit gets ``max_new_tokens`` lowered to what fits when at least
``context_min_new_tokens`` remain, else ``ContextOverflow`` is raised without a
round trip (SGLang would answer 400).

Every engine answers ``probe()`` (health, served model, latency) and
``chat(messages, generation) -> ChatResult``; failures raise ``EngineError``
whose ``retryable``/``connection`` flags drive the fleet's retry and failover
(``generation.fleet``). Broken or hostile servers are guarded against in
``Engine`` (no redirects, read timeout, capped bodies, reply shape and model
checks, bearer token never shown). ``GenerationConfig`` (``generation.config``, re-exported
here) holds the sampling settings and gives the ``config_hash`` stored with every completion row.

Starting a server on a host is ``generation.server``'s job.

Reads: HTTP endpoints, the target's chat object (``target_model.chat.TargetChat``, or a bare tokenizer object;
for the native and in-process paths), a model directory (in-process path; its tokenizer through
``TargetModelSpec.chat()`` when no chat object is given). Writes nothing.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import orjson

from dflash_assets.generation.chat_tokenizer import ChatTokenizer, strip_stop_text
from dflash_assets.generation.config import GenerationConfig, hf_generation_settings, normalize_model_id
from dflash_assets.target_model.chat_template import split_reasoning_text

_log = logging.getLogger(__name__)


def json_dumps(obj: Any) -> bytes:
    """orjson: ~5x faster than json on the request/response hot path."""
    return orjson.dumps(obj)


json_loads = orjson.loads

__all__ = [
    "EngineKind",
    "GenerationConfig",
    "ChatResult",
    "EngineProbe",
    "EngineError",
    "ContextOverflow",
    "ServerFacts",
    "Engine",
    "SGLangEngine",
    "OpenAIEngine",
    "TransformersEngine",
    "next_batch",
    "normalize_model_id",
    "hf_generation_settings",
    "split_reasoning_text",
]

EngineKind = Literal["sglang", "openai", "transformers"]

# HTTP statuses worth another try: timeout, rate limit, server-side errors.
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_JSON_HEADERS = {"Content-Type": "application/json"}


# ----------------------------------------------------------------------------
# Results and errors


@dataclass(frozen=True)
class ChatResult:
    """One generated assistant turn."""

    content: str
    reasoning_content: str
    finish_reason: str  # stop | length | abort | other server value
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    endpoint: str
    served_model: str
    tool_calls: Any = None  # the server's parsed OpenAI ``tool_calls`` (a tool-call parser ran), else None
    max_new_tokens_cut: int = 0  # tokens taken off max_new_tokens so that the request fits the context length


@dataclass(frozen=True)
class EngineProbe:
    """What one endpoint said about itself."""

    endpoint: str
    kind: str
    healthy: bool
    served_models: tuple[str, ...] = ()
    latency_s: float | None = None
    error: str | None = None
    dialect: str | None = None  # openai: "transformers_serve" | "openai"
    facts: "ServerFacts | None" = None  # what the server said about itself (HTTP kinds)

    @property
    def served_model(self) -> str:
        return self.served_models[0] if self.served_models else ""


@dataclass(frozen=True)
class ServerFacts:
    """What a server says about itself at probe time; None: it did not say (route missing or field absent).

    Sources (SGLang 0.5.23, ``srt/entrypoints/http_server.py``): ``/model_info`` (``model_path``,
    ``served_model_name``, ``reasoning_parser``, ``tool_call_parser``), ``/server_info`` (the resolved server
    arguments: ``enable_deterministic_inference``, ``context_length``, ``version``), ``/v1/models``
    (``id``, ``max_model_len`` = the model's context length).
    """

    names: tuple[str, ...] = ()
    reasoning_parser: str | None = None  # the parser's name; "" when the server said it has none
    tool_call_parser: str | None = None
    deterministic_inference: bool | None = None
    context_length: int | None = None
    version: str | None = None
    routes_missing: tuple[str, ...] = ()  # identity/info routes that answered 404 (skipped)
    transformers_serve: bool = False  # /v1/models cards carry `transformers serve`'s non-OpenAI `status` object

    @property
    def splits_reasoning(self) -> bool | None:
        """True/False when the server said whether it runs a reasoning parser, None when it did not."""
        return None if self.reasoning_parser is None else bool(self.reasoning_parser)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class EngineError(RuntimeError):
    """A failed request. ``retryable``: worth another try; ``connection``: the endpoint may be gone."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False,
                 connection: bool = False, endpoint: str = ""):
        super().__init__(message)
        self.status = status
        self.retryable = retryable or connection
        self.connection = connection
        self.endpoint = endpoint


class ContextOverflow(EngineError):
    """A request whose prompt leaves fewer than the minimum new tokens in the endpoint's context; never sent."""

    def __init__(self, message: str, *, prompt_tokens: int, context_length: int, endpoint: str = "",
                 by_generation_config: bool = False):
        super().__init__(message, status=None, retryable=False, endpoint=endpoint)
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        self.by_generation_config = by_generation_config  # the limit was GenerationConfig.max_context_tokens


# ----------------------------------------------------------------------------
# Engines


class Engine(abc.ABC):
    """One generation endpoint. Use as ``async with engine:``; ``probe`` then ``chat``.

    Guards against a broken or hostile server: redirects are never followed
    (the prompt goes to the configured URL only), a reply with no byte for
    ``read_timeout_s`` (+ ``read_timeout_per_token_s`` per requested token: a
    non-streaming reply comes in one piece at the end) fails the request, a
    body over ``max_response_bytes`` is cut off with an error, a reply of the
    wrong shape is a retryable ``EngineError`` naming the endpoint, and a
    reply naming a model other than the one probed is refused. ``api_key`` is
    sent as ``Authorization: Bearer`` on every request and kept out of reprs,
    errors and logs.
    """

    kind: str = ""

    def __init__(self, url: str, *, max_concurrency: int = 32, connect_timeout_s: float = 10.0,
                 request_timeout_s: float = 1800.0, probe_timeout_s: float = 10.0, name: str | None = None,
                 read_timeout_s: float | None = 300.0, read_timeout_per_token_s: float = 0.1,
                 max_response_bytes: int = 64 * 1024 * 1024, api_key: str | None = None,
                 health_wait_s: float = 60.0, health_timeout_s: float = 25.0, context_length: int | None = None,
                 context_min_new_tokens: int = 64, deterministic_inference: bool | None = None):
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.max_concurrency = max_concurrency
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.read_timeout_s = read_timeout_s
        self.read_timeout_per_token_s = read_timeout_per_token_s
        self.max_response_bytes = max_response_bytes
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.health_wait_s = health_wait_s  # how long /health may answer 503 (starting or busy) before giving up
        self.health_timeout_s = health_timeout_s  # one /health call: SGLang's check waits up to 20 s for a token
        self.configured_context_length = context_length  # overrides the server's max_model_len
        self.context_length: int | None = context_length  # set by the probe
        self.context_min_new_tokens = context_min_new_tokens
        self.configured_deterministic = deterministic_inference  # overrides the server's /server_info
        self.facts: ServerFacts | None = None
        self.served_model = ""
        self.accepted_models: set[str] = set()  # normalized ids a reply may name (set by the fleet's probe)
        self._session = None
        self._urls: dict[str, Any] = {}

    def __repr__(self) -> str:  # never the key
        return f"{type(self).__name__}({self.url!r}, served_model={self.served_model!r})"

    async def __aenter__(self) -> "Engine":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> None:
        import aiohttp

        if self._session is not None:
            return
        # One pooled keep-alive connection per concurrent request; no per-host cap beyond that.
        connector = aiohttp.TCPConnector(limit=self.max_concurrency + 4, limit_per_host=0,
                                         keepalive_timeout=60, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),  # no compressed replies: CPU on both sides
            cookie_jar=aiohttp.DummyCookieJar(),
            json_serialize=lambda o: json_dumps(o).decode(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- HTTP helpers --------------------------------------------------------

    def read_timeout_for(self, max_new_tokens: int | None) -> float | None:
        """Seconds without a reply byte after which a request fails (None: only the total limit)."""
        if self.read_timeout_s is None:
            return None
        return self.read_timeout_s + self.read_timeout_per_token_s * (max_new_tokens or 0)

    async def _send(self, method: str, path: str, payload: Any = None, *, timeout_s: float | None = None,
                    read_timeout_s: float | None = None, headers: dict | None = None,
                    auth: bool = True) -> tuple[int, bytes]:
        """One request, no redirect followed, body capped; (status, body). Transport failures are
        ``EngineError(connection=True)``. ``auth=False`` sends no bearer token."""
        import aiohttp

        if self._session is None:
            await self.open()
        kwargs: dict[str, Any] = {"headers": {**_JSON_HEADERS, **(self._auth if auth else {}), **(headers or {})},
                                  "allow_redirects": False}
        if payload is not None:
            kwargs["data"] = json_dumps(payload)
        total = timeout_s if timeout_s is not None else self.request_timeout_s
        sock_read = read_timeout_s if timeout_s is None else None
        if timeout_s is not None or sock_read is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=total, sock_connect=min(total, self.connect_timeout_s),
                                                      sock_read=min(sock_read, total) if sock_read else None)
        url = self._urls.get(path)
        if url is None:  # parsed once per path: yarl parsing is a visible share of a fast request
            from yarl import URL

            url = self._urls[path] = URL(self.url + path)
        where = f"{method} {self.url}{path}"
        try:
            async with self._session.request(method, url, **kwargs) as resp:
                status = resp.status
                if 300 <= status < 400:
                    target = resp.headers.get("Location", "?")
                    raise EngineError(f"{where}: HTTP {status} redirect to {target[:200]} not followed (the "
                                      "request goes to the configured URL only; configure the final URL)",
                                      status=status, endpoint=self.url)
                body = await self._read_capped(resp, where)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, OSError) as e:
            what = (f"no reply byte for {sock_read:g} s (read timeout)"
                    if isinstance(e, aiohttp.ServerTimeoutError) and sock_read else f"{type(e).__name__}: {e}")
            raise EngineError(f"{where}: {what}", connection=True, endpoint=self.url) from e
        return status, body

    async def _read_capped(self, resp: Any, where: str) -> bytes:
        cap = self.max_response_bytes
        declared = resp.content_length
        if declared is not None and declared > cap:
            raise EngineError(f"{where}: reply of {declared:,} bytes exceeds max_response_bytes ({cap:,})",
                              endpoint=self.url)
        if declared is not None:  # the parser stops at Content-Length: one read, the fast path
            return await resp.read()
        chunks, size = [], 0  # chunked or close-delimited: count as it comes
        async for chunk in resp.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > cap:
                raise EngineError(f"{where}: reply exceeds max_response_bytes ({cap:,}); cut off", endpoint=self.url)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _request(self, method: str, path: str, payload: Any = None, *, timeout_s: float | None = None,
                       read_timeout_s: float | None = None, headers: dict | None = None) -> Any:
        """JSON request; maps every failure to ``EngineError`` with the right flags."""
        status, body = await self._send(method, path, payload, timeout_s=timeout_s, read_timeout_s=read_timeout_s,
                                        headers=headers)
        if status >= 400:
            snippet = body[:300].decode("utf-8", "replace")
            raise EngineError(f"{method} {self.url}{path}: HTTP {status}: {snippet}", status=status,
                              retryable=status in RETRYABLE_STATUS, endpoint=self.url)
        if not body:
            return None
        try:
            return json_loads(body)
        except ValueError as e:
            raise EngineError(f"{method} {self.url}{path}: invalid JSON reply: {body[:200]!r}", retryable=True,
                              endpoint=self.url) from e

    async def _get_ok(self, path: str, *, timeout_s: float | None = None, auth: bool = True) -> None:
        """Any 2xx is healthy, whatever the body (``ok``, JSON or nothing)."""
        status, body = await self._send("GET", path, timeout_s=timeout_s or self.probe_timeout_s, auth=auth)
        if status >= 400:
            raise EngineError(f"GET {self.url}{path}: HTTP {status}: {body[:300].decode('utf-8', 'replace')}",
                              status=status, retryable=status in RETRYABLE_STATUS, endpoint=self.url)

    async def wait_healthy(self) -> None:
        """``GET /health`` without the API key until it answers 2xx; raises the last ``EngineError``.

        SGLang (``http_server.py``, ``health_generate``) answers 503 while starting, and when its one-token
        health generation gets no reply within ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) on a busy server; it
        exempts ``/health*`` from the API key (``utils/auth.py``). So each call may take ``health_timeout_s``
        and a 503 is asked again until ``health_wait_s`` have passed; any other failure is final at once.
        """
        deadline = time.monotonic() + self.health_wait_s
        pause = 0.5
        while True:
            try:
                await self._get_ok("/health", timeout_s=max(self.health_timeout_s, self.probe_timeout_s), auth=False)
                await self._router_ready()
                return
            except EngineError as e:
                if e.status != 503 or time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)

    async def _router_ready(self) -> None:
        """sglang-router (sgl-model-gateway ``src/server.rs``) answers ``/health`` with 200 whatever its workers
        do; its ``/readiness`` is 503 until a worker is healthy. Only that 503 counts: a server without the route
        answers 404 (sent with the key: SGLang's key check covers ``/readiness``, its exemption is ``/ready*``)."""
        try:
            await self._get_ok("/readiness")
        except EngineError as e:
            if e.status == 503:
                raise EngineError(f"{e} (sglang-router: no healthy worker behind it)", status=e.status,
                                  retryable=e.retryable, endpoint=self.url) from e

    async def _optional_json(self, paths: Sequence[str], missing: list[str]) -> dict | None:
        """The first of ``paths`` that answers a JSON object; a route that is not there (404/405) or kept for an
        admin key (403) is noted in ``missing`` and skipped. A connection failure or any other HTTP error (401: our
        key is refused) is raised."""
        for path in paths:
            try:
                reply = await self._request("GET", path, timeout_s=self.probe_timeout_s)
            except EngineError as e:
                if e.status in (403, 404, 405):
                    missing.append(path)
                    continue
                raise
            if isinstance(reply, dict):
                return reply
            missing.append(path)
        return None

    async def server_facts(self) -> ServerFacts:
        """Identity, flags and context length from the routes SGLang serves (see ``ServerFacts``).

        ``/model_info`` first, then the deprecated ``/get_model_info`` (0.5.23 still serves it, logging a
        deprecation; the router drops the alias), then ``/v1/models``; ``/server_info`` then ``/get_server_info``.
        A route that is missing is skipped; only a connection failure or a refusal (401, 5xx) raises.
        """
        missing: list[str] = []
        info = await self._optional_json(("/model_info", "/get_model_info"), missing) or {}
        server = await self._optional_json(("/server_info", "/get_server_info"), missing) or {}
        models = await self._optional_json(("/v1/models",), missing) or {}
        with self._reply_shape("/model_info", info):
            names = [str(info.get(k) or "") for k in ("served_model_name", "model_path")]
            cards = [m for m in (models.get("data") or []) if isinstance(m, dict) and m.get("id")]
            names += [str(m["id"]) for m in cards]
            context = next((_int_or_none(m.get("max_model_len")) for m in cards if _int_or_none(m.get("max_model_len"))),
                           None) or _int_or_none(server.get("context_length"))

            def flag(key: str) -> str | None:  # "" when the server says it has none
                for source in (info, server):
                    if key in source:
                        return str(source[key] or "")
                return None

            deterministic = server.get("enable_deterministic_inference")
            version = server.get("version")
            tagged = any(isinstance(m.get("status"), dict) for m in cards)
        return ServerFacts(tuple(dict.fromkeys(n for n in names if n)), flag("reasoning_parser"),
                           flag("tool_call_parser"), deterministic if isinstance(deterministic, bool) else None,
                           context, str(version) if version else None, tuple(missing), tagged)

    def _adopt_facts(self, facts: ServerFacts) -> None:
        self.facts = facts
        self.context_length = self.configured_context_length or facts.context_length

    @property
    def seed_honoured(self) -> bool:
        """Whether a request's seed makes its output reproducible here: configured, else the server's
        ``enable_deterministic_inference`` (SGLang passes ``sampling_seed`` to its sampler only then:
        ``sampling/sampling_batch_info.py``)."""
        if self.configured_deterministic is not None:
            return self.configured_deterministic
        return bool(self.facts and self.facts.deterministic_inference)

    def fit_to_context(self, prompt_tokens: int, gen: GenerationConfig) -> tuple[GenerationConfig, int]:
        """``gen`` with ``max_new_tokens`` lowered so that prompt + new tokens fit the context length, and by how
        many tokens it was lowered; ``ContextOverflow`` when fewer than ``context_min_new_tokens`` would remain.
        The context is the endpoint's, or ``gen.max_context_tokens`` where that is tighter.

        SGLang's rule (``managers/tokenizer_manager.py``, ``_validate_one_request``): a prompt of context_len
        tokens or more, or prompt + max_new_tokens above context_len, is refused with 400.
        """
        ctx = self.context_length
        cap = gen.max_context_tokens  # the data's own limit (e.g. the drafter's max_length), when tighter
        by_config = bool(cap) and (not ctx or cap < ctx)
        if by_config:
            ctx = cap
        if not ctx:
            return gen, 0
        room = ctx - prompt_tokens
        if room >= gen.max_new_tokens:
            return gen, 0
        if room >= max(1, self.context_min_new_tokens):
            return gen.model_copy(update={"max_new_tokens": room}), gen.max_new_tokens - room
        limit = f"the generation config's max_context_tokens {ctx}" if by_config else f"the context length {ctx}"
        raise ContextOverflow(f"{self.url}: prompt of {prompt_tokens} tokens leaves {max(room, 0)} of {limit} "
                              f"(at least {self.context_min_new_tokens} new tokens wanted); not sent",
                              prompt_tokens=prompt_tokens, context_length=ctx, endpoint=self.url,
                              by_generation_config=by_config)

    @contextlib.contextmanager
    def _reply_shape(self, path: str, reply: Any):
        """A reply of valid JSON in the wrong shape: a retryable ``EngineError`` naming the endpoint."""
        try:
            yield
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"{self.url}{path}: unexpected reply shape ({type(e).__name__}: {e}): "
                              f"{str(reply)[:200]}", retryable=True, endpoint=self.url) from e

    def _check_model(self, path: str, named: Any) -> None:
        """Refuse a reply that names a model other than the one this endpoint was probed serving."""
        if not named or not (self.served_model or self.accepted_models):
            return
        named = str(named)
        ok = {normalize_model_id(self.served_model), *self.accepted_models} - {""}
        if named != self.served_model and normalize_model_id(named) not in ok:
            raise EngineError(f"{self.url}{path}: reply names model {named[:200]!r}, this endpoint was probed "
                              f"serving {self.served_model!r}; reply refused", retryable=True, endpoint=self.url)

    # -- interface -----------------------------------------------------------

    @abc.abstractmethod
    async def probe(self) -> EngineProbe:
        """Liveness and identity; never raises."""

    @abc.abstractmethod
    async def chat(self, messages: Sequence[dict], generation: GenerationConfig) -> ChatResult:
        """Generate the next assistant turn for ``messages`` (role/content dicts; agentic ones also
        tool_calls/tool results). Engines take ``tools=`` (JSON schemas) for agentic conversations."""


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


class SGLangEngine(Engine):
    """SGLang's native ``/generate`` API (also sglang-router)."""

    kind = "sglang"

    def __init__(self, url: str, tokenizer: Any, **kwargs):
        super().__init__(url, **kwargs)
        if tokenizer is None:
            raise ValueError("the SGLang native engine needs the target's tokenizer (chat template) to build input_ids")
        self.tok = ChatTokenizer(tokenizer)

    async def probe(self) -> EngineProbe:
        """Identity and flags (``server_facts``: a missing route is skipped), then health (``wait_healthy``)."""
        t0 = time.perf_counter()
        try:
            facts = await self.server_facts()
        except EngineError as e:
            return EngineProbe(self.url, self.kind, False, error=str(e))
        latency = time.perf_counter() - t0
        self._adopt_facts(facts)
        names = facts.names
        self.served_model = names[0] if names else ""
        healthy, error = True, None if names else "no model named by /model_info, /get_model_info or /v1/models"
        try:
            await self.wait_healthy()
        except EngineError as e:
            healthy, error = False, str(e)
        return EngineProbe(self.url, self.kind, healthy, names, latency, error, facts=facts)

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


class OpenAIEngine(Engine):
    """``/v1/chat/completions`` of SGLang, vLLM or ``transformers serve``."""

    kind = "openai"

    def __init__(self, url: str, *, api_key: str | None = None, extra_sampling_params: bool | None = None,
                 reasoning_parser: bool | None = None, tokenizer: Any = None, **kwargs):
        super().__init__(url, api_key=api_key, **kwargs)
        self.extra_sampling_params = extra_sampling_params  # None: decided by the probe
        self.configured_reasoning_parser = reasoning_parser  # None: decided by the probe
        self.splits_reasoning: bool | None = reasoning_parser
        self.tok = ChatTokenizer(tokenizer) if tokenizer is not None else None  # exact prompt counts, when given
        self.dialect: str | None = None

    async def probe(self) -> EngineProbe:
        """``server_facts``: SGLang's ``/model_info`` and ``/server_info`` when served (whether it runs a
        reasoning parser, deterministic inference), ``/v1/models`` (identity, context length, the dialect:
        ``transformers serve`` tags its cards); then ``/health`` without the key (404 tolerated: some proxies
        have none)."""
        t0 = time.perf_counter()
        try:
            facts = await self.server_facts()
        except EngineError as e:
            return EngineProbe(self.url, self.kind, False, error=str(e))
        latency = time.perf_counter() - t0
        self._adopt_facts(facts)
        names = facts.names
        self.dialect = "transformers_serve" if facts.transformers_serve else "openai"
        if self.extra_sampling_params is None:
            self.extra_sampling_params = self.dialect != "transformers_serve"
        if self.configured_reasoning_parser is None:
            # `transformers serve` has no reasoning parser: the <think> block stays in the content
            self.splits_reasoning = False if self.dialect == "transformers_serve" else facts.splits_reasoning
        healthy, error = True, None
        try:
            await self.wait_healthy()
        except EngineError as e:
            if e.status != 404:  # vLLM/SGLang/transformers have /health; some proxies do not
                healthy, error = False, str(e)
        if not names:
            error = error or "no model named by /model_info, /get_model_info or /v1/models"
        self.served_model = names[0] if names else ""
        return EngineProbe(self.url, self.kind, healthy, names, latency, error, self.dialect, facts)

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
# powers of two both, so the compiled decode step (one graph per shape) meets a few shapes in a process, compiled
# once each, and padding at most doubles a batch's rows.
STATIC_ROW_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
STATIC_WIDTH_BUCKETS = (256, 512, 1024, 2048)
# Prompts longer than this decode on the dynamic cache: a static cache's prefill attends over the whole cache
# length, and a batch of 64 prompts of 8K tokens runs an H200 out of memory. Few prompts are this long.
STATIC_MAX_WIDTH = STATIC_WIDTH_BUCKETS[-1]


def static_width(width: int) -> int:
    """The padded prompt width of a static-cache batch whose longest prompt has `width` tokens (<= STATIC_MAX_WIDTH)."""
    return next(b for b in STATIC_WIDTH_BUCKETS if b >= width)


def static_row_cap(padded_width: int, max_rows: int, max_tokens: int | None = None) -> int:
    """The most rows a static-cache batch of this padded width may hold: the largest row bucket within `max_rows`
    and `max_tokens` padded prompt tokens, or that limit itself when it is under the smallest bucket."""
    limit = max(1, min(max_rows, max_tokens // padded_width if max_tokens else max_rows))
    return max((b for b in STATIC_ROW_BUCKETS if b <= limit), default=limit)


def static_batch_shape(rows: int, width: int, max_rows: int, max_tokens: int | None = None) -> tuple[int, int]:
    """(rows, prompt width) a static-cache batch of `rows` prompts at most `width` tokens long is padded to: the
    next width bucket, and the next row bucket within `static_row_cap` (a batch over the cap, which the engine
    never forms, keeps its rows). Padding 300 long prompts up to 1,024 rows would multiply the prefill's and the
    cache's memory, hence the cap by tokens."""
    padded_width = static_width(width)
    cap = static_row_cap(padded_width, max_rows, max_tokens)
    bucket = next((b for b in STATIC_ROW_BUCKETS if b >= rows), rows)
    return max(rows, min(bucket, cap)), padded_width


@dataclass
class _LoadedModel:
    """A model loaded in this process, shared by the in-process engines that run it, with the one thread that
    loaded it and runs all its generate calls (compiled CUDA graphs keep per-thread state)."""

    model: Any
    worker: ThreadPoolExecutor
    users: int = 0
    continuous: Any = None  # transformers' ContinuousBatchingManager (cache="continuous"), while an engine is open
    continuous_key: str = ""  # the sampling settings it was started with

    def stop_continuous(self) -> None:
        """Stop the continuous-batching manager (its requests in flight finish first) and free its cache."""
        if self.continuous is not None:
            manager, self.continuous, self.continuous_key = self.continuous, None, ""
            manager.stop(block=True)


# (model path, its weights' stamp, device, dtype, cache) -> the loaded model. An engine closing leaves its model
# loaded while no other model is asked for, so the next shard's engine reuses the weights and the compiled decode
# graphs (a new model per shard would compile every shape again).
_LOADED: dict[tuple[str, str, str, str, str], _LoadedModel] = {}
_LOADED_LOCK = threading.Lock()


def _weights_stamp(model_path: str) -> str:
    """Names, sizes and mtimes of a model directory's weight files: a model rebuilt in place is loaded anew."""
    path = Path(model_path)
    if not path.is_dir():
        return ""
    files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
    return ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def release_idle_models(keep: tuple | None = None) -> int:
    """Drop the loaded models no engine uses (but `keep`), freeing their memory; returns how many were dropped."""
    with _LOADED_LOCK:
        idle = [k for k, m in _LOADED.items() if m.users == 0 and k != keep]
        dropped = [_LOADED.pop(k) for k in idle]
    for m in dropped:
        m.stop_continuous()
        m.worker.shutdown(wait=False)
    if dropped:
        import gc

        gc.collect()
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return len(dropped)


# Sampling settings transformers' continuous batching applies per row; others (min_p, repetition_penalty) it drops.
CONTINUOUS_SAMPLING = frozenset({"do_sample", "temperature", "top_p", "top_k"})
# Cache pages of the continuous engine on a CPU, per row of max_batch_rows: 2 x 256 tokens. On a GPU transformers
# sizes the cache from the free memory (90% of it).
CONTINUOUS_CPU_PAGES_PER_ROW = 2
_REQUEST_NUMBERS = itertools.count(1)


def _cut_after_stop(new: list[int], stop_ids: Sequence[int]) -> list[int]:
    """`new` up to and including its first stop id (all of it when there is none)."""
    stops = set(stop_ids)
    return new[:next((i + 1 for i, t in enumerate(new) if t in stops), len(new))]


def next_batch(lengths: Sequence[int], keys: Sequence[str], *, max_rows: int, max_tokens: int,
               cache: str = "dynamic") -> list[int]:
    """Which pending requests (prompt lengths and settings keys, oldest first) ``TransformersEngine`` puts in its
    next generate call, as indices: the oldest request, and the others with its settings closest to it in length,
    while the batch stays within `max_rows` rows and `max_tokens` padded prompt tokens (a longer one runs alone).
    On the static cache the padded width is the width bucket's and the rows stop at `static_row_cap`, so a batch
    is padded to a row bucket, never to a row count of its own. The cost plan replays the same rule."""
    anchor = 0
    same = sorted((i for i in range(len(lengths)) if keys[i] == keys[anchor]),
                  key=lambda i: abs(lengths[i] - lengths[anchor]))
    batch, width = [anchor], lengths[anchor]
    for i in same[1:]:
        if len(batch) == max_rows:
            break
        wider = max(width, lengths[i])
        if cache == "static" and wider <= STATIC_MAX_WIDTH:
            fits = len(batch) + 1 <= static_row_cap(static_width(wider), max_rows, max_tokens)
        else:
            fits = wider * (len(batch) + 1) <= max_tokens
        if fits:
            batch.append(i)
            width = wider
    return batch


class _StepClock:
    """A transformers generate streamer that notes when it is handed the prompt and each step's new tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass(eq=False)  # compared by identity: removing a batch from the queue must not compare id lists
class _BatchedRequest:
    ids: list[int]
    generation: GenerationConfig
    stop_ids: list[int]
    key: str  # requests with equal keys share one `generate` call
    future: asyncio.Future


class TransformersEngine(Engine):
    """In-process ``model.generate`` on this host, batching the requests in flight.

    Requests that arrive while a batch runs wait for the next one; each batch is one
    left-padded ``generate`` over up to ``max_batch_rows`` requests (default: ``max_concurrency``,
    the requests in flight; more in flight than rows lets a batch fill from one width) with the same
    generation settings and similar prompt lengths, at most ``max_batch_tokens``
    padded prompt tokens in all (one long prompt padded across 32 rows would cost
    32 long prompts), so the fleet's concurrent requests become batch rows (see
    BENCHMARKS.md for the gain over one at a time).
    A row ends at its first stop id. With ``seed`` set the sampled tokens depend on
    the batch a request lands in, so a seed does not make a row reproducible here
    (``seed_honoured`` is False unless configured). Explicit opt-in only.

    ``cache="static"`` (for a GPU) decodes into transformers' static KV cache, whose decode
    step transformers compiles (CUDA graphs) on CUDA: each batch is padded to a few shapes
    (``static_batch_shape``: rows to a bucket with copies of its first row, the prompt width
    to a power of two from 256 to 2,048 with left padding), so compiles are few and then reused. The
    dynamic cache's step costs ~65 ms at any batch size on an H200 for SmolLM2-135M in
    bfloat16; the compiled static one 10 ms at 256 rows (BENCHMARKS.md).

    ``cache="continuous"`` hands the requests to transformers' continuous batching
    (``model.init_continuous_batching``: a paged KV cache; transformers decides on CUDA graphs and the
    attention kernel): each request joins the running batch as soon as a row is free and leaves it at its
    stop id, so a batch never runs part-empty until its longest row ends, and a conversation's next turn
    starts while other rows still decode. Rows per step: ``max_batch_rows``. Sampling: temperature, top_p
    and top_k only (``min_p`` and ``repetition_penalty`` are refused, not dropped). On an H200 without a
    flash-attention package it makes 1.33K tok/s through the completions stage against static's 4.5-5.1K
    (BENCHMARKS.md): SDPA needs a mask there, and transformers then captures no CUDA graphs, so
    static stays the GPU path on such a host.

    ``cache="slots"`` (for a GPU) decodes with ``generation.slot_decoding``: ``max_batch_rows`` fixed KV-cache
    slots of ``slot_len`` positions, a request prefilled into a free slot as soon as one frees up (in groups), every
    live row advanced by one token per step, and on CUDA that step replayed as one captured CUDA graph. Short
    answers and later turns keep the batch full instead of waiting for a batch's longest row. Greedy tokens are
    those of an unpadded ``generate``; sampling: temperature, top_p and top_k only. A request whose prompt plus
    ``max_new_tokens`` exceed ``slot_len`` decodes in the first of ``slot_tiers`` ((slots, positions) pairs,
    stepped beside the others) that holds it; default: a sixteenth of the slots, at least 4, of the model's whole
    context length; ``[]``: it runs through the dynamic-cache batches instead, after the slots are idle. Full-attention models only (a hybrid or
    sliding-window model is refused when the decoders are built).

    ``attention="packed_gqa"`` decodes with ``generation.packed_gqa``: the query heads of a KV group share
    one read of the cache instead of Transformers' SDPA copying it to every head, which it does under
    ``torch.compile`` (the static decode step); same tokens, 3.1-3.5x faster per layer on an H200
    (BENCHMARKS.md); a whole warm ``generate`` is not measured.

    ``static_cache_len="per_call"`` sizes each call's static cache to that call (its padded prompt width plus
    ``max_new_tokens``) instead of transformers' default, the largest call the model has run (which spares a
    recompile): each decode step attends over the whole static cache, so after one 2,048-wide call every
    256-wide call pays for 2,304 positions. Same tokens (the padding is masked); the cost is a compile or
    CUDA-graph capture per cache length (at most one per width bucket); not measured on a GPU.

    The loaded model is shared within the process (``_LOADED``): engines of the same model, device,
    dtype, cache and attention reuse its weights, its compiled graphs and its one worker thread, and it stays
    loaded after they close until another model is asked for (``release_idle_models`` frees it).
    """

    kind = "transformers"

    def __init__(self, model_path: str | os.PathLike, *, device: str = "cpu", dtype: str = "auto", tokenizer: Any = None,
                 max_batch_tokens: int = 8192, cache: str = "dynamic", max_batch_rows: int | None = None,
                 attention: str = "sdpa", static_cache_len: str = "largest", slot_len: int = 4096,
                 slot_tiers: Sequence[tuple[int, int]] | None = None, **kwargs):
        super().__init__(f"inprocess://{Path(model_path)}", **kwargs)
        self.max_batch_rows = max_batch_rows or self.max_concurrency
        if cache not in ("dynamic", "static", "continuous", "slots"):
            raise ValueError(f"cache must be 'dynamic', 'static', 'continuous' or 'slots', not {cache!r}")
        if attention not in ("sdpa", "packed_gqa"):
            raise ValueError(f"attention must be 'sdpa' or 'packed_gqa', not {attention!r}")
        if attention != "sdpa" and cache == "continuous":
            raise ValueError("attention='packed_gqa' is for the dynamic and static caches; continuous batching "
                             "chooses its own attention kernel")
        if static_cache_len not in ("largest", "per_call"):
            raise ValueError(f"static_cache_len must be 'largest' or 'per_call', not {static_cache_len!r}")
        self.max_batch_tokens = max_batch_tokens
        self.cache = cache
        self.attention = attention
        self.static_cache_len = static_cache_len
        self.slot_len = int(slot_len)
        self.slot_tiers = None if slot_tiers is None else [(int(n), int(length)) for n, length in slot_tiers]
        self._slots: Any = None  # the SlotScheduler (cache="slots"), built at the first request
        self._slot_runs: list = []  # its decoders' SlotStats (kept after close)
        self.model_path = str(model_path)
        self.device = device
        self.dtype = dtype
        self._tokenizer = tokenizer
        self.tok: ChatTokenizer | None = None
        self.model = None
        self._loaded: _LoadedModel | None = None
        self._loaded_key: tuple = ()
        self._pending: list[_BatchedRequest] = []
        self._batcher: asyncio.Task | None = None
        self.batch_sizes: list[int] = []  # rows of each generate call, in order (for logs and tests)
        self.batch_shapes: list[tuple[int, int]] = []  # (rows, prompt width) each generate call ran at, padding included
        self.batch_seconds: list[float] = []  # wall time of each generate call (compiling included)
        self.batch_steps: list[int] = []  # decode steps of each generate call (new tokens of its longest row)
        self.reused_model = False  # whether open() found the model loaded already (by an earlier engine)

    @property
    def _key(self) -> tuple[str, ...]:
        return (self.model_path, _weights_stamp(self.model_path), self.device, self.dtype, self.cache, self.attention)

    def _in_worker(self, fn, *args) -> asyncio.Future:
        assert self._loaded is not None, "open() the engine first"
        return asyncio.get_running_loop().run_in_executor(self._loaded.worker, fn, *args)

    async def open(self) -> None:
        if self.model is not None:
            return
        key = self._key
        release_idle_models(keep=key)  # one idle model at a time: free another before loading this one
        with _LOADED_LOCK:
            loaded = _LOADED.get(key)
            self.reused_model = loaded is not None
            if loaded is None:
                loaded = _LOADED[key] = _LoadedModel(
                    None, ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-generate"))
            loaded.users += 1
        self._loaded, self._loaded_key = loaded, key
        try:
            await self._in_worker(self._load_once, loaded)
        except BaseException:
            self._release()
            raise
        self.model = loaded.model
        # the model's positions bound prompt + new tokens here, as SGLang's context length does there
        self.context_length = self.configured_context_length or _int_or_none(
            getattr(self.model.config, "max_position_embeddings", None))

    def _release(self) -> None:
        if self._loaded is not None:
            with _LOADED_LOCK:
                self._loaded.users -= 1
                if self._loaded.model is None and self._loaded.users == 0:  # the load failed: nothing to keep
                    _LOADED.pop(self._loaded_key, None)
                    self._loaded.worker.shutdown(wait=False)
            self._loaded = None

    async def close(self) -> None:
        if self._batcher is not None and not self._batcher.done():
            self._batcher.cancel()
        self._slots = None  # its decoder (and KV cache) goes once its requests in flight are answered
        loaded = self._loaded
        if loaded is not None and loaded.continuous is not None and loaded.users == 1:
            # the last engine of this model: stop the manager's (non-daemon) thread and free its cache; queued on
            # the worker, so an engine opening meanwhile starts a new manager after this one stopped
            await asyncio.get_running_loop().run_in_executor(loaded.worker, loaded.stop_continuous)
        self.model = None
        self._release()

    def _load_once(self, loaded: _LoadedModel) -> None:
        """The tokenizer, and the model unless an engine opened before loaded it (on the worker thread, so two
        engines opening at once load it once)."""
        if self.tok is None:
            self.tok = ChatTokenizer(self._tokenizer or self._chat_from_model_dir())
        if loaded.model is None:
            loaded.model = self._load()

    def _chat_from_model_dir(self) -> Any:
        """No chat object given: the model directory's own tokenizer, through the target package (downloads as the
        model load may)."""
        from dflash_assets.target_model.spec import TargetModelSpec

        return TargetModelSpec(model_path=self.model_path, allow_download=True).chat()

    def _load(self) -> Any:
        """The model, on this engine's device and dtype (runs on the worker thread that will run its generates)."""
        import torch

        from dflash_assets.target_model.loading import load_causal_lm

        dtype = "auto" if self.dtype == "auto" else getattr(torch, self.dtype)
        model = load_causal_lm(self.model_path, dtype=dtype).to(self.device).eval()
        if self.attention == "packed_gqa":
            from dflash_assets.generation.packed_gqa import register

            model.set_attn_implementation(register())
        if self.cache == "static":
            from dflash_assets.torch_compile import allow_recompiles, apply_inductor_workarounds

            apply_inductor_workarounds()
            allow_recompiles()
        return model

    async def probe(self) -> EngineProbe:
        t0 = time.perf_counter()
        try:
            await self.open()
        except Exception as e:  # noqa: BLE001 - reported in the probe table
            return EngineProbe(self.url, self.kind, False, error=f"{type(e).__name__}: {e}")
        self.served_model = self.model_path
        return EngineProbe(self.url, self.kind, True, (self.model_path,), time.perf_counter() - t0)

    def _generate(self, rows: list[list[int]], gen: GenerationConfig, stop_ids: list[int],
                  streamer: Any = None) -> list[list[int]]:
        """Greedy or sampled continuations of `rows` (left-padded into one batch), each cut after its first stop id.
        ``streamer``: transformers' generate streamer (``put`` gets the prompt, then each step's new tokens)."""
        import torch

        pad = stop_ids[0] if stop_ids else 0
        kwargs: dict[str, Any] = {"max_new_tokens": gen.max_new_tokens, "eos_token_id": stop_ids,
                                  "pad_token_id": pad, **hf_generation_settings(gen)}
        if streamer is not None:
            kwargs["streamer"] = streamer
        if not kwargs["do_sample"]:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if gen.seed is not None:
            torch.manual_seed(gen.seed)
        n, width = len(rows), max(len(r) for r in rows)
        if self.cache == "static" and width <= STATIC_MAX_WIDTH:
            padded_rows, width = static_batch_shape(n, width, self.max_batch_rows, self.max_batch_tokens)
            rows = list(rows) + [rows[0]] * (padded_rows - n)  # copies finish with the row they copy
            kwargs["cache_implementation"] = "static"
            if self.static_cache_len == "per_call":  # transformers sizes each new static cache to the largest call
                # so far (no recompile), and every decode step attends over all of it: a 256-wide call after a
                # 2,048-wide one would read 4.5x the cache it needs
                self.model._previous_max_cache_length = -1
        self.batch_shapes.append((len(rows), width))
        x = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=mask, **kwargs)
        self.batch_seconds.append(time.perf_counter() - t0)
        self.batch_steps.append(out.shape[1] - width)
        _log.info("%s: generate of %d rows (%d padded) x %d prompt tokens, %d steps: %.1f s", self.url, n, len(rows),
                  width, self.batch_steps[-1], self.batch_seconds[-1])
        return [_cut_after_stop(new, stop_ids) for new in out[:n, width:].tolist()]

    async def time_generate(self, rows: list[list[int]], generation: GenerationConfig
                            ) -> tuple[float, int, list[float]]:
        """One generate call of `rows` (token ids, left-padded into one batch) with no stop id, so every row
        runs ``generation.max_new_tokens`` steps, on the model's worker thread: its wall seconds, its steps, and
        when each step's new tokens came out (seconds after generate received the prompt; the first comes out
        of the prefill). The cost plan times batch shapes with it (``open()`` first)."""
        clock = _StepClock()
        await self._in_worker(self._generate, rows, generation, [], clock)
        return self.batch_seconds[-1], self.batch_steps[-1], [t - clock.times[0] for t in clock.times[1:]]

    def _continuous_manager(self, gen: GenerationConfig, stop_ids: list[int]) -> Any:
        """The running continuous-batching manager for `gen`'s sampling settings (on the worker thread): the one
        already running when its settings match, else a new one (an old one is stopped first: one cache at a
        time)."""
        from transformers import GenerationConfig as HFGenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        assert self._loaded is not None
        settings = hf_generation_settings(gen)
        unsupported = sorted(set(settings) - CONTINUOUS_SAMPLING)
        if unsupported:
            raise EngineError(f"{self.url}: continuous batching applies temperature, top_p and top_k only, not "
                              f"{', '.join(unsupported)}; use cache='static' or 'dynamic'", endpoint=self.url)
        key = json.dumps([settings, gen.seed], sort_keys=True)
        loaded = self._loaded
        if loaded.continuous is not None and loaded.continuous_key == key and loaded.continuous.is_running():
            return loaded.continuous
        loaded.stop_continuous()
        sampling = dict(settings) if settings["do_sample"] else {"do_sample": False, "temperature": None,
                                                                 "top_p": None, "top_k": None}
        hf_gen = HFGenerationConfig(max_new_tokens=gen.max_new_tokens, eos_token_id=stop_ids, **sampling)
        cpu = str(self.model.device) == "cpu"
        cb = ContinuousBatchingConfig(
            max_requests_per_batch=self.max_batch_rows, seed=gen.seed,
            num_blocks=self.max_batch_rows * CONTINUOUS_CPU_PAGES_PER_ROW if cpu else None)
        manager = self.model.init_continuous_batching(generation_config=hf_gen, continuous_batching_config=cb)
        manager.start()
        loaded.continuous, loaded.continuous_key = manager, key
        _log.info("%s: continuous batching started (%d rows per step, %s)", self.url, self.max_batch_rows,
                  "greedy" if not settings["do_sample"] else "sampled")
        return manager

    async def _continuous_generate(self, ids: list[int], gen: GenerationConfig, stop_ids: list[int]) -> list[int]:
        """One request through the continuous-batching manager: its new ids, the first stop id included."""
        from transformers.generation.continuous_batching.requests import RequestStatus

        manager = await self._in_worker(self._continuous_manager, gen, stop_ids)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        request_id = f"dflash-{next(_REQUEST_NUMBERS)}"

        def deliver(output: Any) -> None:  # on this loop (transformers calls it through call_soon_threadsafe)
            if output.is_finished() and not done.done():
                done.set_result(output)

        manager.register_result_handler(request_id, deliver)  # before the request: no result reaches the queue
        if manager.add_request(ids, request_id=request_id, max_new_tokens=gen.max_new_tokens,
                               eos_token_id=stop_ids) is None:
            raise EngineError(f"{self.url}: continuous batching refused the request (stopping)", retryable=True,
                              endpoint=self.url)
        try:
            output = await done
        except asyncio.CancelledError:
            manager.cancel_request(request_id)
            raise
        if output.status == RequestStatus.FAILED or output.error:
            raise EngineError(f"{self.url}: continuous batching failed the request: {output.error}",
                              endpoint=self.url)
        return _cut_after_stop(list(output.generated_tokens), stop_ids)

    async def _slot_generate(self, ids: list[int], gen: GenerationConfig, stop_ids: list[int]) -> list[int]:
        """One request through the slot decoder (``generation.slot_decoding``): its new ids, the first stop id
        included."""
        from dflash_assets.generation.slot_decoding import SlotRequest, SlotScheduler

        settings = hf_generation_settings(gen)
        unsupported = sorted(set(settings) - CONTINUOUS_SAMPLING)
        if unsupported:
            raise EngineError(f"{self.url}: slot decoding applies temperature, top_p and top_k only, not "
                              f"{', '.join(unsupported)}; use cache='static' or 'dynamic'", endpoint=self.url)
        if self._slots is None:
            assert self._loaded is not None
            self._slots = SlotScheduler(self.slot_decoders, self._loaded.worker)
            self._slot_runs = self._slots.stats
        sampled = settings["do_sample"]
        request = SlotRequest(ids, gen.max_new_tokens, tuple(stop_ids), temperature=gen.temperature if sampled else 0.0,
                              top_p=settings.get("top_p") or 1.0, top_k=settings.get("top_k") or 0)
        try:
            out, _finish = await self._slots.generate(request)
        except ValueError as e:
            raise EngineError(f"{self.url}: {e}", endpoint=self.url) from e
        except Exception as e:  # noqa: BLE001 - the decoder failed: every request in it fails alike
            raise EngineError(f"{self.url}: slot decoding failed: {type(e).__name__}: {e}", endpoint=self.url) from e
        return out

    def _tiers(self) -> list[tuple[int, int]]:
        """(slots, positions) of each slot decoder, shortest first: ``max_batch_rows`` of ``slot_len``, then
        ``slot_tiers`` (default: a sixteenth of the rows, at least 4, of the context length), none past the
        model's context length."""
        context = self.context_length or self.slot_len
        tiers = [(self.max_batch_rows, min(self.slot_len, context))]
        extra = self.slot_tiers if self.slot_tiers is not None else [(max(4, self.max_batch_rows // 16), context)]
        for n, length in sorted(extra, key=lambda t: t[1]):
            if n > 0 and min(length, context) > tiers[-1][1]:
                tiers.append((n, min(length, context)))
        return tiers

    def slot_decoders(self) -> list:
        """The slot decoders of ``_tiers`` for this engine's model (on the model's worker thread)."""
        from dflash_assets.generation.slot_decoding import SlotDecoder

        assert self.tok is not None
        pad = min(self.tok.stop_ids) if self.tok.stop_ids else 0
        tiers = self._tiers()
        _log.info("%s: slot decoding in %s", self.url, " and ".join(f"{n} slots of {length} positions"
                                                                     for n, length in tiers))
        return [SlotDecoder(self.model, slots=n, slot_len=length, pad_id=pad,
                            prefill_tokens=max(self.max_batch_tokens, length)) for n, length in tiers]

    def slot_stats(self) -> dict | None:
        """What the slot decoder did so far (None unless cache="slots" decoded something)."""
        if not self._slot_runs:
            return None
        runs = [stats.as_dict(n) for stats, (n, _) in zip(self._slot_runs[-1], self._tiers())]
        total = {k: sum(r[k] for r in runs) for k in ("steps", "prefills", "prefill_rows", "new_tokens", "requests")}
        total.update(step_seconds=round(sum(r["step_seconds"] for r in runs), 3),
                     prefill_seconds=round(sum(r["prefill_seconds"] for r in runs), 3),
                     occupancy=runs[0]["occupancy"], cuda_graph=runs[0]["cuda_graph"])
        return {**total, "decoders": runs}

    def _next_batch(self) -> list[_BatchedRequest]:
        """The requests of the next generate call (``next_batch``'s rule over the pending requests)."""
        picked = next_batch([len(r.ids) for r in self._pending], [r.key for r in self._pending],
                            max_rows=self.max_batch_rows, max_tokens=self.max_batch_tokens, cache=self.cache)
        return [self._pending[i] for i in picked]

    async def _run_batches(self) -> None:
        while self._pending:
            await asyncio.sleep(0.005)  # let requests sent together land in one batch
            batch = self._next_batch()
            self._pending = [r for r in self._pending if r not in batch]
            self.batch_sizes.append(len(batch))
            try:
                outs = await self._in_worker(self._generate, [r.ids for r in batch], batch[0].generation,
                                             batch[0].stop_ids)
            except Exception as e:  # noqa: BLE001 - every request of the batch fails alike
                _log.warning("%s: generate of %d rows (prompt width %d) failed", self.url, len(batch),
                             max(len(r.ids) for r in batch), exc_info=True)
                err = EngineError(f"{self.url}: generate failed: {type(e).__name__}: {e}", endpoint=self.url)
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(err)
                continue
            for r, out in zip(batch, outs):
                if not r.future.done():
                    r.future.set_result(out)

    async def chat(self, messages: Sequence[dict], generation: GenerationConfig, *,
                   tools: Sequence[dict] | None = None) -> ChatResult:
        await self.open()
        assert self.tok is not None
        ids = self.tok.prompt_ids(messages, generation.enable_thinking, tools)
        generation, cut = self.fit_to_context(len(ids), generation)
        stop_ids = sorted(self.tok.stop_ids | set(generation.stop_token_ids))
        t0 = time.perf_counter()
        if self.cache == "continuous":
            out = await self._continuous_generate(ids, generation, stop_ids)
        elif self.cache == "slots" and len(ids) + generation.max_new_tokens <= self._tiers()[-1][1]:
            out = await self._slot_generate(ids, generation, stop_ids)
        else:  # the batched generate (a prompt too long for a slot decodes there on the dynamic cache)
            request = _BatchedRequest(ids, generation, stop_ids, generation.model_dump_json() + repr(stop_ids),
                                      asyncio.get_running_loop().create_future())
            self._pending.append(request)
            if self._batcher is None or self._batcher.done():
                self._batcher = asyncio.get_running_loop().create_task(self._run_batches())
            out = await request.future
        finish = "stop" if out and out[-1] in stop_ids else "length"
        reasoning, content = self.tok.split_output_ids(out, generation.enable_thinking, generation.stop_token_ids)
        return ChatResult(content, reasoning, finish, len(ids), len(out), time.perf_counter() - t0, self.url,
                          self.model_path, max_new_tokens_cut=cut)
