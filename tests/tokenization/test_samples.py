"""Completions -> tokenized samples (Qwen3.6 tokenizer and template), and the sample checks."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from jinja2.exceptions import TemplateError

from dflash_assets.target_model.chat_template import ChatRenderer, render_chat, split_reasoning
from dflash_assets.tokenization.encoder import BACKEND_HF, BACKEND_TIKTOKEN, GPT2_PAT_STR, TiktokenParts, build_encoder, qwen3_6_encoder
from dflash_assets.tokenization.quality import (
    empty_response_check,
    loss_token_histogram,
    schema_check,
    thinking_ratio_check,
    truncation_ratio_check,
)
from dflash_assets.tokenization.samples import (
    AGENTIC_MESSAGES_TYPE,
    COMPLETIONS_MESSAGES_TYPE,
    SAMPLES_SCHEMA,
    TokenizeConfig,
    expand_conversation,
    tokenize_completions,
)
from tests.support.sharegpt import sharegpt_completions

SYSTEM = {"role": "system", "content": "You are terse."}


def user(text):
    return {"role": "user", "content": text}


def assistant(answer, reasoning=None):
    return {"role": "assistant", "content": answer, "reasoning_content": reasoning}


def completions(conversations, ids=None) -> pa.Table:
    ids = ids or [f"p{i}" for i in range(len(conversations))]
    return pa.table({"prompt_id": pa.array(ids, pa.string()), "messages": pa.array(conversations, COMPLETIONS_MESSAGES_TYPE)})


@pytest.fixture(scope="module")
def tok():
    from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer

    return build_qwen3_6_tokenizer()


@pytest.fixture(scope="module")
def enc(tok):
    return qwen3_6_encoder(tok, strict=True)


@pytest.fixture(scope="module")
def sharegpt():
    return sharegpt_completions(300)


def supervised_text(enc, row) -> str:
    ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"], dtype=bool)
    return enc.decode(ids[mask])


def unsupervised_text(enc, row) -> str:
    ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"], dtype=bool)
    return enc.decode(ids[~mask])


def assert_one_span(row):
    mask = np.array(row["loss_mask"])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    assert len(edges) == 2, "the supervised span must be contiguous"


# -- rendering --------------------------------------------------------------------------


def test_renderer_equals_apply_chat_template(tok, sharegpt):
    renderer, from_tok = ChatRenderer(), ChatRenderer.from_tokenizer(tok)
    convs = [m for m in sharegpt.column("messages").to_pylist()[:200] if m] + [
        [SYSTEM, user("q"), assistant("a", "r")],
        [user("q1"), assistant("a1", "r1"), user("q2"), assistant("<think>\ninline r\n</think>\n\na2")],
    ]
    refused = 0
    for messages in convs:
        try:
            want = tok.apply_chat_template(messages, tokenize=False)
        except TemplateError as e:  # e.g. an assistant-only record: no user query (as the published template)
            refused += 1
            for render in (renderer, from_tok, render_chat):
                with pytest.raises(TemplateError, match=str(e)):
                    render(messages)
            continue
        assert renderer(messages) == want
        assert from_tok(messages) == want
        assert render_chat(messages) == want
    assert 0 < refused < len(convs) // 10
    assert renderer([user("q")], add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n")


def test_split_reasoning_and_expansion():
    assert split_reasoning(assistant("A", "R")) == ("R", "A")
    assert split_reasoning({"role": "assistant", "content": "<think>\nR\n</think>\n\nA"}) == ("R", "A")
    assert split_reasoning(assistant("A")) == ("", "A")
    conv = [SYSTEM, user("u1"), assistant("a1"), user("u2"), assistant("a2"), user("u3")]
    last = expand_conversation(conv, "last_turn")
    assert [(t, len(m), r) for t, m, r in last] == [(1, 5, None)]  # trailing user turn cut
    every = expand_conversation(conv, "every_turn")
    assert [(t, len(m)) for t, m, _ in every] == [(0, 3), (1, 5)]
    assert expand_conversation([], "last_turn") == [(-1, None, "no_assistant_turn")]
    assert expand_conversation([assistant("x"), user("u"), assistant("y")], "every_turn")[0][2] == "no_user_turn"


# -- exact masks ------------------------------------------------------------------------


def test_single_turn_mask_is_reasoning_answer_and_end_of_turn(tok, enc):
    conv = [SYSTEM, user("What is 2+2?"), assistant("The answer is 4.", "Two plus two.\nThat is 4.")]
    table, stats = tokenize_completions(completions([conv]), enc)
    assert stats.samples == 1 and stats.dropped == {}
    row = table.to_pylist()[0]
    assert supervised_text(enc, row) == "Two plus two.\nThat is 4.\n</think>\n\nThe answer is 4.<|im_end|>\n"
    assert unsupervised_text(enc, row) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    assert_one_span(row)
    rendered = tok.apply_chat_template(conv, tokenize=False)
    assert row["input_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert row["loss_mask"][-1] == 1 and row["input_ids"][-2:] == [248046, 198]  # <|im_end|> \n supervised
    assert (row["turn_index"], row["num_tokens"], row["truncated"]) == (0, len(row["input_ids"]), False)
    assert row["num_loss_tokens"] == sum(row["loss_mask"])
    assert row["has_reasoning"] and not row["answer_empty"]
    assert (row["reasoning_chars"], row["answer_chars"]) == (24, 16)


def test_multi_turn_last_turn_supervises_only_the_final_turn(enc):
    conv = [user("u1"), assistant("a1", "r1"), user("u2"), assistant("a2", "r2"), user("trailing")]
    table, _ = tokenize_completions(completions([conv]), enc)
    (row,) = table.to_pylist()
    assert row["turn_index"] == 1
    assert supervised_text(enc, row) == "r2\n</think>\n\na2<|im_end|>\n"
    assert unsupervised_text(enc, row) == (
        "<|im_start|>user\nu1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"  # earlier reasoning dropped
        "<|im_start|>user\nu2<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert "trailing" not in enc.decode(row["input_ids"])


def test_every_turn_gives_one_sample_per_assistant_turn_with_its_reasoning(enc):
    conv = [SYSTEM, user("u1"), assistant("a1", "r1"), user("u2"), assistant("a2", "r2"), user("u3"), assistant("a3", "r3")]
    every, stats = tokenize_completions(completions([conv]), enc, TokenizeConfig(supervise="every_turn"))
    last, _ = tokenize_completions(completions([conv]), enc, TokenizeConfig(supervise="last_turn"))
    rows = every.to_pylist()
    assert [r["turn_index"] for r in rows] == [0, 1, 2] and stats.samples == 3
    for k, row in enumerate(rows, start=1):
        assert supervised_text(enc, row) == f"r{k}\n</think>\n\na{k}<|im_end|>\n"
        assert enc.decode(row["input_ids"]).endswith(f"<|im_start|>user\nu{k}<|im_end|>\n<|im_start|>assistant\n<think>\nr{k}\n</think>\n\na{k}<|im_end|>\n")
        assert_one_span(row)
    assert rows[2]["input_ids"] == last.to_pylist()[0]["input_ids"]
    # every_turn re-encodes each prefix: tokens grow ~quadratically with the number of turns
    assert every.column("num_tokens").to_numpy().sum() > 2 * last.column("num_tokens").to_numpy().sum()


def test_stub_answer_without_reasoning_supervises_six_tokens(enc):
    table, _ = tokenize_completions(completions([[user("hi"), assistant("OK.")]]), enc)
    (row,) = table.to_pylist()
    # "<think>\n\n</think>": "\n\n" is one token straddling the span start, so it stays unsupervised
    assert supervised_text(enc, row) == "</think>\n\nOK.<|im_end|>\n"
    assert row["num_loss_tokens"] == 6 and not row["has_reasoning"] and not row["answer_empty"]


def test_batch_encoding_equals_whole_text_hf_encoding_on_sharegpt(tok, enc, sharegpt):
    """Rendered with the template, encoded piecewise in batches == HF encode of the whole text,
    and the mask == SpecForge's rule computed with HF encodes of prefixes."""
    config = TokenizeConfig(max_length=1 << 20, batch_size=64)
    table, stats = tokenize_completions(sharegpt, enc, config)
    assert stats.samples > 250 and stats.truncated == 0
    assert stats.encoder["encoder_backend"] == BACKEND_TIKTOKEN and stats.encoder["parity_mismatched"] == 0
    by_id = dict(zip(sharegpt.column("prompt_id").to_pylist(), sharegpt.column("messages").to_pylist()))
    rows = table.to_pylist()
    texts, prefixes = [], []
    for row in rows:
        _, messages, _ = expand_conversation(by_id[row["prompt_id"]], "last_turn")[0]
        text = tok.apply_chat_template(messages, tokenize=False)
        texts.append(text)
        prefixes.append(text[: text.rfind("<|im_start|>assistant\n<think>\n") + len("<|im_start|>assistant\n<think>\n")])
    whole = tok(texts, add_special_tokens=False)["input_ids"]
    starts = [len(x) for x in tok(prefixes, add_special_tokens=False)["input_ids"]]
    bad_ids = [r["prompt_id"] for r, w in zip(rows, whole) if r["input_ids"] != w]
    assert bad_ids == []
    for row, text, start in zip(rows, texts, starts):
        assert row["loss_mask"] == [0] * start + [1] * (row["num_tokens"] - start), row["prompt_id"]
        assert enc.decode(row["input_ids"]) == unicodedata.normalize("NFC", text)


