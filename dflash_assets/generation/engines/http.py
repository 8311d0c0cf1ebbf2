"""The HTTP side shared by the SGLang and OpenAI-compatible engines: transport, guards, and the one probe.

Transport (``HttpEngine._send``): redirects are never followed (the prompt goes to the configured URL only), a
reply with no byte for ``read_timeout_s`` (+ ``read_timeout_per_token_s`` per requested token: a non-streaming
reply comes in one piece at the end) fails the request, a body over ``max_response_bytes`` is cut off with an
error, a reply of the wrong shape is a retryable ``EngineError`` naming the endpoint, and a reply naming a model
other than the one probed is refused. ``api_key`` is sent as ``Authorization: Bearer`` on every request and kept
out of reprs, errors and logs.

Probe (``HttpEngine.probe``, both HTTP kinds): identity from ``GET /model_info``, then the deprecated
``/get_model_info``, then ``GET /v1/models`` (a missing route is skipped, never "unreachable"); the server's flags
from ``GET /server_info`` (then ``/get_server_info``): ``enable_deterministic_inference`` (does a seed hold),
``reasoning_parser``, ``tool_call_parser``, ``version``; the context length from ``/v1/models``'
``max_model_len``. Health is ``GET /health`` without the API key (SGLang exempts it), waited on while it answers
503 (a starting or busy SGLang; its health check is a one-token generation that may take up to 20 s); behind
sglang-router, whose ``/health`` is always 200, ``/readiness`` says whether a worker is healthy.

Reads: the endpoint's HTTP routes. Writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, Sequence

try:  # the in-process engine imports this package too, on GPU images that may lack orjson
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency of the package
    orjson = None

from dflash_assets.generation.config import normalize_model_id
from dflash_assets.generation.engines.protocol import (Engine, EngineError, EngineProbe, ServerFacts,
                                                          _int_or_none)


def json_dumps(obj: Any) -> bytes:
    """orjson: ~5x faster than json on the request/response hot path (the standard library's where it is
    missing)."""
    if orjson is None:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return orjson.dumps(obj)


json_loads = orjson.loads if orjson is not None else json.loads

# HTTP statuses worth another try: timeout, rate limit, server-side errors.
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_JSON_HEADERS = {"Content-Type": "application/json"}


class HttpEngine(Engine):
    """An engine behind an HTTP URL: a pooled aiohttp session, guarded requests (see the module), the probe."""

    # Whether a /health that answers 404 still counts as healthy (vLLM, SGLang and transformers serve have the
    # route; some OpenAI-compatible proxies do not).
    health_route_optional = False

    def __init__(self, url: str, **kwargs):
        super().__init__(url, **kwargs)
        self.dialect: str | None = None  # the OpenAI engine's: "transformers_serve" | "openai"
        self._session = None
        self._urls: dict[str, Any] = {}

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

    async def probe(self) -> EngineProbe:
        """Identity and flags (``server_facts``: a missing route is skipped), then health (``wait_healthy``);
        never raises: a failure is the probe's ``error``."""
        t0 = time.perf_counter()
        try:
            facts = await self.server_facts()
        except EngineError as e:
            return EngineProbe(self.url, self.kind, False, error=str(e))
        latency = time.perf_counter() - t0
        self._adopt_facts(facts)
        healthy, error = True, None
        try:
            await self.wait_healthy()
        except EngineError as e:
            if not (e.status == 404 and self.health_route_optional):
                healthy, error = False, str(e)
        names = facts.names
        if not names:
            error = error or "no model named by /model_info, /get_model_info or /v1/models"
        self.served_model = names[0] if names else ""
        return EngineProbe(self.url, self.kind, healthy, names, latency, error, self.dialect, facts)
