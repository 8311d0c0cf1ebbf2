"""What one evaluate_drafter prompt costs on SmolLM2-135M: target forwards, tokens, and host time per forward.

Issue 16 item 4 (the H200 evaluation that never finished). Reads the converted SmolLM2 (`make smollm2`);
writes nothing. Prints, for one ~630-token prompt and an untrained block-16 drafter: the target forwards and
tokens of speculative decoding, of the lossless check (`greedy_mismatch`, one teacher-forced forward) and of
the plain greedy loop it replaced (`greedy_generate`, one forward per token); then the host-only time of one
forward of SmolLM2's 30-layer graph with its widths shrunk to nothing (what bounds a small model on a GPU:
the same ~1,900 ops launched one by one).

    .venv/bin/python bench/smollm2_decode_cost.py [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from dflash_assets.drafter.decoding import (SpeculativeDecoder, _cache_kwarg, greedy_generate, greedy_mismatch,
                                                load_target)
    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_target_config
    from dflash_assets.embedded.smollm2 import smollm2_target_path
    from dflash_assets.target_model.conventions import dflash_target_layer_ids, mask_token_id_in_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    d = smollm2_target_path()
    tok = AutoTokenizer.from_pretrained(d)
    target = load_target(d, device="cpu", dtype=torch.float32)
    tcfg = load_target_config(d)
    dcfg = DrafterConfig.from_target_config(tcfg, num_layers=5, block_size=16, mask_token_id=mask_token_id_in_dir(d),
                                            target_layer_ids=dflash_target_layer_ids(tcfg["num_hidden_layers"]))
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg).float().eval()
    text = "Summarize: " + " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    ids = tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                      add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    calls: list[int] = []
    hook = target.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)

    def measure(name, fn):
        calls.clear()
        t = time.perf_counter()
        r = fn()
        print(f"{name}: {len(calls)} target forwards, {sum(calls)} tokens, {time.perf_counter() - t:.1f} s")
        return r

    print(f"prompt {len(ids)} tokens, {args.new_tokens} new tokens, untrained block-16 drafter, 1 CPU thread")
    so = measure("speculative decoding", lambda: SpeculativeDecoder(target, drafter).generate(ids, args.new_tokens, [2]))
    print(f"  {len(so.acceptance_lengths)} verifications, tau {so.tau:.3f}")
    first = measure("lossless check, teacher-forced (greedy_mismatch)",
                    lambda: greedy_mismatch(target, ids, so.output_ids, args.new_tokens, [2]))
    ref = measure("lossless check before: greedy_generate", lambda: greedy_generate(target, ids, args.new_tokens, [2]))
    print(f"  mismatch {first}; greedy reference equal: {ref == so.output_ids}")
    hook.remove()

    cfg = AutoConfig.from_pretrained(d)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = 16, 32, 2, 1
    cfg.head_dim, cfg.vocab_size = 8, 512
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        m(input_ids=torch.zeros(1, len(ids), dtype=torch.long), use_cache=True, **{_cache_kwarg(m): cache})
        for T in (1, 16):
            n, t = 50, time.perf_counter()
            for _ in range(n):
                L = cache.get_seq_length()
                m(input_ids=torch.zeros(1, T, dtype=torch.long), position_ids=torch.arange(L, L + T)[None],
                  use_cache=True, **{_cache_kwarg(m): cache})
                cache.crop(-T)
            print(f"host-only forward of the {cfg.num_hidden_layers}-layer graph, {T} token(s) on a "
                  f"{len(ids)}-token cache: {(time.perf_counter() - t) / n * 1000:.1f} ms")
        from torch.profiler import profile
        with profile() as prof:
            m(input_ids=torch.zeros(1, 16, dtype=torch.long), use_cache=True, **{_cache_kwarg(m): cache})
        top = [e for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
        print(f"top-level aten ops per forward: {len(top)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
