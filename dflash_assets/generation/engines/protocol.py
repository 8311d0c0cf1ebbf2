"""What every generation engine answers, and the results and errors it answers with.

``Engine`` is one generation endpoint: ``probe()`` (health, served model, latency; never raises) and
``chat(messages, generation) -> ChatResult``; failures raise ``EngineError`` whose ``retryable``/``connection``
flags drive the fleet's retry and failover (``generation.fleet``). Before a request is sent its prompt tokens plus
``max_new_tokens`` are checked against the endpoint's context length (``Engine.fit_to_context``): a request that
does not fit gets ``max_new_tokens`` lowered to what fits when at least ``context_min_new_tokens`` remain, else
``ContextOverflow`` is raised without a round trip (SGLang would answer 400). ``ServerFacts`` is what a server
says about itself at probe time (read by ``engines.http``).

Reads and writes nothing (the engines in ``engines.http``, ``engines.sglang``, ``engines.openai`` and
``engines.inprocess`` do the I/O).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from dflash_assets.generation.config import GenerationConfig

EngineKind = Literal["sglang", "openai", "transformers"]


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
# The engine


class Engine(abc.ABC):
    """One generation endpoint. Use as ``async with engine:``; ``probe`` then ``chat``.

    The settings every kind takes (the fleet builds every kind from one endpoint config): concurrency, timeouts,
    reply cap and API key (used by the HTTP kinds, ``engines.http.HttpEngine``), the context length (configured,
    else learned by the probe) and whether a seed is honoured (configured, else the server's word).
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

    @property
    def busy_concurrency(self) -> int:
        """Requests in flight that keep this engine busy (what a throughput burst sends at once): its
        ``max_concurrency``, unless the engine says fewer do."""
        return self.max_concurrency

    def __repr__(self) -> str:  # never the key
        return f"{type(self).__name__}({self.url!r}, served_model={self.served_model!r})"

    async def __aenter__(self) -> "Engine":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> None:
        """Acquire what requests need (a connection pool, a loaded model); again is a no-op."""

    async def close(self) -> None:
        """Release what ``open`` acquired."""

    def decoder_totals(self) -> dict[str, float]:
        """Running totals of this engine's own decoder (steps, their seconds, prefills, their seconds, new tokens)
        where it keeps them (the in-process slot decoders); the fleet reports their change over a run. None here."""
        return {}

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

    # -- interface -----------------------------------------------------------

    @abc.abstractmethod
    async def probe(self) -> EngineProbe:
        """Liveness and identity; never raises."""

    @abc.abstractmethod
    async def chat(self, messages: Sequence[dict], generation: GenerationConfig) -> ChatResult:
        """Generate the next assistant turn for ``messages`` (role/content dicts; agentic ones also
        tool_calls/tool results). Engines take ``tools=`` (JSON schemas) for agentic conversations."""


def decoding_over_run(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """An engine's decoder totals over one run (`Engine.decoder_totals` at its end less at its start; the totals
    at the end alone when they went down: decoders rebuilt after a failure), with the prefills' share of the
    decoder's seconds."""
    if not after:
        return {}
    rebuilt = any(after[k] < before.get(k, 0) for k in after)
    out = {k: round(v - (0 if rebuilt else before.get(k, 0)), 3) for k, v in after.items()}
    busy = out.get("step_seconds", 0) + out.get("prefill_seconds", 0)
    if busy > 0:
        out["prefill_share"] = round(out.get("prefill_seconds", 0) / busy, 4)
    return out
