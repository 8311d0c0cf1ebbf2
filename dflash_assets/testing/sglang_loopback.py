"""A loopback HTTP server that answers in SGLang's documented native shapes.

For tests and benchmarks of the generation client where SGLang itself cannot
be installed (it needs CUDA). Routes:

- ``POST /generate``: ``{"input_ids": [...] | [[...], ...], "sampling_params": {...}}``
  (or ``text``) -> ``{"text", "output_ids", "meta_info": {"id",
  "finish_reason": {"type": "stop", "matched": id} | {"type": "length",
  "length": n}, "prompt_tokens", "completion_tokens", "cached_tokens",
  "e2e_latency"}}``, a list of those for a batch.
- ``GET /health``, ``GET /health_generate``: 200.
- ``GET /get_model_info``: ``{"model_path", "tokenizer_path", "is_generation", ...}``.
- ``GET /v1/models``: ``{"object": "list", "data": [{"id": served name, ...}]}``.
- ``POST /v1/chat/completions``: OpenAI shape with ``reasoning_content``, as
  SGLang answers with ``--reasoning-parser``.
- ``GET /loopback/stats``: request counters (not an SGLang route; tests use
  it to count requests at the server).

Tool calls (``LoopbackConfig.tool_rules``): ``(trigger, name, arguments)``
rules; when the prompt's last message (the text between its last two
``<|im_start|>``, i.e. before the generation prompt; on the chat route the
last message's content) contains a rule's trigger, the reply's content is
``I will call NAME.`` and a Qwen3.5/3.6 ``<tool_call>`` block calling
``name`` with ``arguments`` (the first rule that matches). ``/generate``
needs ``tokenizer_json`` to read the prompt. ``tool_call_parser``: the chat
route answers the call as parsed OpenAI ``tool_calls`` (finish
``tool_calls``), as SGLang does when started with ``--tool-call-parser``.

Misbehaviour modes (``LoopbackConfig``) play a broken or hostile engine:
replies of the wrong shape, redirects, padded bodies, another model's name,
a plain-text ``/health``, a required bearer token; ``delay_s`` plays a hung one.

"Generation" is deterministic: the output for a prompt is derived from a hash
of its ids (plus the sampling seed): ``R`` reasoning tokens, ``</think>``,
``C`` content tokens, end-of-turn, cut at ``max_new_tokens`` (finish
``length``). The same prompt always gives the same output, so a resumed run
can be compared with an uninterrupted one. Latency, failures and an instant
mode are configurable. Text is decoded with a ``tokenizer.json`` when one is
given (through the ``tokenizers`` library), else rendered as ``<id>`` words.

Run: ``python -m dflash_assets.testing.sglang_loopback --port 30000 --model-path /models/X``
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

if TYPE_CHECKING:
    import subprocess

try:
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    _loads = orjson.loads
except ImportError:  # pragma: no cover
    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()

    _loads = json.loads

__all__ = ["LoopbackConfig", "LoopbackServer", "LoopbackProcess", "build_app", "main", "QWEN3_6_IDS"]

# Special ids of the Qwen3.5/3.6 tokenizer (the embedded default target).
QWEN3_6_IDS = {"think_start": 248068, "think_end": 248069, "im_end": 248046, "endoftext": 248044}


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
    reasoning_field: bool = True  # /v1/chat/completions: False = no reasoning parser (<think> stays in content)
    tokenizer_json: str | None = None
    stub_ratio: float = 0.0  # share of prompts answered with the stub "\n</think>\n\nOK.<|im_end|>" (empty reasoning)
    # Misbehaviour of a broken or hostile engine (generate and chat routes):
    bad_shape_every: int = 0  # every Nth request answers valid JSON in the wrong shape (0: never)
    redirect_to: str | None = None  # answer 307 to this base URL (+ the same path) instead of generating
    pad_reply_bytes: int = 0  # add a padding field of this many bytes to every reply
    chunked: bool = False  # send replies with Transfer-Encoding: chunked (no Content-Length)
    reply_model: str | None = None  # the model a reply names (default: the served name; /generate names none)
    health_body: str = ""  # GET /health body (e.g. "ok" as plain text, as some servers answer)
    api_key: str | None = None  # require "Authorization: Bearer <key>" on every route (401 otherwise)
    # Tool calls: ((trigger, name, arguments), ...), see the module docstring.
    tool_rules: tuple = ()
    tool_call_parser: bool = False  # chat route: answer parsed `tool_calls` instead of the call's text


@dataclass
class _Stats:
    generate_requests: int = 0
    generate_prompts: int = 0
    chat_requests: int = 0
    model_info_requests: int = 0  # identity probes (GET /get_model_info)
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

    def encode(self, text: str) -> list[int]:
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=False).ids
        return [self.cfg.token_lo + (b % 97) for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=False)
        return "".join(f"<{i}>" if i not in (self.cfg.think_end_id, self.cfg.eos_id)
                       else ("</think>" if i == self.cfg.think_end_id else "<|im_end|>") for i in ids)

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
    def call_text(name: str, arguments: dict) -> str:
        """The reply's content for a call: a sentence, then the Qwen3.5/3.6 block."""
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in arguments.items())
        return f"I will call {name}.\n\n<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    def full_output(self, key: bytes, tool: tuple[str, dict] | None = None) -> list[int]:
        """The untruncated deterministic output for a prompt key (a tool call's, given ``tool``)."""
        c = self.cfg
        if tool is not None:
            rng = random.Random(hashlib.blake2b(key, digest_size=8).digest())
            reasoning = [rng.randrange(c.token_lo, c.token_hi) for _ in range(rng.randint(*c.reasoning_tokens))]
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


