"""Where the in-process engine's generation time goes on a GPU: the step cost of each cache mode.

`TransformersEngine._generate` is one left-padded `model.generate` per batch. This measures that call alone
for a model of SmolLM2-135M's shape (LlamaForCausalLM: hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536,
vocab 49,152; weights random: throughput does not depend on their values, and no checkpoint is needed),
every row forced to the full `--new-tokens` (`min_new_tokens`), greedy, CUDA synchronized:

- `generate`: batch x dtype, the dynamic cache (the engine's `cache="dynamic"`);
- `static`: the same with `cache_implementation="static"` (transformers compiles the decode step);
- `loop`: a hand loop of `model(...)` + argmax over the same dynamic cache, to separate `generate`'s own
  per-step work from the model's;
- `profile`: torch.profiler over a few decode steps of the engine's configuration: GPU-busy share and the
  top operators, to say whether the step is bound by the GPU or by the host;
- `static-packed`: the static cases again with `generation.packed_gqa`'s attention (`TransformersEngine(
  attention="packed_gqa")`), whose compiled decode step reads the KV cache once per KV head instead of copying
  it to every query head; `static-padded` / `static-packed-padded`: both with a quarter of the rows left-padded
  by a quarter of the prompt (the completions stage's batches are padded), and `profile-static*`: a profile of
  8 compiled decode steps each way at the last `--static-batches` (1,024);
- `--after-wide WIDTH`: `static-after-wide` / `static-packed-after-wide` (and `-again`): the last static case
  after one call of WIDTH prompt tokens, whose cache length transformers then keeps for every later call
  (`TransformersEngine(static_cache_len="largest")`, against `-again` above: the call's own length).

Prints one JSON object (also to `--out`). Runs within `--deadline-s`: cases that would start after it are
skipped and listed.

    python bench/generate_throughput.py --out throughput.json      # on a CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dflash_assets from the checkout (torch and
# transformers are all that generation.packed_gqa needs)

from bench.machine import print_report  # noqa: E402  (stdlib only)


def smollm2_shaped(dtype, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_generate(model, batch, prompt_len, new_tokens, cache=None, padded=False):
    import torch

    x = torch.randint(3, 49152, (batch, prompt_len), device=model.device)
    mask = torch.ones_like(x)
    if padded:  # a quarter of the rows left-padded by a quarter of the prompt, as the engine pads its batches
        mask[: batch // 4, : prompt_len // 4] = 0
        x[: batch // 4, : prompt_len // 4] = 2
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=2,
                  eos_token_id=2, temperature=None, top_p=None, top_k=None)
    if cache:
        kwargs["cache_implementation"] = cache
    with torch.inference_mode():
        sync()
        t = time.perf_counter()
        out = model.generate(input_ids=x, attention_mask=mask, **kwargs)
        sync()
    s = time.perf_counter() - t
    assert out.shape[1] == prompt_len + new_tokens
    return s


def run_loop(model, batch, prompt_len, new_tokens):
    import torch
    from transformers import DynamicCache

    x = torch.randint(3, 49152, (batch, prompt_len), device=model.device)
    with torch.inference_mode():
        sync()
        t = time.perf_counter()
        cache = DynamicCache()
        out = model(input_ids=x, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
    return time.perf_counter() - t


def profile_steps(model, batch, prompt_len, steps=8, cache=None):
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randint(3, 49152, (batch, prompt_len), device=model.device)
    kwargs = dict(do_sample=False, pad_token_id=2, eos_token_id=2, temperature=None, top_p=None, top_k=None)
    if cache:
        kwargs["cache_implementation"] = cache
    with torch.inference_mode():
        warm = steps if cache else 2  # a static cache's shape holds max_new_tokens: warm that very shape
        model.generate(input_ids=x, max_new_tokens=warm, min_new_tokens=warm, **kwargs)
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            model.generate(input_ids=x, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
            sync()
            wall = time.perf_counter() - t
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.self_device_time_total > 0)
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:10]
    top_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "cache": cache or "dynamic",
            "attention": model.config._attn_implementation, "wall_s": round(wall, 3),
            "gpu_busy_s": round(gpu_us / 1e6, 3), "gpu_busy_share": round(gpu_us / 1e6 / wall, 3),
            "top_gpu_ops": [[e.key, round(e.self_device_time_total / 1e3, 1), e.count] for e in top],
            "top_cpu_ops": [[e.key, round(e.self_cpu_time_total / 1e3, 1), e.count] for e in top_cpu]}


def main() -> int:
    import torch
    import transformers

    from dflash_assets.generation.packed_gqa import register as register_packed_gqa

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--static-batches", type=int, nargs="+", default=[256, 1024],
                   help="rows of the static cases (the last also padded and profiled)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   help="the loop, profile and static cases run in the last one")
    p.add_argument("--deadline-s", type=float, default=240.0)
    p.add_argument("--out")
    p.add_argument("--static-only", action="store_true", help="skip the hand loop and the dynamic-cache profile")
    p.add_argument("--after-wide", type=int, default=0, metavar="WIDTH",
                   help="also time the last static case after one WIDTH-token call (the cache then sized to it)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    report = {"bench": "HF generate throughput, SmolLM2-135M shape", "torch": torch.__version__,
              "transformers": transformers.__version__,
              "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "cases": [], "skipped": []}

    def case(name, fn, **info):
        if time.perf_counter() - t0 > args.deadline_s:
            report["skipped"].append({"case": name, **info})
            return
        try:
            s = fn()
            tokens = info["batch"] * args.new_tokens
            report["cases"].append({"case": name, **info, "s": round(s, 3), "tok_s": round(tokens / s, 1),
                                    "ms_per_step": round(1000 * s / args.new_tokens, 2)})
        except Exception as e:  # noqa: BLE001 - a case that fails is reported, the others still run
            report["cases"].append({"case": name, **info, "error": f"{type(e).__name__}: {e}"[:400]})
        print(json.dumps(report["cases"][-1]), flush=True)

    def static_cases(model, dtype_name, name):
        for batch in args.static_batches:
            case(name, lambda: run_generate(model, batch, args.prompt_len, args.new_tokens, "static"),
                 dtype=dtype_name, batch=batch, note="first call includes compilation")
            case(f"{name}-again", lambda: run_generate(model, batch, args.prompt_len, args.new_tokens, "static"),
                 dtype=dtype_name, batch=batch)
        rows = args.static_batches[-1]
        case(f"{name}-padded", lambda: run_generate(model, rows, args.prompt_len, args.new_tokens, "static",
                                                    padded=True), dtype=dtype_name, batch=rows)
        if args.after_wide and time.perf_counter() - t0 < args.deadline_s:
            # transformers sizes every later static cache to the largest call so far: the same call after one
            # wide call attends over the wide call's length (the engine's static_cache_len="largest"); the
            # `-again` case above is the call at its own length ("per_call")
            run_generate(model, 8, args.after_wide, args.new_tokens, "static")
            for label in ("after-wide", "after-wide-again"):
                case(f"{name}-{label}", lambda: run_generate(model, rows, args.prompt_len, args.new_tokens, "static"),
                     dtype=dtype_name, batch=rows, cache_len=getattr(model, "_previous_max_cache_length", None))
            model._previous_max_cache_length = -1  # back to the call's own length for what follows
        if time.perf_counter() - t0 < args.deadline_s:
            report[f"profile-{name}"] = profile_steps(model, rows, args.prompt_len, cache="static")
            print(json.dumps(report[f"profile-{name}"]), flush=True)

    for dtype_name in args.dtypes:
        model = smollm2_shaped(getattr(torch, dtype_name), device)
        run_generate(model, 8, 32, 4)  # warm
        for batch in args.batches:
            case("generate", lambda: run_generate(model, batch, args.prompt_len, args.new_tokens),
                 dtype=dtype_name, batch=batch)
        if dtype_name == args.dtypes[-1]:  # loop, profile and the static cases: in the last dtype only
            if not args.static_only:  # the loop's prefill keeps every position's logits: 22 GB at 256 x 448
                case("loop", lambda: run_loop(model, 256, args.prompt_len, args.new_tokens), dtype=dtype_name,
                     batch=256)
            if time.perf_counter() - t0 < args.deadline_s and not args.static_only:
                report["profile"] = profile_steps(model, 256, args.prompt_len)
                print(json.dumps(report["profile"]), flush=True)
            static_cases(model, dtype_name, "static")
            model.set_attn_implementation(register_packed_gqa())
            static_cases(model, dtype_name, "static-packed")
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