def test_hf_fallback_backend_produces_the_same_table(tok, enc, sharegpt):
    ref = TiktokenParts.qwen3_6()
    hf = build_encoder(tok, parts=TiktokenParts(ref.mergeable_ranks, GPT2_PAT_STR, ref.special_tokens, "NFC"))
    assert hf.backend == BACKEND_HF
    subset = sharegpt.slice(0, 40)
    fast_table, _ = tokenize_completions(subset, enc, TokenizeConfig(max_length=512))
    hf_table, stats = tokenize_completions(subset, hf, TokenizeConfig(max_length=512))
    assert stats.encoder["encoder_backend"] == BACKEND_HF
    assert hf_table.equals(fast_table)


def test_generic_chatml_template_with_configured_markers(tok, enc):
    """A template without think blocks (Qwen2.5-style ChatML): markers come from the config."""
    chatml = (
        "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    conv = [user("u1"), assistant("a1"), user("u2"), assistant("a2")]
    config = TokenizeConfig(assistant_header="<|im_start|>assistant\n", supervise="every_turn")
    table, _ = tokenize_completions(completions([conv]), enc, config, template=chatml)
    rows = table.to_pylist()
    assert [supervised_text(enc, r) for r in rows] == ["a1<|im_end|>\n", "a2<|im_end|>\n"]
    assert rows[1]["input_ids"] == tok(tok.apply_chat_template(conv, tokenize=False, chat_template=chatml), add_special_tokens=False)["input_ids"]
    # With the default Qwen3.6 header this template has no supervised span at all.
    _, stats = tokenize_completions(completions([conv]), enc, TokenizeConfig(), template=chatml)
    assert stats.samples == 0 and stats.dropped == {"no_supervised_span": 1}


# -- truncation and drops ------------------------------------------------------------------


def test_truncation_is_flagged_and_keeps_the_head(tok, enc):
    conv = [user("Count."), assistant(" ".join(str(i) for i in range(200)), "Counting up.")]
    full, _ = tokenize_completions(completions([conv]), enc)
    cut, stats = tokenize_completions(completions([conv]), enc, TokenizeConfig(max_length=40))
    (f,), (c,) = full.to_pylist(), cut.to_pylist()
    assert f["num_tokens"] > 40 and not f["truncated"]
    assert c["truncated"] and c["num_tokens"] == 40 and stats.truncated == 1
    assert c["input_ids"] == f["input_ids"][:40] and c["loss_mask"] == f["loss_mask"][:40]
    assert c["loss_mask"][-1] == 1 and c["num_loss_tokens"] == sum(c["loss_mask"]) < f["num_loss_tokens"]
    assert stats.tokens == 40 and stats.rendered_tokens == f["num_tokens"]


def test_samples_without_supervised_tokens_are_dropped_and_counted(enc):
    long_prompt = "word " * 300
    convs = [
        [user("only a question")],  # no assistant
        [assistant("talks first")],  # no user before the assistant
        [user(long_prompt), assistant("fine", "r")],  # span starts after max_length
        [user("q"), assistant("I say <|im_start|>assistant\n<think>\n inside", "r")],  # marker in response
        [],  # empty conversation
        [SYSTEM, user("q"), assistant("kept", "r")],
    ]
    table, stats = tokenize_completions(completions(convs), enc, TokenizeConfig(max_length=128))
    assert table.column("prompt_id").to_pylist() == ["p5"]
    assert stats.dropped == {
        "marker_in_response": 1,
        "no_assistant_turn": 2,
        "no_user_turn": 1,
        "prompt_exceeds_max_length": 1,
    }
    assert stats.conversations == 6 and stats.samples == 1
    meta = stats.to_metadata()
    assert meta["dropped"] == 5 and meta["dropped_no_assistant_turn"] == 2 and meta["encoder_backend"] == "tiktoken"


def test_every_turn_drop_counts_are_per_turn(enc):
    conv = [assistant("greeting"), user("q"), assistant("a", "r")]
    table, stats = tokenize_completions(completions([conv]), enc, TokenizeConfig(supervise="every_turn"))
    assert table.column("turn_index").to_pylist() == [1] and stats.dropped == {"no_user_turn": 1}


def test_samples_roundtrip_through_parquet_in_the_store(local_store, enc, sharegpt):
    table, _ = tokenize_completions(sharegpt.slice(0, 20), enc, TokenizeConfig(max_length=1024))
    local_store.write_parquet("tokenized_samples/shard-00000.parquet", table)
    back = local_store.read_parquet("tokenized_samples/shard-00000.parquet")
    assert back.schema.equals(SAMPLES_SCHEMA) and back.equals(table)
    assert schema_check(back, max_length=1024).passed


# -- checks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthy(enc):
    convs = [[user(f"question {i}"), assistant(f"A full answer number {i}, " * 4, f"Reasoning about {i}. " * 5)] for i in range(100)]
    return tokenize_completions(completions(convs), enc)[0]


@pytest.fixture(scope="module")
def stubby(enc):
    """The 87% failure: most responses are `<think>\\n\\n</think>\\n\\nOK.<|im_end|>`."""
    convs = [[user(f"question {i}"), assistant("OK.")] for i in range(87)]
    convs += [[user(f"question {i}"), assistant(f"A full answer number {i}, " * 4, "Some reasoning. " * 5)] for i in range(13)]
    return tokenize_completions(completions(convs), enc)[0]


def test_empty_response_check_passes_on_healthy_samples(healthy):
    outcome = empty_response_check(healthy)
    assert outcome.passed and outcome.metadata["ratio"] == 0.0 and outcome.metadata["examples"] == []
    assert sum(loss_token_histogram(healthy.column("num_loss_tokens").to_numpy()).values()) == 100


def test_empty_response_check_fails_on_the_87_percent_stub_case(stubby):
    outcome = empty_response_check(stubby, min_loss_tokens=16, max_empty_ratio=0.02)
    meta = outcome.metadata
    assert not outcome.passed
    assert meta["ratio"] == pytest.approx(0.87) and meta["count"] == 87 and meta["n"] == 100
    assert meta["threshold"] == 0.02 and 0.78 < meta["wilson_lower_95"] < 0.87  # the bound that decided
    assert "lower bound of the 95% Wilson score interval" in meta["rule"]
    assert meta["most_common_loss_tokens"] == 6 and meta["most_common_loss_tokens_share"] == pytest.approx(0.87)
    assert loss_token_histogram(stubby.column("num_loss_tokens").to_numpy())["1-7"] == 87
    assert meta["examples"] == [f"p{i}" for i in range(10)]
    assert outcome.description.startswith("87/100 samples (87.00%) have < 16 supervised tokens or an empty answer")
    assert "over the 2.00% threshold with 95% confidence (lower bound" in outcome.description


def test_empty_answer_counts_as_empty_even_with_long_reasoning(enc, healthy):
    convs = [[user("q"), assistant("", "A long chain of thought. " * 20)]]
    empty_answer, _ = tokenize_completions(completions(convs, ["empty-answer"]), enc)
    (row,) = empty_answer.to_pylist()
    assert row["answer_empty"] and row["num_loss_tokens"] > 16
    mixed = pa.concat_tables([healthy, empty_answer])
    outcome = empty_response_check(mixed, max_empty_ratio=0.0)
    assert not outcome.passed and outcome.metadata["examples"] == ["empty-answer"]
    assert outcome.metadata["num_answer_empty"] == 1 and outcome.metadata["num_short"] == 0
    # 1 of 101 is 0.99%: its 95% lower bound (0.17%) is under 1%, so the data do not show the share is over it
    assert empty_response_check(mixed, max_empty_ratio=0.01).passed


def test_empty_response_check_fails_on_an_empty_table(healthy):
    outcome = empty_response_check(healthy.slice(0, 0))
    assert not outcome.passed and outcome.metadata["n"] == 0 and "ratio" not in outcome.metadata
    assert outcome.description.startswith("no samples to check")


def test_thinking_ratio_check(healthy, stubby):
    assert thinking_ratio_check(healthy, floor=0.9).passed
    failing = thinking_ratio_check(stubby, floor=0.9)
    assert not failing.passed and failing.metadata["ratio"] == pytest.approx(0.13)
    assert failing.metadata["wilson_upper_95"] < 0.9 and failing.metadata["threshold"] == 0.9
    assert "under the 90.00% floor with 95% confidence" in failing.description
    assert len(failing.metadata["examples_without_reasoning"]) == 10
    assert thinking_ratio_check(stubby, floor=0.9, thinking_requested=False).passed


def test_truncation_ratio_check(enc):
    convs = [[user(f"q{i}"), assistant("word " * (10 if i % 4 else 200), "r")] for i in range(40)]
    table, _ = tokenize_completions(completions(convs), enc, TokenizeConfig(max_length=64))
    ok = truncation_ratio_check(table, ceiling=0.3)
    assert ok.passed and ok.metadata["ratio"] == pytest.approx(0.25) and ok.metadata["max_num_tokens"] == 64
    bad = truncation_ratio_check(table, ceiling=0.05)
    assert not bad.passed and bad.metadata["examples"][:2] == ["p0", "p4"]


def test_schema_check_passes_and_catches_each_violation(healthy):
    assert schema_check(healthy, max_length=3072).passed
    wrong_type = healthy.set_column(4, "num_tokens", pc.cast(healthy.column("num_tokens"), pa.int64()))
    assert "num_tokens is int64" in schema_check(wrong_type).description
    missing = healthy.drop_columns(["truncated"])
    assert not schema_check(missing).passed
    off_by_one = healthy.set_column(5, "num_loss_tokens", pc.cast(pc.add(healthy.column("num_loss_tokens"), 1), pa.int32()))
    assert "loss_mask sums differ" in schema_check(off_by_one).description
    duplicated = pa.concat_tables([healthy.slice(0, 2), healthy.slice(0, 1)])
    assert "not unique" in schema_check(duplicated).description
    assert "longer than max_length" in schema_check(healthy, max_length=10).description


def test_schema_check_on_sliced_and_null_tables(healthy):
    assert schema_check(healthy.slice(37, 20)).passed  # sliced list offsets do not start at 0
    with_null = healthy.set_column(4, "num_tokens", pa.array([None] + healthy.column("num_tokens").to_pylist()[1:], pa.int32()))
    assert "null values" in schema_check(with_null).description


# -- agentic conversations: every step after the last user query ------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


def tool_call(name, arguments_json, call_id="c1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_json}}


def step(answer, reasoning, *calls):
    return {"role": "assistant", "content": answer, "reasoning_content": reasoning,
            "tool_calls": list(calls) or None, "tool_call_id": None, "name": None}


def tool_result(text):
    return {"role": "tool", "content": text, "reasoning_content": None, "tool_calls": None, "tool_call_id": "c1",
            "name": "get_weather"}


def agentic_table(conversations, tools=None) -> pa.Table:
    def plain(m):
        return {"tool_calls": None, "tool_call_id": None, "name": None, "reasoning_content": None, **m}

    columns = {"prompt_id": pa.array([f"a{i}" for i in range(len(conversations))], pa.string()),
               "messages": pa.array([[plain(m) for m in c] for c in conversations], AGENTIC_MESSAGES_TYPE)}
    if tools is not None:
        columns["tools"] = pa.array(tools, pa.string())
    return pa.table(columns)


def spans_text(enc, row) -> list[str]:
    """The decoded text of each contiguous supervised span, in order."""
    ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [enc.decode(ids[a:b]) for a, b in zip(edges[0::2], edges[1::2])]


AGENT_CONV = [
    SYSTEM, user("Weather in Paris, then Rome?"),
    step("", "Paris first.", tool_call("get_weather", '{"city": "Paris"}')),
    tool_result("18C"),
    step("Now Rome.", "Then Rome.", tool_call("get_weather", '{"city": "Rome"}')),
    tool_result("21C"),
    step("Paris 18C, Rome 21C.", "Both known."),
]
CALL_PARIS = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
CALL_ROME = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"


def test_agentic_masks_cover_every_step_after_the_last_user_query(tok, enc):
    """SpecForge's qwen3.5 convention: each step's reasoning, text and tool calls through <|im_end|>\\n are
    supervised; the tool list, the system and user turns and the tool results are context."""
    table, stats = tokenize_completions(agentic_table([AGENT_CONV], [json.dumps([WEATHER_TOOL])]), enc)
    assert stats.samples == 1 and stats.dropped == {} and stats.agentic_samples == 1
    (row,) = table.to_pylist()
    assert spans_text(enc, row) == [
        "Paris first.\n</think>\n\n" + CALL_PARIS + "<|im_end|>\n",
        "Then Rome.\n</think>\n\nNow Rome.\n\n" + CALL_ROME + "<|im_end|>\n",
        "Both known.\n</think>\n\nParis 18C, Rome 21C.<|im_end|>\n",
    ]
    context = unsupervised_text(enc, row)
    assert "<tools>" in context and "<tool_response>\n18C\n</tool_response>" in context
    assert "<tool_response>\n21C\n</tool_response>" in context
    parsed = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]] if m.get("tool_calls") else None} for m in AGENT_CONV]
    rendered = tok.apply_chat_template(parsed, tools=[WEATHER_TOOL], tokenize=False)
    assert row["input_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert row["has_reasoning"] and not row["answer_empty"]
    assert row["turn_index"] == 2  # the conversation's third assistant message ends the supervised turn

    # the previous rule (last assistant message only) supervised a third as many steps here
    last_only = tokenize_completions(completions([[SYSTEM, user("Weather in Paris, then Rome?"),
                                                   assistant("Paris 18C, Rome 21C.", "Both known.")]]), enc)[0]
    assert row["num_loss_tokens"] > 2.5 * last_only.column("num_loss_tokens")[0].as_py()


def test_agentic_turns_are_the_steps_between_user_queries(enc):
    conv = [user("q1"), step("", "r1", tool_call("get_weather", '{"city": "A"}')), tool_result("1"),
            step("a1", "s1"), user("q2"), step("", "r2", tool_call("get_weather", '{"city": "B"}')), tool_result("2"),
            step("a2", "s2"), user("trailing")]
    last, _ = tokenize_completions(agentic_table([conv]), enc)
    every, stats = tokenize_completions(agentic_table([conv]), enc, TokenizeConfig(supervise="every_turn"))
    (row,) = last.to_pylist()
    assert [s.split("\n</think>")[0] for s in spans_text(enc, row)] == ["r2", "s2"]  # the steps after q2 only
    assert "trailing" not in enc.decode(row["input_ids"])
    rows = every.to_pylist()
    assert [r["turn_index"] for r in rows] == [1, 3] and stats.samples == 2
    assert [s.split("\n</think>")[0] for s in spans_text(enc, rows[0])] == ["r1", "s1"]
    assert rows[1]["input_ids"] == row["input_ids"] and rows[1]["loss_mask"] == row["loss_mask"]


def test_tool_call_only_steps_are_not_empty_responses(enc):
    """A conversation that ends at a tool call (completions stop where a regenerated call differs from the
    source's) supervises that call: empty_response_ratio counts it as a response."""
    calls_only = [user("Weather?"), step("", "", tool_call("get_weather", '{"city": "Paris"}'))]
    two_calls = [user("Weather?"), step("", "Check.", tool_call("get_weather", '{"city": "Paris"}')),
                 tool_result("18C"), step(" ", "", tool_call("get_weather", '{"city": "Rome, Italy"}'))]
    table, _ = tokenize_completions(agentic_table([calls_only, two_calls]), enc)
    rows = table.to_pylist()
    assert [r["answer_empty"] for r in rows] == [False, False]
    assert [r["has_reasoning"] for r in rows] == [False, True]
    assert all(r["num_loss_tokens"] >= 16 for r in rows)
    outcome = empty_response_check(table)
    assert outcome.passed and outcome.metadata["count"] == 0
    # without a call the same empty step is an empty response
    empty, _ = tokenize_completions(agentic_table([[user("Weather?"), step("", "")]]), enc)
    assert empty.column("answer_empty").to_pylist() == [True]


def test_malformed_agentic_rows_are_dropped_with_a_reason(enc):
    good = [user("Weather?"), step("", "r", tool_call("get_weather", '{"city": "Paris"}')), tool_result("18C"),
            step("Sunny.", "ok")]
    bad_args = [user("Weather?"), step("", "r", tool_call("get_weather", '{"city": Paris}'))]
    list_args = [user("Weather?"), step("", "r", tool_call("get_weather", '["Paris"]'))]
    no_name = [user("Weather?"), step("", "r", tool_call("", "{}"))]
    late_system = [user("Weather?"), SYSTEM, step("Sunny.", "ok")]
    conversations = [good, bad_args, list_args, no_name, late_system, good]
    tools = [json.dumps([WEATHER_TOOL]), None, None, None, None, "{not json"]
    table, stats = tokenize_completions(agentic_table(conversations, tools), enc)
    assert table.column("prompt_id").to_pylist() == ["a0"]
    assert stats.dropped == {"bad_tool_call": 3, "template_error": 1, "bad_tools": 1}
    meta = stats.to_metadata()
    assert meta["dropped_bad_tool_call"] == 3 and meta["dropped"] == 5
