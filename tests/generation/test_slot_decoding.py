"""Slot decoding: the same greedy tokens as an unpadded `generate` of each prompt alone, with more requests than
slots (refill), mixed lengths, stop ids and one-token answers; sampling settings per row; what it refuses."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_assets.generation.slot_decoding import (SlotDecoder, SlotRequest, kv_bytes_per_position, slots_for_memory,
                                                    unsupported_reason)

STOP = (7, 11)


def _model(kind: str):
    torch.manual_seed(0)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    config = config_cls(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    return model_cls(config).eval()


def _prompts(n: int, seed: int = 1):
    rng = random.Random(seed)
    return [([rng.randrange(1, 300) for _ in range(rng.randrange(2, 40))], rng.randrange(1, 30)) for _ in range(n)]


def _alone(model, ids: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=list(STOP),
                         pad_token_id=0)[0, len(ids):].tolist()
    ends = [i for i, t in enumerate(out) if t in STOP]
    return out[:ends[0] + 1] if ends else out


def _decode(decoder: SlotDecoder, prompts, **sampling) -> dict[int, tuple[list[int], str]]:
    got: dict[int, tuple[list[int], str]] = {}
    for i, (ids, max_new) in enumerate(prompts):
        decoder.submit(SlotRequest(ids, max_new, STOP, tag=i, deliver=lambda r, new, fin: got.__setitem__(
            r.tag, (new, fin)), **sampling))
    decoder.run()
    return got


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_tokens_match_generate_of_each_prompt_alone(kind):
    model = _model(kind)
    prompts = _prompts(23)
    decoder = SlotDecoder(model, slots=4, slot_len=80, prefill_tokens=64, admit_every=3)
    got = _decode(decoder, prompts)
    assert sorted(got) == list(range(len(prompts)))  # every request answered once
    for i, (ids, max_new) in enumerate(prompts):
        want = _alone(model, ids, max_new)
        assert got[i][0] == want, i
        assert got[i][1] == ("stop" if want[-1] in STOP else "length")
    stats = decoder.stats.as_dict(4)
    assert stats["requests"] == 23 and stats["new_tokens"] == sum(len(v[0]) for v in got.values())
    assert stats["prefills"] > 1  # rows were refilled while others decoded
    assert 0 < stats["prefill_host_seconds"] <= stats["prefill_seconds"]  # the queuing part of the prefills
    assert stats["occupancy"] > 0.6
    assert decoder.idle() and decoder.live_rows == 0


def test_requests_that_trickle_in_are_admitted_in_groups():
    """One request arriving per step (as a stage hands them over while it renders the rest) waits for a group
    that fills a quarter of the slots, or for `admit_every` steps, rather than costing a prefill each; the tokens
    stay generate's."""
    model = _model("llama")
    prompts = [(ids, max(new, 12)) for ids, new in _prompts(24, seed=3)]
    decoder = SlotDecoder(model, slots=16, slot_len=80, prefill_tokens=1024, admit_every=6)
    got: dict[int, list[int]] = {}
    prefills_at_submit = []
    for i, (ids, max_new) in enumerate(prompts):
        decoder.submit(SlotRequest(ids, max_new, STOP, tag=i, deliver=lambda r, new, fin: got.__setitem__(r.tag, new)))
        decoder.step()
        prefills_at_submit.append(decoder.stats.prefills)
    decoder.run()
    assert got == {i: _alone(model, ids, max_new) for i, (ids, max_new) in enumerate(prompts)}
    # the first request alone (no row live), then groups of four (a quarter of 16) or six steps' worth
    assert prefills_at_submit[:6] == [1, 1, 1, 1, 2, 2]
    assert decoder.stats.prefills <= 1 + len(prompts) // 4 + 1
    assert decoder.idle()


def test_steps_attend_over_the_view_that_holds_every_live_row():
    """A row that crosses 256 positions moves the step to the 512-position view mid-answer; the tokens stay
    generate's."""
    model = _model("llama")
    rng = random.Random(5)
    prompts = [([rng.randrange(1, 300) for _ in range(250)], 20), ([5, 6, 8], 12)]
    decoder = SlotDecoder(model, slots=2, slot_len=600)
    views = []
    step = decoder._forward_step
    decoder._forward_step = lambda: (views.append(decoder.cache.view), step())[1]
    got = _decode(decoder, prompts)
    assert got[0][0] == _alone(model, *prompts[0]) and got[1][0] == _alone(model, *prompts[1])
    assert len(got[0][0]) == 20  # no stop id: the row reaches position 269
    assert views[0] == 256 and views[-1] == 512 and sorted(set(views)) == [256, 512]


