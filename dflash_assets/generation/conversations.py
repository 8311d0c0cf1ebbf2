"""One prompt's conversation as one fleet task: its assistant turns regenerated in order by the target.

A plain chat is a ``Conversation``; a row with ``tools`` and ``agentic_turns`` an ``AgenticConversation``
(``agentic_task`` builds it, or says why it cannot be generated). Each keeps its progress across retries and
failover, fits every turn to the endpoint's context (a turn that does not fit ends the conversation at its previous
turn, or fails the prompt when it is the first), and gives its finished row (``row()``) in the completions shape.

Reads: the engines it is handed (``Engine.chat``). Writes nothing (the completions stage journals its rows).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from dflash_assets.generation.engines import (ChatResult, ContextOverflow, Engine, GenerationConfig, json_dumps,
                                              json_loads)
from dflash_assets.generation.tool_calls import calls_from_server, parse_qwen_tool_calls, same_calls

__all__ = ["Conversation", "AgenticConversation", "agentic_task"]


class Conversation:
    """Regenerates the assistant turns of one prompt; keeps its progress across retries and failover.

    The assistant turns are regenerated in order, each request carrying the
    regenerated history (assistant contents only; earlier think blocks are left
    out, as the chat template does), up to ``GenerationConfig.max_turns`` turns.
    A turn cut by ``max_new_tokens`` ends the conversation when
    ``stop_after_truncated_turn`` is set (its finish reason is kept).
    Context length (``_chat``): a turn whose prompt leaves too little of the
    endpoint's context is not sent; the conversation ends at its previous turn
    (``stopped_at_context``), or fails when it is the first (``context_overflow``).
    """

    def __init__(self, prompt_id: str, system: str | None, user_turns: list[str], gen: GenerationConfig, config_hash: str):
        self.key = prompt_id
        self.prompt_id = prompt_id
        self.user_turns = user_turns
        self.gen = gen
        self.config_hash = config_hash
        self.history: list[dict] = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict] = [{"role": "system", "content": system, "reasoning_content": None}] if system else []
        self.results: list[ChatResult] = []
        self.attempts = 0
        self.started_at: float | None = None
        self.turns_cut_to_context = 0
        self.stopped_at_context = False
        self.context_overflow = False
        self.over_max_context = False  # the first turn did not fit GenerationConfig.max_context_tokens

    async def _chat(self, engine: Engine, request: list[dict], **kwargs: Any) -> ChatResult | None:
        """``engine.chat``; None when the request does not fit the context and a turn is already done (the
        conversation ends there); a first turn that does not fit raises ``ContextOverflow`` (the prompt fails)."""
        try:
            res = await engine.chat(request, self.gen, **kwargs)
        except ContextOverflow as e:
            if not self.results:
                self.context_overflow = True
                self.over_max_context = e.by_generation_config
                raise
            self.stopped_at_context = True
            return None
        self.turns_cut_to_context += res.max_new_tokens_cut > 0
        return res

    def _stopped_at_context(self) -> tuple[bool, ChatResult]:
        """The step's answer when the next turn did not fit: done, nothing new (no tokens to count twice)."""
        return True, dataclasses.replace(self.results[-1], prompt_tokens=0, completion_tokens=0)

    async def step(self, engine: Engine) -> tuple[bool, ChatResult]:
        if self.started_at is None:
            self.started_at = time.time()
        self.attempts += 1
        user = self.user_turns[len(self.results)]
        request = self.history + [{"role": "user", "content": user}]
        res = await self._chat(engine, request)
        if res is None:
            return self._stopped_at_context()
        # committed only after success: a failed request leaves the conversation where it was
        self.history = request + [{"role": "assistant", "content": res.content}]
        self.messages += [{"role": "user", "content": user, "reasoning_content": None},
                          {"role": "assistant", "content": res.content, "reasoning_content": res.reasoning_content}]
        self.results.append(res)
        truncated = res.finish_reason == "length" and self.gen.stop_after_truncated_turn
        return len(self.results) >= len(self.user_turns) or truncated, res

    def row(self) -> dict:
        r = self.results
        now = time.time()
        return {
            "prompt_id": self.prompt_id,
            "messages": self.messages,
            "num_turns": len(r),
            "finish_reasons": [x.finish_reason for x in r],
            "prompt_tokens": [x.prompt_tokens for x in r],
            "completion_tokens": [x.completion_tokens for x in r],
            "completion_tokens_total": sum(x.completion_tokens for x in r),
            "turn_endpoints": [x.endpoint for x in r],
            "endpoint": r[-1].endpoint if r else "",
            "served_model": r[-1].served_model if r else "",
            "turn_latency_s": [round(x.latency_s, 6) for x in r],
            "started_at": self.started_at,
            "finished_at": now,
            "generation_s": round(now - (self.started_at or now), 6),
            "attempts": self.attempts,
            "config_hash": self.config_hash,
        }


def _message(role: str, content: str | None, reasoning: str | None = None, tool_calls: list | None = None,
             tool_call_id: str | None = None, name: str | None = None) -> dict:
    return {"role": role, "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls,
            "tool_call_id": tool_call_id, "name": name}


