"""The Qwen3.5/3.6-style chat template: exact renders through tokenizer.apply_chat_template."""

from __future__ import annotations

import pytest

from dflash_assets.target_model.chat_template import (
    ASSISTANT_THINK_HEADER,
    GENERATION_PROMPT_NO_THINKING,
    GENERATION_PROMPT_THINKING,
    default_chat_template,
    load_chat_template,
    render_chat,
    template_hash,
)
from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "What is 2+2?"}
A1 = {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}
U2 = {"role": "user", "content": "And 3+3?"}
A2 = {"role": "assistant", "content": "6.", "reasoning_content": "\nAdd again.\n"}


@pytest.fixture(scope="module")
def tok():
    return build_qwen3_6_tokenizer()


def render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


CASES = [
    pytest.param([U1], {"add_generation_prompt": True},
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n", id="gen-thinking"),
    pytest.param([U1], {"add_generation_prompt": True, "enable_thinking": True},
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n", id="gen-thinking-explicit"),
    pytest.param([SYSTEM, U1], {"add_generation_prompt": True, "enable_thinking": False},
                 "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n\n</think>\n\n", id="gen-no-thinking-system"),
    pytest.param([U1, A1], {},
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4.<|im_end|>\n", id="single-turn"),
    pytest.param([SYSTEM, U1, A1, U2, A2], {},
                 "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                 "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6.<|im_end|>\n", id="multi-turn"),
    pytest.param([U1, A1, U2], {"add_generation_prompt": True},
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
                 "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n", id="multi-turn-gen"),
    pytest.param([U1, {"role": "assistant", "content": "4."}], {},
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4.<|im_end|>\n",
                 id="final-without-reasoning"),
    pytest.param([U1, {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4."}], {},
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4.<|im_end|>\n",
                 id="inline-think-in-content"),
    pytest.param([{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
                 {"add_generation_prompt": True},
                 "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n", id="content-parts"),
    pytest.param(
        [U1, {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
              "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
         {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4.", "reasoning_content": "Got it."}],
        {},
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nGot it.\n</think>\n\n4.<|im_end|>\n", id="tool-round"),
]


@pytest.mark.parametrize("messages,kwargs,expected", CASES)
def test_exact_render(tok, messages, kwargs, expected):
    assert render(tok, messages, **kwargs) == expected
    assert render_chat(messages, **kwargs) == expected  # same engine without a tokenizer


def test_generation_prompt_constants(tok):
    assert render(tok, [U1], add_generation_prompt=True).endswith(GENERATION_PROMPT_THINKING)
    assert render(tok, [U1], add_generation_prompt=True, enable_thinking=False).endswith(GENERATION_PROMPT_NO_THINKING)
    assert ASSISTANT_THINK_HEADER == GENERATION_PROMPT_THINKING


def test_segmentwise_encoding_equals_whole(tok):
    """The loss-mask convention relies on encoding prefix and supervised span separately."""
    text = render(tok, [SYSTEM, U1, A1, U2, {"role": "assistant", "content": " Six, 六 🎲.", "reasoning_content": "3+3 = 6"}])
    cut = text.rindex(ASSISTANT_THINK_HEADER) + len(ASSISTANT_THINK_HEADER)
    whole = tok.encode(text, add_special_tokens=False)
    parts = tok.encode(text[:cut], add_special_tokens=False) + tok.encode(text[cut:], add_special_tokens=False)
    assert parts == whole
    assert tok.convert_ids_to_tokens(whole[-2:]) == ["<|im_end|>", "Ċ"]


def test_load_chat_template_override(tmp_path, tok):
    assert load_chat_template(None) == default_chat_template()
    custom = tmp_path / "plain.jinja"
    custom.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    text = load_chat_template(str(custom))
    assert render_chat([U1], template=text) == "[user] What is 2+2?\n"
    overridden = build_qwen3_6_tokenizer(chat_template=text)
    assert render(overridden, [U1, A1]) == "[user] What is 2+2?\n[assistant] 4.\n"
    assert template_hash(text) != template_hash(default_chat_template())
    with pytest.raises(FileNotFoundError):
        load_chat_template(tmp_path / "missing.jinja")
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_chat_template(tmp_path / "empty.jinja")


# -- one renderer, one reasoning splitter ------------------------------------------------------

# A ChatML template of the classic shape (no think block): reads `message.content` as is, so a None
# that apply_chat_template drops would render as "None" through a renderer that skips its normalization.
CHATML = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "{%- if message.reasoning_content %}\n[r] {{ message.reasoning_content }}{% endif %}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is false %}[no-think]{% endif %}{% endif -%}"
    "{{- '' if add_generation_prompt else eos_token -}}"
)

CONVERSATIONS = [
    [SYSTEM, U1],
    [SYSTEM, U1, A1, U2],
    [U1, {"role": "assistant", "content": None, "reasoning_content": "Call it.",
          "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
     {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4.", "reasoning": "Old key name."}, U2],
    [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
     {"role": "assistant", "content": "<think>\nR\n</think>\n\nA", "reasoning_content": None}, U2],
]


@pytest.mark.parametrize("which", ["qwen3_6", "chatml"])
def test_one_renderer_equals_apply_chat_template_for_every_caller(tok, which):
    """ChatRenderer (tokenization), ChatTokenizer (generation clients) and render_chat give exactly what
    apply_chat_template gives, on the packaged Qwen3.6 template and on a ChatML one."""
    from dflash_assets.generation.chat_tokenizer import ChatTokenizer
    from dflash_assets.target_model.chat_template import ChatRenderer

    t = tok if which == "qwen3_6" else build_qwen3_6_tokenizer(chat_template=CHATML)
    renderer, client = ChatRenderer.from_tokenizer(t), ChatTokenizer(t)
    assert isinstance(client._render, ChatRenderer)  # the generation client renders through the one renderer
    for conv in CONVERSATIONS:
        want = t.apply_chat_template(conv, tokenize=False)
        assert renderer(conv) == want
        assert render_chat(conv, template=t.chat_template, **t.special_tokens_map) == want
        for thinking in (True, False):
            prompt = t.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
            assert client.render(conv, thinking) == prompt
            assert renderer(conv, add_generation_prompt=True, enable_thinking=thinking) == prompt
    if which == "chatml":  # the case that shows the normalization matters
        assert "None" not in renderer(CONVERSATIONS[2]) and t.eos_token in renderer(CONVERSATIONS[0])


def test_no_stage_renders_chats_another_way():
    """Every chat render in the package goes through target_model/chat_template.py; the only other path is
    ChatTokenizer's fallback for tokenizers that override apply_chat_template."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "dflash_assets"
    found = {}
    for path in root.rglob("*.py"):
        text = path.read_text("utf-8")
        hits = [w for w in ("apply_chat_template(", "_compile_jinja_template", "render_jinja_template",
                            "from_string(") if w in text]
        if hits:
            found[str(path.relative_to(root))] = hits
    assert found.pop("target_model/chat_template.py")
    assert found == {"generation/chat_tokenizer.py": ["apply_chat_template("]}


@pytest.mark.parametrize("text,thinking,expected", [
    ("R</think>C", True, ("R", "C")),
    ("<think>\nR\n</think>\n\nC", True, ("R", "C")),
    ("\nAll reasoning, cut\n", True, ("All reasoning, cut", "")),
    ("\n\nAnswer only", False, ("", "Answer only")),
    ("R</think>C</think>D", True, ("R", "C</think>D")),
    ("", True, ("", "")),
])
def test_one_reasoning_splitter_for_generated_text_and_messages(text, thinking, expected):
    from dflash_assets.generation import engines
    from dflash_assets.target_model import chat_template
    from dflash_assets.target_model.chat_template import split_reasoning, split_reasoning_text

    assert engines.split_reasoning_text is chat_template.split_reasoning_text  # one implementation
    assert split_reasoning_text(text, thinking) == expected
    if "</think>" in text:  # a message holding the same text in its content splits the same way
        assert split_reasoning({"role": "assistant", "content": text}) == expected
    assert split_reasoning({"role": "assistant", "content": "C", "reasoning_content": "R"}) == ("R", "C")


# -- the published Qwen3.6 template's behaviour -----------------------------------------------------
# Expected strings follow the template published with the Qwen3.6 models (chat_template.jinja): the packaged
# template renders the same strings (compared on 1,152 renders of tool, system, multi-step, whitespace and
# media cases; the published file is not in this repository).

TOOLS_PREAMBLE_END = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
WEATHER_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", '
                '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}')


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


AGENTIC = [
    {"role": "system", "content": "  You are terse.\n"},
    {"role": "user", "content": "\n Weather in Paris and Rome?  "},
    {"role": "assistant", "content": "", "reasoning_content": "  Two cities.\n\n", "tool_calls": [call("get_weather", city="Paris")]},
    {"role": "tool", "content": " 18C \n"},
    {"role": "assistant", "content": " Now Rome. ", "reasoning_content": "",
     "tool_calls": [call("get_weather", city="Rome", days=2), call("get_weather", city="Rome", detail={"hourly": [1, 2]})]},
    {"role": "tool", "content": "21C"},
    {"role": "tool", "content": "21C, 22C"},
    {"role": "assistant", "content": "\n\nParis 18C, Rome 21C.  ", "reasoning_content": "\nBoth known.\n"},
]
AGENTIC_TEXT = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + WEATHER_JSON
    + TOOLS_PREAMBLE_END + "\n\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\nNow Rome.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=detail>\n"
    '{"hourly": [1, 2]}\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n21C\n</tool_response>\n<tool_response>\n21C, 22C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\nBoth known.\n</think>\n\nParis 18C, Rome 21C.<|im_end|>\n"
)


def test_agentic_conversation_renders_as_the_published_template(tok):
    """Tool list in the system turn (the system prompt after it), every step after the last user query with
    its think block (empty reasoning too), calls as <function=...>/<parameter=...> blocks (two newlines
    before the first when the step has text, one between calls, JSON for non-string values), consecutive
    results in one user turn, all text trimmed."""
    assert render(tok, AGENTIC, tools=[WEATHER]) == AGENTIC_TEXT
    assert render_chat(AGENTIC, tools=[WEATHER]) == AGENTIC_TEXT
    prompt = render(tok, AGENTIC[:-1], tools=[WEATHER], add_generation_prompt=True)
    assert prompt == AGENTIC_TEXT[: AGENTIC_TEXT.rindex("<|im_start|>assistant\n")] + "<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("messages,kwargs,expected", [
    pytest.param([{"role": "system", "content": "\tBe kind. \n"}, {"role": "user", "content": "  hi\n\n"},
                  {"role": "assistant", "content": " \nhello \n", "reasoning_content": "\n\n  greet  \n"}], {},
                 "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\ngreet\n</think>\n\nhello<|im_end|>\n", id="whitespace-trimmed"),
    pytest.param([{"role": "system", "content": "  "}, U1, {"role": "assistant", "content": "4.", "reasoning_content": ""}],
                 {"tools": [WEATHER]},
                 "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + WEATHER_JSON
                 + TOOLS_PREAMBLE_END + "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n\n</think>\n\n4.<|im_end|>\n", id="tools-empty-system-empty-reasoning"),
    pytest.param([U1, {"role": "assistant", "content": "4.", "reasoning_content": "Add."}, U2,
                  {"role": "assistant", "content": "6.", "reasoning_content": "Again."}], {"preserve_thinking": True},
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd.\n</think>\n\n4.<|im_end|>\n"
                 "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\nAgain.\n</think>\n\n6.<|im_end|>\n",
                 id="preserve-thinking"),
    pytest.param([U1, {"role": "assistant", "content": "", "tool_calls": [call("add", a=2, b=2)]},
                  {"role": "tool", "content": "4"}, U2, {"role": "assistant", "content": "6."}], {},
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n<function=add>\n"
                 "<parameter=a>\n2\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
                 "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n\n</think>\n\n6.<|im_end|>\n", id="tool-step-before-the-last-query"),
    pytest.param([U1, {"role": "assistant", "content": "", "reasoning_content": "r",
                       "tool_calls": [call("add", a=2, b=2)]},
                  {"role": "user", "content": "<tool_response>\n4\n</tool_response>"}], {"add_generation_prompt": True},
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\n<tool_call>\n"
                 "<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n"
                 "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n", id="wrapped-tool-result-is-not-a-query"),
])
def test_published_template_cases(tok, messages, kwargs, expected):
    assert render(tok, messages, **kwargs) == expected
    assert render_chat(messages, **kwargs) == expected


@pytest.mark.parametrize("messages,message", [
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "No user query"),
    ([U1, {"role": "system", "content": "late"}], "System message must be at the beginning"),
    ([U1, {"role": "developer", "content": "x"}], "Unexpected message role"),
    ([U1, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}],
     "must be a mapping"),
])
def test_published_template_errors(tok, messages, message):
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match=message):
        render_chat(messages)


def test_generation_client_renders_tool_definitions(tok):
    """The generation clients' prompt of an agentic conversation carries the tool list, as apply_chat_template."""
    from dflash_assets.generation.chat_tokenizer import ChatTokenizer

    client, head = ChatTokenizer(tok), AGENTIC[:4]
    want = tok.apply_chat_template(head, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert client.render(head, True, tools=[WEATHER]) == want and "<tools>\n" + WEATHER_JSON in want
    assert client.prompt_ids(head, True, tools=[WEATHER]) == tok(want, add_special_tokens=False)["input_ids"]
    assert "<tools>" not in client.render(head, True)


@pytest.mark.parametrize("which", ["qwen3_6", "chatml"])
def test_renders_the_same_on_a_transformers_without_the_message_helpers(tok, which):
    """transformers 5.0-5.17 (e.g. a GPU image's own) has none of the message helpers newer versions run before
    rendering; there the renderer's stand-ins take the same steps for JSON data (None keys dropped, reasoning
    aliased), so a prompt renders the same where the completions are generated and where they are tokenized."""
    from types import SimpleNamespace

    from dflash_assets.target_model import chat_template

    t = tok if which == "qwen3_6" else build_qwen3_6_tokenizer(chat_template=CHATML)
    cases = [(conv, kw) for conv in CONVERSATIONS + [AGENTIC]
             for kw in ({}, {"add_generation_prompt": True, "enable_thinking": False})]
    with_helpers = chat_template.ChatRenderer.from_tokenizer(t)
    want = [with_helpers(conv, **kw) for conv, kw in cases]
    renderer = chat_template.ChatRenderer.from_tokenizer(t)
    renderer._ctu = chat_template._TemplateHelpers(SimpleNamespace())  # a chat_template_utils without them
    assert renderer._ctu._normalize_chat_messages is chat_template._drop_none_keys
    assert [renderer(conv, **kw) for conv, kw in cases] == want
    assert renderer(AGENTIC[:4], tools=[WEATHER], add_generation_prompt=True) == \
        with_helpers(AGENTIC[:4], tools=[WEATHER], add_generation_prompt=True)