def test_steps_compute_the_rows_view_that_holds_every_live_row():
    """Requests take the lowest free slots, and a step computes only the eighth, quarter, half or all of the slots
    that hold every live row: three requests in 16 slots step over 4 rows, then fewer as rows end; the tokens stay
    generate's."""
    model = _model("llama")
    prompts = [([3, 4, 5], 22), ([8, 9, 10, 12, 13], 14), ([20, 21, 22, 23, 24, 25, 26], 6)]  # the last slot ends first
    decoder = SlotDecoder(model, slots=16, slot_len=64)
    seen = []
    step = decoder._forward_step
    decoder._forward_step = lambda: (seen.append((decoder.cache.row_view, max(
        s for s, r in enumerate(decoder.live) if r is not None))), step())[1]
    got = _decode(decoder, prompts)
    assert [got[i][0] for i in range(3)] == [_alone(model, *p) for p in prompts]
    assert all(last < rows for rows, last in seen)  # every live row is computed
    assert seen[0] == (4, 2) and seen[-1][0] == 2 and {rows for rows, _ in seen} == {2, 4}  # never all 16 slots
    stats = decoder.stats.as_dict(16)
    assert stats["occupancy"] <= stats["computed_rows"] < 0.25


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_rows_of_their_own_length_give_the_same_tokens(kind, monkeypatch):
    """`row_lengths`: each row attends through a flex block mask of its own length (key blocks past its position
    skipped); with refills, stops and rows crossing a key block, the tokens stay generate's."""
    from dflash_assets.generation import packed_gqa

    model = _model(kind)
    model.set_attn_implementation(packed_gqa.register())
    calls = []
    flex = packed_gqa._flex
    monkeypatch.setattr(packed_gqa, "_flex", lambda *a: (calls.append(a[3].kv_num_blocks.flatten().tolist()),
                                                         flex(*a))[1])
    rng = random.Random(2)
    prompts = _prompts(9) + [([rng.randrange(1, 300) for _ in range(120)], 20)]  # crosses position 128
    decoder = SlotDecoder(model, slots=4, slot_len=256, prefill_tokens=64, admit_every=3, row_lengths=True)
    got = _decode(decoder, prompts)
    assert [got[i][0] for i in range(len(prompts))] == [_alone(model, *p) for p in prompts]
    assert calls and max(max(c) for c in calls) == 2 and min(min(c) for c in calls) == 1  # blocks follow each row
    assert {decoder.cache.view} == {256}  # the whole slot: the mask, not a view, bounds what a row reads


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_packed_prefills_give_the_same_tokens(kind):
    """With packed_gqa's attention a prefill runs the admitted prompts one after another in one row (each
    attending inside its own, no padding) and writes each token's keys at its slot and position; the tokens stay
    generate's, through refills and stops."""
    from dflash_assets.generation import packed_gqa

    model = _model(kind)
    model.set_attn_implementation(packed_gqa.register())
    prompts = _prompts(17, seed=6)
    decoder = SlotDecoder(model, slots=4, slot_len=128, prefill_tokens=64, admit_every=3)
    widths = []
    base = decoder.base.forward
    decoder.base.forward = lambda **kw: (widths.append(tuple(kw["input_ids"].shape)), base(**kw))[1]
    got = _decode(decoder, prompts)
    decoder.base.forward = base
    assert decoder.packed_prefill  # no fallback to padded rows
    prefills = [w for w in widths if w[1] > 1]
    assert prefills and all(rows == 1 for rows, _ in prefills)  # one packed row each
    assert sum(n for _, n in prefills) == sum(len(ids) for ids, _ in prompts)  # every prompt token, once
    assert [got[i][0] for i in range(len(prompts))] == [_alone(model, *p) for p in prompts]