class AgenticConversation(Conversation):
    """Regenerates the assistant steps of an agentic conversation, feeding the source's tool results while the
    target's calls equal the recorded ones; stops at the first step where they differ (``divergent_call``).

    The target regenerates every assistant step with the tool definitions in
    context. A step's tool calls come from the server's parsed ``tool_calls``
    (SGLang/vLLM with a tool-call parser) or are parsed from its text
    (Qwen3.5/3.6 ``<tool_call><function=NAME>`` blocks, ``generation.tool_calls``).
    Where the source recorded a call step, the regenerated calls must equal the
    recorded ones (same names in the same order, arguments equal as parsed JSON);
    then the source's tool results follow and the target takes the next step.
    Where they differ, or the target calls a tool where the source answered (or
    answers where the source called), the source's results no longer apply: the
    conversation stops there, keeping what was generated, and the row's
    ``agentic_stop`` says ``divergent_call``
    (``GenerationStats.agentic_stopped_at_divergent_call`` counts them).
    """

    def __init__(self, prompt_id: str, system: str | None, events: list[dict], tools: list[dict] | None,
                 gen: GenerationConfig, config_hash: str):
        super().__init__(prompt_id, system, [e["content"] for e in events if e["role"] == "user"], gen, config_hash)
        self.events = events
        self.tools = tools
        self.tools_json = json_dumps(tools).decode() if tools else None
        self.pos = 0  # next source event
        self.queries = 0  # user turns sent
        self.awaiting_user = True
        self.stop: str | None = None
        self.messages = [_message("system", system)] if system else []

    def _calls(self, res: ChatResult) -> tuple[str, list[dict]]:
        if res.tool_calls is not None:  # the server ran a tool-call parser
            calls, malformed = calls_from_server(res.tool_calls)
            if not malformed:
                return res.content, calls
        content, calls, _ = parse_qwen_tool_calls(res.content or "", self.tools)
        return content, calls

    async def step(self, engine: Engine) -> tuple[bool, ChatResult]:
        if self.started_at is None:
            self.started_at = time.time()
        self.attempts += 1
        request = list(self.history)
        user = None
        if self.awaiting_user:
            user = self.events[self.pos]["content"]
            request.append({"role": "user", "content": user})
        res = await self._chat(engine, request, tools=self.tools)
        if res is None:
            self.stop = "context_length"
            return self._stopped_at_context()
        # committed only after success: a failed request leaves the conversation where it was
        content, calls = self._calls(res)
        if user is not None:
            self.messages.append(_message("user", user))
            self.pos += 1
            self.queries += 1
            self.awaiting_user = False
        step = len(self.results)
        ids = [c.get("id") or f"call_{step}_{k}" for k, c in enumerate(calls)]
        self.messages.append(_message(
            "assistant", content, res.reasoning_content,
            [{"id": i, "type": "function", "function": {"name": c["name"], "arguments": json_dumps(c["arguments"]).decode()}}
             for i, c in zip(ids, calls)] or None))
        self.history = request + [{"role": "assistant", "content": content, "reasoning_content": res.reasoning_content,
                                   **({"tool_calls": [{"id": i, "type": "function", "function": {
                                       "name": c["name"], "arguments": c["arguments"]}} for i, c in zip(ids, calls)]}
                                      if calls else {})}]
        self.results.append(res)
        if res.finish_reason == "length" and self.gen.stop_after_truncated_turn:
            self.stop = "truncated"
            return True, res
        events = self.events
        recorded = events[self.pos] if self.pos < len(events) and events[self.pos]["role"] == "assistant" else None
        if recorded is None:
            if calls:  # a call where the source answered: no result to give
                self.stop = "divergent_call"
                return True, res
            if self.pos >= len(events) or self.queries >= self.gen.max_turns:
                return True, res
            self.awaiting_user = True
            return False, res
        if not same_calls(calls, recorded["tool_calls"]):
            self.stop = "divergent_call"
            return True, res
        self.pos += 1
        results = []
        while self.pos < len(events) and events[self.pos]["role"] == "tool":
            results.append(events[self.pos])
            self.pos += 1
        for k, r in enumerate(results):
            call_id = ids[k] if k < len(ids) else r.get("tool_call_id")
            name = r.get("name") or (calls[k]["name"] if k < len(calls) else None)
            self.history.append({"role": "tool", "content": r["content"], "tool_call_id": call_id, "name": name})
            self.messages.append(_message("tool", r["content"], tool_call_id=call_id, name=name))
        return not results, res  # a source ending at a call ends here

    def row(self) -> dict:
        row = super().row()
        row["tools"] = self.tools_json
        row["agentic_stop"] = self.stop
        return row


def agentic_task(pid: str, row: dict, gen: GenerationConfig, config_hash: str) -> AgenticConversation | str:
    """The task of a raw_prompts row with ``agentic_turns``, or why it cannot be generated."""
    try:
        events = json_loads(row["agentic_turns"])
        tools = json_loads(row["tools"]) if row.get("tools") else None
    except ValueError as e:
        return f"agentic_turns/tools are not JSON: {e}"
    if not isinstance(events, list) or not events or events[0].get("role") != "user":
        return "agentic_turns do not start with a user turn"
    return AgenticConversation(pid, row.get("system") or None, events, tools, gen, config_hash)
