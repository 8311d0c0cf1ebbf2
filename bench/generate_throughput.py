"""Where the in-process engine's generation time goes on a GPU (issue 21: 2K tok/s is what bounds the data).

`TransformersEngine._generate` is one left-padded `model.generate` per batch. This measures that call alone
for a model of SmolLM2-135M's shape (LlamaForCausalLM: hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536,
vocab 49,152; weights random: throughput does not depend on their values, and no checkpoint needs carrying),
every row forced to the full `--new-tokens` (`min_new_tokens`), greedy, CUDA synchronized:

- `generate`: batch x dtype, the dynamic cache (what the engine runs today);
- `static`: the same with `cache_implementation="static"` (transformers compiles the decode step);
- `loop`: a hand loop of `model(...)` + argmax over the same dynamic cache, to separate `generate`'s own
  per-step work from the model's;
- `profile`: torch.profiler over a few decode steps of the engine's configuration: GPU-busy share and the
  top operators, to say whether the step is bound by the GPU or by the host.

Prints one JSON object (also to `--out`). Runs within `--deadline-s`: cases that would start after it are
skipped and listed.

    python3 bench/generate_throughput.py --out $OUT/throughput.json      # on the GPU machine (device tool)
"""

from __future__ import annotations

import argparse
import json
import os
import time


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


def run_generate(model, batch, prompt_len, new_tokens, cache=None):
    import torch

    x = torch.randint(3, 49152, (batch, prompt_len), device=model.device)
    mask = torch.ones_like(x)
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


def profile_steps(model, batch, prompt_len, steps=8):
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randint(3, 49152, (batch, prompt_len), device=model.device)
    kwargs = dict(do_sample=False, pad_token_id=2, eos_token_id=2, temperature=None, top_p=None, top_k=None)
    with torch.inference_mode():
        model.generate(input_ids=x, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm
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
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "wall_s": round(wall, 3),
            "gpu_busy_s": round(gpu_us / 1e6, 3), "gpu_busy_share": round(gpu_us / 1e6 / wall, 3),
            "top_gpu_ops": [[e.key, round(e.self_device_time_total / 1e3, 1), e.count] for e in top],
            "top_cpu_ops": [[e.key, round(e.self_cpu_time_total / 1e3, 1), e.count] for e in top_cpu]}


def main() -> int:
    import torch
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--deadline-s", type=float, default=240.0)
    p.add_argument("--out")
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

    for dtype_name in ("float32", "bfloat16"):
        model = smollm2_shaped(getattr(torch, dtype_name), device)
        run_generate(model, 8, 32, 4)  # warm
        for batch in args.batches:
            case("generate", lambda: run_generate(model, batch, args.prompt_len, args.new_tokens),
                 dtype=dtype_name, batch=batch)
        if dtype_name == "bfloat16":
            case("loop", lambda: run_loop(model, 256, args.prompt_len, args.new_tokens), dtype=dtype_name,
                 batch=256)
            if time.perf_counter() - t0 < args.deadline_s:
                report["profile"] = profile_steps(model, 256, args.prompt_len)
                print(json.dumps(report["profile"]), flush=True)
            for batch in (256, 1024):
                case("static", lambda: run_generate(model, batch, args.prompt_len, args.new_tokens, "static"),
                     dtype=dtype_name, batch=batch, note="first call includes compilation")
                case("static-again", lambda: run_generate(model, batch, args.prompt_len, args.new_tokens,
                                                          "static"), dtype=dtype_name, batch=batch)
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