def test_a_row_lengths_capture_that_fails_falls_back_to_positions_views(monkeypatch, caplog):
    """Should flex attention fail to compile or capture under a CUDA graph, the decoder says why and captures the
    positions views instead (every rows view of each), rather than failing its requests."""
    from dflash_assets.generation import packed_gqa

    model = _model("llama")
    model.set_attn_implementation(packed_gqa.register())
    decoder = SlotDecoder(model, slots=8, slot_len=512, row_lengths=True, cuda_graph=True)
    captured, inference = [], []

    def capture():
        inference.append(torch.is_inference_mode_enabled())
        if decoder.row_lengths:
            raise RuntimeError("flex attention under capture\n  the compiler's long explanation")
        captured.append((decoder.cache.row_view, decoder.cache.view))
        decoder.graphs[captured[-1]] = (None, None)

    monkeypatch.setattr(decoder, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # no CUDA device here
    with caplog.at_level("WARNING"):
        decoder.capture_views()
    assert not decoder.row_lengths and "failed to capture (RuntimeError: flex attention under capture)" in caplog.text
    assert "long explanation" not in caplog.text  # the first line of the error, not the compiler's whole dump
    assert sorted(captured) == [(r, v) for r in (1, 2, 4, 8) for v in (256, 512)]
    # every capture runs as the steps do, in inference mode: with autograd on, compiling flex attention plans a
    # backward, which the forward-only block mask of rows of their own length cannot have
    assert inference and all(inference)


def test_row_lengths_need_the_packed_attention():
    with pytest.raises(ValueError, match="row_lengths needs a flex-attention block mask: the model's attention"):
        SlotDecoder(_model("llama"), slots=2, slot_len=256, row_lengths=True)
    model = _model("llama")
    from dflash_assets.generation import packed_gqa

    model.set_attn_implementation(packed_gqa.register())
    with pytest.raises(ValueError, match="not a multiple of 128"):
        SlotDecoder(model, slots=2, slot_len=200, row_lengths=True)
    assert not SlotDecoder(model, slots=2, slot_len=256).row_lengths  # positions views unless asked
    assert SlotDecoder(model, slots=2, slot_len=256).packed_prefill
    assert not SlotDecoder(model, slots=2, slot_len=256, packed_prefill=False).packed_prefill
    with pytest.raises(ValueError, match="packed prefills need the model's attention to be 'packed_gqa_sdpa'"):
        SlotDecoder(_model("llama"), slots=2, slot_len=256, packed_prefill=True)


def test_a_row_ends_at_the_slot_end_as_length():
    model = _model("llama")
    decoder = SlotDecoder(model, slots=2, slot_len=12)
    ids = [5, 6, 8, 9, 10]
    got = _decode(decoder, [(ids, 50)])
    new, finish = got[0]
    if not any(t in STOP for t in new):
        assert finish == "length" and len(ids) + len(new) == 12
    assert new == _alone(model, ids, 12 - len(ids))


def test_sampling_settings_apply_per_row():
    model = _model("qwen3")
    prompts = _prompts(6, seed=3)
    greedy = _decode(SlotDecoder(model, slots=8, slot_len=80), prompts)
    torch.manual_seed(0)
    # top_k=1 (and a top_p so small that only the first token survives) are greedy whatever the temperature
    assert _decode(SlotDecoder(model, slots=8, slot_len=80), prompts, temperature=1.5, top_k=1) == greedy
    assert _decode(SlotDecoder(model, slots=8, slot_len=80), prompts, temperature=1.5, top_p=1e-6) == greedy
    drawn = _decode(SlotDecoder(model, slots=8, slot_len=80), prompts, temperature=5.0)
    assert drawn != greedy  # a random model at T 5 draws other tokens
    assert all(0 <= t < 300 for new, _ in drawn.values() for t in new)


def test_refuses_what_it_cannot_decode():
    model = _model("llama")
    decoder = SlotDecoder(model, slots=2, slot_len=16)
    with pytest.raises(ValueError, match="does not fit a slot of 16"):
        decoder.submit(SlotRequest(list(range(1, 17)), 4))
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.submit(SlotRequest([], 4))
    hybrid = Qwen3Config(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    assert "layer types" in unsupported_reason(hybrid)
    windowed = LlamaConfig(num_hidden_layers=2)
    windowed.sliding_window = 64
    assert "sliding window" in unsupported_reason(windowed)
    assert unsupported_reason(model.config) is None


def test_slots_for_memory_fits_the_share_asked():
    model = _model("llama")
    per_position = kv_bytes_per_position(model)
    assert per_position == 2 * 3 * 2 * 16 * 4  # keys and values, 3 layers, 2 KV heads, 16 dims, float32
    slots = slots_for_memory(per_position, 1000, 100 * per_position * 1000, share=0.5)
    assert slots == 32  # 50 slots fit: the largest power of two below
    assert slots_for_memory(per_position, 1000, 0) == 8  # never below the floor


# -- through the in-process engine: the real tiny target, its tokenizer and chat template --------------------


def test_engine_with_slots_answers_as_the_dynamic_cache(tiny_dense_target):
    """TransformersEngine(cache="slots") gives each chat the dynamic cache's greedy answer and finish reason, with
    more requests in flight than slots and per-request max_new_tokens; a request too long for a slot runs on the
    dynamic cache; min_p is refused, not dropped."""
    import asyncio

    from transformers import AutoTokenizer

    from dflash_assets.generation.config import GenerationConfig
    from dflash_assets.generation.engines import EngineError, TransformersEngine

    tok = AutoTokenizer.from_pretrained(tiny_dense_target)
    questions = ["What is 2+2?", "Name a colour.", "Write a long sentence about the sea.", "Hi", "Why?",
                 "List three fruits.", "Count to five.", "Say nothing."]
    gens = [GenerationConfig(max_new_tokens=n, temperature=0.0, enable_thinking=False) for n in (12, 3, 20, 5) * 2]

    async def go(cache, chats, gens, **kwargs):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=8, max_batch_rows=3,
                                      cache=cache, **kwargs) as eng:
            out = await asyncio.gather(*(eng.chat([{"role": "user", "content": q}], g) for q, g in zip(chats, gens)))
            return [(r.content, r.reasoning_content, r.completion_tokens, r.finish_reason) for r in out], eng

    slots, eng = asyncio.run(go("slots", questions, gens, slot_len=256))
    dynamic, _ = asyncio.run(go("dynamic", questions, gens))
    assert slots == dynamic
    stats = eng.slot_stats()
    assert stats["requests"] == 8 and stats["new_tokens"] == sum(r[2] for r in slots) and stats["prefills"] >= 3
    assert eng.batch_shapes == []  # nothing went through the batched generate

    long_question = ["word " * 200]  # prompt + new tokens over the slot: a long slot, or with none the dynamic cache
    long_dynamic = asyncio.run(go("dynamic", long_question, gens[:1]))[0]
    long_slots, eng = asyncio.run(go("slots", long_question, gens[:1], slot_len=128))
    assert long_slots == long_dynamic
    assert eng.batch_shapes == [] and [d["requests"] for d in eng.slot_stats()["decoders"]] == [0, 1]
    assert eng.slot_stats()["decoders"][1]["cuda_graph"] is False
    long_slots, eng = asyncio.run(go("slots", long_question, gens[:1], slot_len=128, slot_tiers=[(2, 4096), (2, 320)]))
    assert long_slots == long_dynamic  # the middle tier: the shortest slots that hold it
    assert [d["requests"] for d in eng.slot_stats()["decoders"]] == [0, 1, 0]
    long_slots, eng = asyncio.run(go("slots", long_question, gens[:1], slot_len=128, slot_tiers=[]))
    assert long_slots == long_dynamic
    assert len(eng.batch_shapes) == 1 and eng.slot_stats() is None
    # the main and the long slots stepped in turn (overlapped by default): the same answers as the dynamic cache's
    both, eng = asyncio.run(go("slots", [*questions[:3], *long_question], [*gens[:3], gens[0]], slot_len=128,
                               slot_overlap=False))
    assert both == [*slots[:3], *long_dynamic] and not eng.slot_overlap
    assert [d["requests"] for d in eng.slot_stats()["decoders"]] == [3, 1]

    with pytest.raises(EngineError, match="not min_p"):
        asyncio.run(go("slots", questions[:1], [GenerationConfig(max_new_tokens=4, temperature=0.7, min_p=0.1)]))
