"""Chat templates for DFlash targets.

Reads the packaged Qwen3.5/3.6-style ChatML template
(`dflash_assets/templates/qwen3_6.jinja`) or a user-supplied Jinja file, and
renders conversations with it through the same sandboxed Jinja environment
that Hugging Face tokenizers use (`tokenizer.apply_chat_template`). Writes
nothing.

Format (see DESIGN.md "Chat format"): turns are `<|im_start|>{role}\\n{content}<|im_end|>\\n`;
an assistant turn after the last user message renders as
`<|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}<|im_end|>\\n`
(reasoning from the message's `reasoning_content`), earlier assistant turns
without the think block. Generation prompt: `<|im_start|>assistant\\n<think>\\n`
with thinking, `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n` with
`enable_thinking=False`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
DEFAULT_TEMPLATE_NAME = "qwen3_6.jinja"

# Header after which the supervised (loss-mask = 1) span of the final assistant turn starts.
ASSISTANT_THINK_HEADER = "<|im_start|>assistant\n<think>\n"
GENERATION_PROMPT_THINKING = "<|im_start|>assistant\n<think>\n"
GENERATION_PROMPT_NO_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def default_chat_template() -> str:
    """The packaged Qwen3.5/3.6-style template text."""
    return (TEMPLATES_DIR / DEFAULT_TEMPLATE_NAME).read_text("utf-8")


def load_chat_template(path: str | Path | None = None) -> str:
    """Template text from `path`, or the packaged default when `path` is None.

    Raises FileNotFoundError for a missing file and ValueError for an empty one.
    """
    if path is None:
        return default_chat_template()
    text = Path(path).read_text("utf-8")
    if not text.strip():
        raise ValueError(f"chat template file {path} is empty")
    return text


def template_hash(template: str) -> str:
    """Short stable content hash of a template (16 hex chars of sha256)."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


def render_chat(
    messages: list[dict],
    template: str | None = None,
    add_generation_prompt: bool = False,
    **template_kwargs,
) -> str:
    """Render `messages` with `template` (default template when None) to a string.

    Uses transformers' own Jinja renderer, so the result equals
    `tokenizer.apply_chat_template(messages, tokenize=False, ...)` for a
    tokenizer carrying the same template.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=template if template is not None else default_chat_template(),
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    return rendered[0]
