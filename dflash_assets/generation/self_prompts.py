"""User turns written by the target itself (the Magpie method): its chat template cut after the user header.

:func:`user_header_prefix` renders a conversation (a system turn or none, earlier turns) with one more user turn
holding a marker, through the target's own template, and cuts the text at the marker: what is left ends with
the user header (SmolLM2 with no system turn: its default system prompt, then ``<|im_start|>user\\n``).
:class:`UserTurnSampler` samples from that prefix with plain Transformers ``generate`` (left-padded batches,
seeded per batch and turn), until an end-of-turn id or ``max_new_tokens``; with ``turns`` > 1 the target
answers each user turn that ended, then writes the next user turn the same way. A user turn that does not end
its turn ends its conversation (the first one: the sample has no prompt, ``ended`` False).

Reads the target through its ``TargetModelSpec`` (the chat object and the weights); writes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["MARKER", "SelfPromptSampling", "SampledConversation", "user_header_prefix", "UserTurnSampler"]

MARKER = "\ue000user-turn\ue001"  # private-use characters: no template or text holds them


@dataclass(frozen=True)
class SelfPromptSampling:
    """How user turns (and, with ``turns`` > 1, the answers between them) are sampled."""

    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    turns: int = 1  # user turns per conversation
    system_prompt: str | None = None  # None: what the template renders before a first user turn (maybe nothing)
    answer_max_new_tokens: int = 256
    answer_temperature: float = 0.7
    answer_top_p: float = 0.95
    enable_thinking: bool = False  # the answers' thinking mode, where the template has one

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.answer_max_new_tokens < 1:
            raise ValueError("max_new_tokens and answer_max_new_tokens must be >= 1")
        if self.turns < 1:
            raise ValueError("turns must be >= 1")
        if self.temperature <= 0 or self.answer_temperature < 0:
            raise ValueError("temperature must be > 0 (user turns are sampled), answer_temperature >= 0")
        if not (0 < self.top_p <= 1 and 0 < self.answer_top_p <= 1):
            raise ValueError("top_p and answer_top_p must be in (0, 1]")


@dataclass
class SampledConversation:
    """One sample: its user turns (each ended its turn), the target's answers between them, and whether the
    first user turn ended (False: ``user_turns`` holds that unfinished text alone)."""

    index: int
    user_turns: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    ended: bool = False
    new_tokens: int = 0  # user-turn tokens generated (answers not counted)


def user_header_prefix(chat: Any, history: Sequence[dict], system_prompt: str | None = None) -> str:
    """The template's rendering of ``history`` (after a system turn when ``system_prompt`` is given) up to and
    including the next user turn's header. ``chat``: the target's chat object (``TargetModelSpec.chat()``)."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else []) + [
        *history, {"role": "user", "content": MARKER}]
    text = chat.render(messages, add_generation_prompt=False)
    if text.count(MARKER) != 1:
        raise ValueError("the chat template does not render a user turn's content verbatim: no place to cut after "
                         "the user header")
    return text[: text.index(MARKER)]


class UserTurnSampler:
    """Samples conversations from the target with Transformers ``generate`` on one device.

    ``model`` and ``chat`` are the loaded target (``spec.load_model(device, dtype)``, ``spec.chat()``).
    ``sample(indices, seed)`` writes one conversation per index; the draws depend on ``seed`` and the indices
    (the same batch twice gives the same conversations on one machine).
    """

    def __init__(self, model: Any, chat: Any, sampling: SelfPromptSampling = SelfPromptSampling()):
        self.model, self.chat, self.sampling = model, chat, sampling
        self.stop_ids = sorted(chat.stop_ids)
        if not self.stop_ids:
            raise ValueError("the target's chat declares no end-of-turn id: a user turn could never end")
        self.first_prefix = chat.encode(user_header_prefix(chat, [], sampling.system_prompt))
        self.seconds = 0.0  # in generate calls

    def _generate(self, rows: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
                  seed: int) -> list[tuple[list[int], bool]]:
        """(new ids without the stop id, ended at a stop id) of each row, sampled in one left-padded batch."""
        import torch

        pad = self.stop_ids[0]
        width = max(len(r) for r in rows)
        device = self.model.device
        x = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0
                    else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      eos_token_id=self.stop_ids, pad_token_id=pad, **sampling)
        self.seconds += time.perf_counter() - t0
        result = []
        for new in out[:, width:].tolist():
            stop = next((i for i, t in enumerate(new) if t in self.stop_ids), None)
            result.append((new, False) if stop is None else (new[:stop], True))
        return result

    def _text(self, ids: list[int]) -> str:
        return self.chat.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def _history(self, c: SampledConversation) -> list[dict]:
        out = []
        for user, answer in zip(c.user_turns, c.answers):
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return out

    def sample(self, indices: Sequence[int], seed: int) -> list[SampledConversation]:
        """One conversation per index (each sampled with the batch's seed: ``seed``, the first index, the turn)."""
        s = self.sampling
        convs = [SampledConversation(i) for i in indices]
        base = (seed * 1_000_003 + (indices[0] if indices else 0)) * 64
        alive = convs
        for turn in range(s.turns):
            if turn == 0:
                rows = [list(self.first_prefix) for _ in alive]
            else:  # the target answers the last user turn, then writes the next one
                system = [{"role": "system", "content": s.system_prompt}] if s.system_prompt is not None else []
                answer_rows = [self.chat.prompt_ids([*system, *self._history(c),
                                                     {"role": "user", "content": c.user_turns[-1]}],
                                                    enable_thinking=s.enable_thinking) for c in alive]
                answers = self._generate(answer_rows, s.answer_max_new_tokens, s.answer_temperature,
                                         s.answer_top_p, base + 2 * turn - 1)
                for c, (ids, _) in zip(alive, answers):
                    c.answers.append(self._text(ids))
                alive = [c for c, (_, ended) in zip(alive, answers) if ended]
                if not alive:
                    break
                rows = [self.chat.encode(user_header_prefix(self.chat, self._history(c), s.system_prompt))
                        for c in alive]
            outs = self._generate(rows, s.max_new_tokens, s.temperature, s.top_p, base + 2 * turn)
            still = []
            for c, (ids, ended) in zip(alive, outs):
                c.new_tokens += len(ids) + int(ended)
                if turn == 0:
                    c.user_turns.append(self._text(ids))
                    c.ended = ended
                elif ended:
                    c.user_turns.append(self._text(ids))
                else:  # an unfinished later turn ends the conversation: the answer before it goes too
                    c.answers.pop()
                if ended:
                    still.append(c)
            alive = still
            if not alive:
                break
        for c in convs:  # answers only between user turns
            del c.answers[max(len(c.user_turns) - 1, 0):]
        return convs
