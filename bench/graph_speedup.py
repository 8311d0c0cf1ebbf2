"""Benchmark: batch-1 speculative decoding as a server runs it (bfloat16, static caches, CUDA graphs on both sides).

Times the target alone (`GraphTargetDecoder`: one captured graph per token) against speculative decoding with a
DFlash drafter (`GraphSpeculativeDecoder`: a captured draft and a captured verification per round) on the same
prompts, alternating which goes first, warm-up untimed (`graph_decode_speed`), and counts the prompts where both
gave the same tokens. With `--with-eager` the same run also times the eager float32 path the evaluation reports
(`decode_speed`: DynamicCache, Python per operator) on a float32 copy of the same models: the peer.

The target is a model directory (`--target`) or, for a smoke run, random weights of a known shape (`--dims
smollm2-135m`, Llama-shaped like SmolLM2-135M); the drafter a checkpoint directory (`--drafter`, as `load_drafter`
reads it) or random (`--random-drafter`, 5 layers). `--always-accept` zeroes the final norm of the random target
and the random drafter: both then pick token 0 everywhere, every draft token is accepted, and the figures are the
ceiling at tau = block size. Prompts are the rendered prompts of a tokenized_samples parquet (`--samples`, cut to
their last `--prompt-len` tokens) or random token ids of `--prompt-len`.

Reads the given directories and parquet; prints one JSON object (with --out, also writes it). Needs only torch,
transformers, safetensors and numpy (pyarrow only with --samples).

    python bench/graph_speedup.py --dims smollm2-135m --random-drafter --prompts 4 --max-new-tokens 128 --with-eager
    python bench/graph_speedup.py --target DIR --drafter DIR --samples tokenized.parquet --prompts 16
    python bench/graph_speedup.py --dims tiny --random-drafter --no-graphs --prompts 2 --max-new-tokens 16  # CPU
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from bench.machine import gpu_info, machine_info, print_report  # noqa: E402
from dflash_assets.drafter.decoding import EvalPrompt, decode_speed  # noqa: E402
from dflash_assets.drafter.graph_decoding import graph_decode_speed  # noqa: E402
from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_drafter  # noqa: E402

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49_152, rope_theta=100_000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=8192)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=1024, rope_theta=100_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=8192)
DIMS = {"smollm2-135m": SMOLLM2_135M, "tiny": TINY}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def build_target(args, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.target:
        from dflash_assets.target_model.loading import load_causal_lm

        return load_causal_lm(args.target, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    torch.manual_seed(args.seed)
    config = LlamaConfig(**DIMS[args.dims], attn_implementation="sdpa")
    target = LlamaForCausalLM(config).to(device, dtype).eval()
    if args.always_accept:
        torch.nn.init.zeros_(target.model.norm.weight)
    return target


def build_drafter(args, target) -> DFlashDrafter:
    if args.drafter:
        return load_drafter(args.drafter)
    config = target.config.to_dict()
    cfg = DrafterConfig.from_target_config(config, num_layers=args.drafter_layers, block_size=args.block_size,
                                           mask_token_id=config["vocab_size"] - 1)
    torch.manual_seed(args.seed + 1)
    drafter = DFlashDrafter(cfg)
    if args.always_accept:
        torch.nn.init.zeros_(drafter.norm.weight)
    return drafter


def read_prompts(args, vocab: int) -> list[EvalPrompt]:
    if args.samples:
        import pyarrow.parquet as pq

        table = pq.read_table(args.samples, columns=["input_ids", "loss_mask"]).slice(0, args.prompts).to_pylist()
        prompts = []
        for i, row in enumerate(table):
            mask = row["loss_mask"]
            end = mask.index(1) if 1 in mask else len(mask)  # the rendered prompt: up to the first trained token
            ids = row["input_ids"][:end][-args.prompt_len:]
            if ids:
                prompts.append(EvalPrompt(tuple(int(t) for t in ids), "samples", f"s{i}"))
        return prompts
    g = torch.Generator().manual_seed(args.seed)
    return [EvalPrompt(tuple(torch.randint(0, vocab - 1, (args.prompt_len,), generator=g).tolist()), "random",
                       f"r{i}") for i in range(args.prompts)]


def derived(speed: dict) -> dict:
    """Milliseconds per target token and per speculative round (tau tokens) from the rates."""
    out = {}
    if speed["target_tokens_per_s"]:
        out["target_step_ms"] = round(1000 / speed["target_tokens_per_s"], 3)
    if speed["speculative_tokens_per_s"]:
        out["round_ms"] = round(1000 * speed["tau"] / speed["speculative_tokens_per_s"], 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--target", help="a target model directory (HF format)")
    src.add_argument("--dims", choices=sorted(DIMS), default="smollm2-135m", help="random target of this shape")
    dr = p.add_mutually_exclusive_group(required=True)
    dr.add_argument("--drafter", help="a drafter checkpoint directory")
    dr.add_argument("--random-drafter", action="store_true", help="a randomly initialised drafter")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--always-accept", action="store_true",
                   help="random target and drafter that always agree (tau = block size)")
    p.add_argument("--samples", help="a tokenized_samples parquet to take the prompts from")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop-ids", type=int, nargs="*", default=[])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--no-graphs", action="store_true", help="run the static-cache steps eagerly")
    p.add_argument("--with-eager", action="store_true", help="also time the eager float32 decode_speed path")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.always_accept and (args.target or args.drafter):
        p.error("--always-accept needs a random target and --random-drafter")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    t0 = time.perf_counter()
    target = build_target(args, device, dtype)
    drafter = build_drafter(args, target)
    prompts = read_prompts(args, int(target.config.vocab_size))
    log(f"models ready in {time.perf_counter() - t0:.1f} s; {len(prompts)} prompts")
    report = {"bench": "graph_speedup", "target": args.target or f"random {args.dims}",
              "drafter": args.drafter or f"random, {args.drafter_layers} layers",
              "block_size": drafter.config.block_size, "always_accept": args.always_accept,
              "prompt_len": args.prompt_len, "samples": args.samples,
              "machine": machine_info("torch", "transformers"), "gpu": gpu_info()}
    eager_drafter = copy.deepcopy(drafter) if args.with_eager else None
    t0 = time.perf_counter()
    graph = graph_decode_speed(target, drafter, prompts, max_new_tokens=args.max_new_tokens,
                               stop_token_ids=args.stop_ids, graphs=False if args.no_graphs else None)
    report["static"] = {**graph, **derived(graph), "wall_s": round(time.perf_counter() - t0, 2)}
    log(f"static caches: {report['static']}")
    if args.with_eager:
        target32 = copy.deepcopy(target).float()
        del target
        t0 = time.perf_counter()
        eager = decode_speed(target32, eager_drafter, prompts, max_new_tokens=args.max_new_tokens,
                             stop_token_ids=args.stop_ids)
        report["eager_float32"] = {**eager, **derived(eager), "wall_s": round(time.perf_counter() - t0, 2)}
        log(f"eager float32: {report['eager_float32']}")
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
