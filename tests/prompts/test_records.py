"""One record's fields and turns as both normalizers read them: content text from a string or OpenAI text parts,
the one turn parser (roles from the role table, the first malformed turn a rejection), record ids as text, a
prompt's content-hash id and the record's provenance."""

from __future__ import annotations

from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.records import (ROLE_MAP, Rejection, content_text, parse_turns, prompt_id,
                                           record_id_text, record_provenance)


def test_content_text_reads_strings_and_openai_text_parts_only():
    assert content_text("hi") == "hi"
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    assert content_text([{"type": "image_url", "image_url": {}}]) is None and content_text(3) is None


def test_the_turn_parser_maps_roles_and_stops_at_the_first_malformed_turn():
    unknown: set[str] = set()
    turns = [{"from": "human", "value": "q"}, {"role": "assistant", "content": "a"}]
    parsed = list(parse_turns(turns, ROLE_MAP, "conversations", unknown))
    assert [(kind, content) for _, _, kind, _, content in parsed] == [("user", "q"), ("assistant", "a")]
    bad = list(parse_turns([{"from": "human", "value": "q"}, {"from": "human", "role": "gpt", "value": "x"}],
                           ROLE_MAP, "conversations", set()))
    assert isinstance(bad[-1], Rejection)


def test_ids_and_provenance():
    assert record_id_text(7) == "7" and record_id_text("") is None and record_id_text(True) is None
    assert prompt_id(None, ["a"]) == prompt_id("", ["a"]) != prompt_id(None, ["a", ""])
    assert len(prompt_id("s", ["u"])) == 20
    config = IngestConfig()
    assert record_provenance({"id": 3}, config, 9) == {"source_id": "3", "category": "unknown"}
    assert record_provenance({}, config, 9)["source_id"] == "#9"