def build_app(cfg: LoopbackConfig, stats: _Stats | None = None):
    """The aiohttp application (exposed for embedding)."""
    from aiohttp import web

    gen = _Generator(cfg)
    stats = stats if stats is not None else _Stats()
    served = cfg.served_model_name or cfg.model_path
    counter = {"n": 0}

    def jresp(obj: Any, status: int = 200) -> "web.Response":
        resp = web.Response(body=_dumps(obj), status=status, content_type="application/json")
        if cfg.chunked:
            resp.enable_chunked_encoding()
        return resp

    def maybe_fail(request: "web.Request") -> "web.Response | None":
        counter["n"] += 1
        if cfg.fail_every and counter["n"] % cfg.fail_every == 0:
            stats.failed += 1
            return jresp({"error": "loopback: injected failure"}, cfg.fail_status)
        if cfg.redirect_to:
            stats.redirected += 1
            raise web.HTTPTemporaryRedirect(cfg.redirect_to.rstrip("/") + request.path)
        if cfg.bad_shape_every and counter["n"] % cfg.bad_shape_every == 0:
            stats.failed += 1
            wrong = ({"choices": ["not an object"], "model": served} if request.path.startswith("/v1/")
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

    def one(ids: list[int] | None, text: str | None, params: dict, t0: float, rid: int) -> dict:
        if ids is None:
            ids = gen.encode(text or "")
        key = _prompt_key(ids, None, params.get("sampling_seed"))
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
        if batch:
            items = ids if ids is not None else text
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
        if body.get("model") not in (None, served):
            return jresp({"error": f"model {body.get('model')!r} not served here"}, 404)
        think = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
        key = _prompt_key(None, json.dumps(body.get("messages"), sort_keys=True), body.get("seed"))
        params = {"max_new_tokens": body.get("max_tokens") or body.get("max_completion_tokens") or 128,
                  "ignore_eos": body.get("ignore_eos")}
        messages = body.get("messages") or [{}]
        tool = gen.tool_rule(str(messages[-1].get("content") or "")) if cfg.tool_rules else None
        out, finish = gen.generate(key, params, tool)
        await delay(len(out))
        ids = [t for t in out if t != cfg.eos_id]
        reasoning: str | None
        tool_calls = None
        if tool is not None and cfg.think_end_id in ids:  # the call as text (no tokenizer needed), or parsed as SGLang's tool-call parser does
            cut = ids.index(cfg.think_end_id)
            reasoning, content = gen.decode(ids[:cut]), gen.call_text(*tool)
            if finish["type"] == "stop" and cfg.tool_call_parser:
                content = content.split("\n\n<tool_call>")[0]
                tool_calls = [{"id": f"call_{stats.chat_requests}_0", "type": "function", "index": 0,
                               "function": {"name": tool[0], "arguments": json.dumps(tool[1])}}]
                finish = {"type": "tool_calls"}
        elif not cfg.reasoning_field:  # no parser: the raw text, think block included
            reasoning, content = None, gen.decode(ids)
        elif cfg.think_end_id in ids:
            cut = ids.index(cfg.think_end_id)
            reasoning, content = gen.decode(ids[:cut]), gen.decode(ids[cut + 1 :])
        else:
            reasoning, content = (gen.decode(ids), "") if think else ("", gen.decode(ids))
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if tool_calls is not None:
            message["tool_calls"] = tool_calls
        n_prompt = sum(len(str(m.get("content", ""))) for m in body.get("messages", []))
        return jresp(finish_reply({
            "id": f"loopback-{stats.chat_requests}", "object": "chat.completion", "created": int(time.time()),
            "model": cfg.reply_model or served,
            "choices": [{"index": 0, "finish_reason": finish["type"],
                         "message": message}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(out),
                      "total_tokens": n_prompt + len(out)},
            "e2e_latency": time.perf_counter() - t0,
        }))

    async def health(_request: "web.Request") -> "web.Response":
        if cfg.health_body:
            return web.Response(status=200, text=cfg.health_body)  # text/plain
        return web.Response(status=200)

    @web.middleware
    async def bearer_auth(request: "web.Request", handler: Any) -> "web.StreamResponse":
        if cfg.api_key and request.headers.get("Authorization") != f"Bearer {cfg.api_key}":
            stats.unauthorized += 1
            return jresp({"error": "missing or wrong API key"}, 401)
        return await handler(request)

    async def model_info(_request: "web.Request") -> "web.Response":
        stats.model_info_requests += 1
        return jresp({"model_path": cfg.model_path, "tokenizer_path": cfg.model_path, "is_generation": True,
                      "preferred_sampling_params": None, "weight_version": "default"})

    async def models(_request: "web.Request") -> "web.Response":
        return jresp({"object": "list", "data": [{"id": served, "object": "model", "created": 0,
                                                   "owned_by": "sglang", "root": cfg.model_path}]})

    async def get_stats(_request: "web.Request") -> "web.Response":
        return jresp({"generate_requests": stats.generate_requests, "generate_prompts": stats.generate_prompts,
                      "chat_requests": stats.chat_requests, "failed": stats.failed,
                      "distinct_prompts": len(stats.prompts_seen)})

    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[bearer_auth])
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/get_model_info", model_info)
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
        self.argv = [python or sys.executable, "-m", "dflash_assets.testing.sglang_loopback", "--port", str(port), *args]
        self.startup_timeout_s = startup_timeout_s
        self.proc: "subprocess.Popen | None" = None
        self.url = ""

    def start(self) -> "LoopbackProcess":
        import os
        import subprocess

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
    p = argparse.ArgumentParser(prog="python -m dflash_assets.testing.sglang_loopback", description=__doc__.split("\n\n")[0])
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
    p.add_argument("--no-reasoning-field", action="store_true", help="chat: no reasoning parser, <think> in content")
    p.add_argument("--tokenizer-json", default=None)
    p.add_argument("--reasoning-tokens", type=int, nargs=2, default=list(LoopbackConfig.reasoning_tokens))
    p.add_argument("--content-tokens", type=int, nargs=2, default=list(LoopbackConfig.content_tokens))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    cfg = LoopbackConfig(model_path=args.model_path, served_model_name=args.served_model_name, delay_s=args.delay_s,
                         per_token_s=args.per_token_s, instant=args.instant, fail_every=args.fail_every,
                         fail_status=args.fail_status, output_ids=not args.no_output_ids,
                         reasoning_field=not args.no_reasoning_field,
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
