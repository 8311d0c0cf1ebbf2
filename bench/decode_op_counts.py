"""The operators one speculative verification issues against one token of the target alone: the batch-1 speed-up.

At batch 1 a small target on a GPU is bound by the host: each operator costs about the same few microseconds to
dispatch and launch, whatever its size (SmolLM2-135M in float32 on an H200: ~28 ms a token for ~1,700 operators).
So the speed-up speculative decoding can reach there is about tau x (operators per target token) / (operators per
verification: the drafter's forward, the target's forward over the block, the loop's own). This counts them with
`torch.profiler` on the product's own `SpeculativeDecoder` and `greedy_generate` (top-level ATen calls, each
region's by the module whose forward issued it), on this machine's CPU: the counts are the same on any device.

Reads the converted SmolLM2 (`make smollm2`, or `--target DIR`) and a trained drafter checkpoint (`--drafter DIR`:
`model.safetensors` + `config.json`, as `drafter_checkpoint` publishes it; the prediction uses `--tau`, else the tau
measured here) or an untrained one (`--layers`, `--block-size`). Writes nothing; prints one JSON object (also to
`--out`).

    .venv/bin/python bench/decode_op_counts.py --tau 2.19
    .venv/bin/python bench/decode_op_counts.py --drafter STUDY_DIR/store/drafter_checkpoint/smollm2-study/<version>
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dflash_assets from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py (stdlib only)

from machine import print_report  # noqa: E402

REGIONS = ("drafter", "target_prefill", "target_verify")


def labelled(module, name_of) -> None:
    """`module`'s forward run inside a profiler region named `name_of(args, kwargs)`."""
    import functools

    from torch.profiler import record_function

    forward = module.forward

    @functools.wraps(forward)  # its signature stays the forward's: the decoder reads the cache argument's name there
    def forward_in_region(*args, **kwargs):
        with record_function(name_of(args, kwargs)):
            return forward(*args, **kwargs)

    module.forward = forward_in_region


def top_level_ops(events) -> list:
    """ATen calls not issued by another ATen call: what Python (or a module's code) dispatched one by one."""
    return [e for e in events if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def region_of(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in REGIONS:
            return parent.name
        parent = parent.cpu_parent
    return "loop"


def count_ops(target, drafter, prompt: list[int], new_tokens: int, stop: list[int]) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dflash_assets.drafter.decoding import SpeculativeDecoder, greedy_generate

    block = drafter.config.block_size
    labelled(drafter, lambda a, kw: "drafter")
    labelled(target, lambda a, kw: "target_verify" if kw["input_ids"].shape[1] <= block else "target_prefill")
    decoder = SpeculativeDecoder(target, drafter)
    decoder.generate(prompt, new_tokens, stop)  # warm-up (first-call allocations, lazy inits)
    greedy_generate(target, prompt, new_tokens, stop)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as spec_prof:
        out = decoder.generate(prompt, new_tokens, stop)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as alone_prof:
        alone = greedy_generate(target, prompt, new_tokens, stop)
    assert alone == out.output_ids, "speculative decoding departed from the target's greedy output"
    verifications = len(out.acceptance_lengths)
    by_region: dict[str, Counter] = {r: Counter() for r in (*REGIONS, "loop")}
    for e in top_level_ops(spec_prof.events()):
        by_region[region_of(e)][e.name] += 1
    # the prefill (the first token) is paid once by both ways of decoding: counted apart; the target alone then
    # runs one forward per token, its loop's own calls (argmax, .item(), the input tensor) included
    alone_ops = [e for e in top_level_ops(alone_prof.events()) if region_of(e) != "target_prefill"]
    per_verification = {r: round(sum(c.values()) / verifications, 1) for r, c in by_region.items()
                        if r != "target_prefill"}
    prefill = sum(by_region["target_prefill"].values())
    alone_per_token = len(alone_ops) / max(len(alone) - 1, 1)
    return {
        "new_tokens": len(out.output_ids), "verifications": verifications,
        "tau": round((len(out.output_ids) - 1) / verifications, 4),
        "ops_per_verification": per_verification,
        "ops_per_verification_total": round(sum(per_verification.values()), 1),
        "ops_per_target_token": round(alone_per_token, 1),
        "prefill_ops": prefill,
        "most_common_per_verification": {r: {k: round(v / verifications, 1) for k, v in c.most_common(8)}
                                         for r, c in by_region.items() if r != "target_prefill"},
    }


def main(argv=None) -> int:
    import torch
    from dflash_assets.drafter.decoding import load_target
    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_drafter, load_target_config
    from dflash_assets.embedded.smollm2 import smollm2_target_path
    from dflash_assets.target_model.conventions import mask_token_id_in_dir
    from machine import machine_info

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="a target directory (default: the converted SmolLM2)")
    p.add_argument("--drafter", metavar="DIR", help="a drafter checkpoint (model.safetensors + config.json); "
                   "else an untrained one")
    p.add_argument("--layers", type=int, default=5, help="an untrained drafter's layers")
    p.add_argument("--block-size", type=int, default=16, help="an untrained drafter's block size")
    p.add_argument("--tau", type=float, help="the tau the prediction uses (default: the one measured here)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)

    target_dir = Path(args.target) if args.target else smollm2_target_path()
    if args.drafter:
        drafter = load_drafter(args.drafter, dtype=torch.float32)
    else:
        drafter = DFlashDrafter(DrafterConfig.from_target_config(
            load_target_config(target_dir), num_layers=args.layers, block_size=args.block_size,
            mask_token_id=mask_token_id_in_dir(target_dir)))
    drafter = drafter.float().eval()
    layers, block = drafter.config.num_hidden_layers, drafter.config.block_size
    target = load_target(target_dir, "cpu", torch.float32)
    vocab = int(target.config.vocab_size)
    prompt = torch.randint(100, min(vocab, 20000), (args.prompt_tokens,)).tolist()
    counts = count_ops(target, drafter, prompt, args.new_tokens, stop=[])

    tau = args.tau or counts["tau"]
    ratio = counts["ops_per_target_token"] / counts["ops_per_verification_total"]
    report = {"bench": "decode_op_counts", "machine": machine_info(), "torch": torch.__version__,
              "target": target_dir.name,
              "drafter": {"layers": layers, "block_size": block, "checkpoint": args.drafter},
              **counts,
              "ops_ratio": round(ratio, 3),  # target ops per token / ops per verification
              "tau_used": tau, "tau_from": "--tau" if args.tau else "measured",
              "predicted_host_bound_speedup": round(tau * ratio, 3),
              "tau_for_2x": round(2.0 / ratio, 2)}
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
