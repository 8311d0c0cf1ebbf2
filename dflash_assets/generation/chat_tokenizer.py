"""The generation clients' tokenizer adapter: chats to prompt ids, generated ids to (reasoning, content).

`ChatTokenizer` wraps the target's chat object (`target_model.chat.TargetChat`, made by
`TargetModelSpec.chat()`: its tokenizer, renderer with the spec's template kwargs and stop ids) or any
HF-style tokenizer for the engines that send or receive token ids (SGLang's native API, the in-process
engine): it renders a chat's generation prompt through the one renderer
(`target_model.chat_template.ChatRenderer`), encodes it, and splits generated ids at
the `</think>` id, the id-level twin of `target_model.chat_template.split_think` (a
test checks the two agree). `strip_stop_text` drops a stop marker that a
server left at the end of its text. Reads and writes nothing (the tokenizer
object it is given is already loaded); imports transformers only when present.
"""

from __future__ import annotations

from typing import Any, Sequence

from dflash_assets.target_model.chat import TargetChat, encode_text, encode_texts, stop_token_ids, token_id_of
from dflash_assets.target_model.chat_template import THINK_END, THINK_START, ChatRenderer

__all__ = ["ChatTokenizer", "strip_stop_text"]


class ChatTokenizer:
    """Renders chats to prompt ids and decodes outputs with any HF-style tokenizer.

    Needs only ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True, enable_thinking=...)``, ``encode`` /
    ``decode`` and ``convert_tokens_to_ids``; a fast tokenizer's Rust backend
    is used for encoding when present (about 1.5x faster). A transformers
    tokenizer with one template renders through the project's one renderer
    (`ChatRenderer`, the same output as its ``apply_chat_template``, ~2x faster).
    Given a `TargetChat` it renders with the chat's renderer (the target spec's template kwargs; a call's
    ``enable_thinking`` overrides them) and stops on the chat's stop ids (`target_model.chat.stop_token_ids`,
    the one rule, also for a bare tokenizer).
    """

    def __init__(self, tokenizer: Any):
        if isinstance(tokenizer, ChatTokenizer):
            tokenizer = tokenizer.chat if tokenizer.chat is not None else tokenizer.tokenizer
        self.chat: TargetChat | None = tokenizer if isinstance(tokenizer, TargetChat) else None
        if self.chat is not None:
            tokenizer = self.chat.tokenizer
        self.tokenizer = tokenizer
        self.think_start_id = self._token_id(THINK_START)
        self.think_end_id = self._token_id(THINK_END)
        self.stop_ids = self.chat.stop_ids if self.chat is not None else stop_token_ids(tokenizer)
        self._render = self._chat_renderer()
        # Kept as text by `decode` even where the tokenizer marks them special: a step's tool calls
        # (Qwen3.5/3.6 `<tool_call>` blocks) are parsed from the decoded content.
        self._kept_marks = {i: t for t in ("<tool_call>", "</tool_call>") if (i := self._token_id(t)) is not None}

    def _token_id(self, token: str) -> int | None:
        return token_id_of(self.tokenizer, token)

    def _chat_renderer(self):
        """The one chat renderer (`target_model.chat_template.ChatRenderer`: the template compiled once) when the
        tokenizer renders with transformers' own `apply_chat_template` and one template; else None. A chat
        object's own renderer when given one."""
        if self.chat is not None:
            return self.chat.renderer
        try:
            from transformers import PreTrainedTokenizerBase
        except ImportError:
            return None
        own = getattr(type(self.tokenizer), "apply_chat_template", None)
        if own is not PreTrainedTokenizerBase.apply_chat_template:
            return None
        if not isinstance(getattr(self.tokenizer, "chat_template", None), str):
            return None
        return ChatRenderer.from_tokenizer(self.tokenizer)

    def render(self, messages: Sequence[dict], enable_thinking: bool, tools: Sequence[dict] | None = None) -> str:
        """The generation prompt of `messages` (with `tools`, JSON schemas, in the system turn when given)."""
        if self._render is not None:
            return self._render(messages, add_generation_prompt=True, tools=tools, enable_thinking=enable_thinking)
        return self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools is not None else None, tokenize=False,
            add_generation_prompt=True, enable_thinking=enable_thinking
        )

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in one call off the GIL (`target_model.chat.encode_texts`)."""
        return encode_texts(self.tokenizer, texts)

    def prompt_ids(self, messages: Sequence[dict], enable_thinking: bool,
                   tools: Sequence[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, enable_thinking, tools))

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        marks = self._kept_marks
        if marks and any(i in marks for i in ids):
            parts, start = [], 0
            for k, i in enumerate(ids):
                if i in marks:
                    parts += [self.tokenizer.decode(ids[start:k], skip_special_tokens=True), marks[i]]
                    start = k + 1
            parts.append(self.tokenizer.decode(ids[start:], skip_special_tokens=True))
            return "".join(parts)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def split_output_ids(self, ids: Sequence[int], enable_thinking: bool,
                         extra_stop_ids: Sequence[int] = ()) -> tuple[str, str]:
        """(reasoning, content) of generated ids, cut at ``</think>``; trailing stop ids dropped.

        With thinking on and no ``</think>`` (cut by max_new_tokens, or the
        model stopped while thinking) everything is reasoning, as SGLang's
        qwen3 reasoning parser does.
        """
        ids = list(ids)
        stops = self.stop_ids | set(extra_stop_ids)
        while ids and ids[-1] in stops:
            ids.pop()
        end = self.think_end_id
        if end is not None and end in ids:
            cut = ids.index(end)
            reasoning, content = ids[:cut], ids[cut + 1 :]
        elif enable_thinking:
            reasoning, content = ids, []
        else:
            reasoning, content = [], ids
        if reasoning and reasoning[0] == self.think_start_id:
            reasoning = reasoning[1:]
        return self.decode(reasoning).strip("\n"), self.decode(content).lstrip("\n")


def strip_stop_text(text: str) -> str:
    """`text` without a trailing `<|im_end|>` / `<|endoftext|>` (servers that return stop text in their output)."""
    for marker in ("<|im_end|>", "<|endoftext|>"):
        if text.endswith(marker):
            text = text[: -len(marker)]
    return text
