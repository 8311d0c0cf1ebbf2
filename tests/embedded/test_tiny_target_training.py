"""Teaching a tiny target the thinking chat format: training samples that follow the template, only the data's
embedding rows trained (threads restored), training rounds until the held-out format check passes, and a check
that an untrained model fails."""

from __future__ import annotations

import pytest
import torch

import dflash_assets.embedded.tiny_target_training as TR
import dflash_assets.embedded.tiny_targets as TT
from dflash_assets.target_model.tokenizer import QWEN3_6_MASK_TOKEN_ID, build_qwen3_6_tokenizer
from tests.embedded.test_tiny_targets import IM_END, THINK_END


def test_training_samples_follow_the_template():
    tok = build_qwen3_6_tokenizer()
    cfg = TR.ChatFormatTraining(max_samples=24, long_context_samples=2, long_context_tokens=(300, 400))
    samples, long_samples = TR.build_samples(tok, cfg)
    assert len(samples) == 24 and len(long_samples) == 2
    assert all(300 <= s.start <= 500 for s in long_samples)
    for s in samples + long_samples:
        text = tok.decode(s.ids)
        assert tok.decode(s.ids[: s.start]).endswith("<|im_start|>assistant\n<think>\n")
        assert text.endswith("<|im_end|>") and text.count("</think>") == 1 and text.count("<think>") == 1
        assert tok.decode(s.ids[s.start :]).startswith(cfg.reasoning_prefix)
        start, before_end, end, after_end, last = s.format_pos
        assert start == s.start and s.ids[end] == THINK_END and s.ids[last] == IM_END == s.ids[-1]
        assert tok.decode([s.ids[before_end]]) == "\n" and tok.decode([s.ids[after_end]]) == "\n\n"
        assert cfg.reasoning_tokens[0] <= end - s.start - 1 <= cfg.reasoning_tokens[1] + 4
        assert cfg.answer_tokens[0] - 4 <= last - end - 2 <= cfg.answer_tokens[1] + 2
        assert len(s.ids) - s.start >= 16
        head = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
        assert head.endswith("<think>\n")  # supervision starts where the generation prompt ends


def test_teach_chat_format_touches_only_data_rows_and_restores_threads():
    from transformers import AutoModelForCausalLM as Auto

    tok = build_qwen3_6_tokenizer()
    torch.manual_seed(0)
    model = Auto.from_config(TT._make_config("dense"), dtype=torch.float32)
    emb0 = model.get_input_embeddings().weight.detach().clone()
    head0 = model.get_output_embeddings().weight.detach().clone()
    threads = torch.get_num_threads()
    cfg = TR.ChatFormatTraining(max_samples=16, long_context_samples=1, long_context_tokens=(200, 300), steps=6,
                                long_context_every=3, noise_frac=0.2, warmup_steps=2)
    report = TR.teach_chat_format(model, tok, cfg)
    assert torch.get_num_threads() == threads
    assert report.num_samples == 16 and report.num_long_context_samples == 1 and report.initial_loss > 10
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    changed_in = (emb != emb0).any(-1).nonzero().squeeze(-1)
    changed_out = (head != head0).any(-1).nonzero().squeeze(-1)
    # Only rows of ids in the data move (a few whose samples no step of this short run drew stay put).
    assert 0.9 * report.num_input_ids <= len(changed_in) <= report.num_input_ids
    assert 0.9 * report.num_output_ids <= len(changed_out) <= report.num_output_ids
    assert THINK_END in changed_out and IM_END in changed_out and QWEN3_6_MASK_TOKEN_ID not in changed_in
    assert emb.data_ptr() != head.data_ptr() and not any(p.requires_grad for p in model.parameters())


def test_the_build_trains_on_until_the_format_check_passes(monkeypatch):
    """The loop of teach_until_well_formed: no extra round when the first check passes, one per failed check
    (next seed, extra_steps at extra_lr), and ChatFormatNotLearned once the rounds are spent."""
    runs = []

    def fake_teach(model, tok, cfg):
        runs.append((cfg.steps, cfg.lr, cfg.seed))
        return TR.ChatFormatReport(settings={}, num_samples=0, num_long_context_samples=0, num_input_ids=0,
                                   num_output_ids=0, supervised_tokens=0, initial_loss=9.0, final_loss=1.0 + len(runs),
                                   losses=[1.0])

    answers = iter([[False] * 30 + [True] * 10, [True] * 39 + [False], [True] * 40])
    monkeypatch.setattr(TR, "teach_chat_format", fake_teach)
    monkeypatch.setattr(TR, "format_check", lambda model, tok, prompts, n: next(answers))
    model = torch.nn.Linear(1, 1)
    cfg = TR.ChatFormatTraining()
    report = TR.teach_until_well_formed(model, None, cfg)
    assert runs == [(cfg.steps, cfg.lr, cfg.seed), (cfg.extra_steps, cfg.extra_lr, cfg.seed + 1)]
    assert [(c["round"], c["steps"], c["well_formed"]) for c in report.format_checks] == [(0, 240, 10), (1, 320, 39)]
    assert report.final_loss == 3.0 and len(report.losses) == 2  # the last round's loss, every round's curve
    runs.clear()
    monkeypatch.setattr(TR, "format_check", lambda model, tok, prompts, n: [False] * 40)
    with pytest.raises(TR.ChatFormatNotLearned, match=r"0 of 40 held-out prompts .* after 560 steps"):
        TR.teach_until_well_formed(model, None, cfg)
    assert len(runs) == 1 + cfg.extra_rounds


def test_format_check_reads_held_out_prompts_and_fails_a_random_model():
    """Its prompts are not the training's records; an untrained model answers none of them in format."""
    from transformers import AutoModelForCausalLM as Auto

    cfg = TR.ChatFormatTraining(check_prompts=4)
    prompts = TR.held_out_prompts(cfg)
    trained_on = {user for user, _ in TR._pairs(TR.sharegpt_head_records(cfg.num_records))}
    assert len(prompts) == 4 and all(0 < len(p[0]["content"]) <= 400 for p in prompts)
    assert not any(p[0]["content"] in trained_on for p in prompts)
    torch.manual_seed(0)
    model = Auto.from_config(TT._make_config("dense"), dtype=torch.float32)
    assert TR.format_check(model, build_qwen3_6_tokenizer(), prompts, 24) == [False] * 4
    assert next(model.parameters()).dtype == torch.float32  # checked on a bfloat16 copy
