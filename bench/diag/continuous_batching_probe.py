"""Probe transformers' continuous batching on a GPU, apart from the engine: a SmolLM2-135M-shaped Llama with
random weights in bfloat16, `generate_batch` over N prompts, with transformers' own continuous-batching log on
(CUDA graphs, attention kernel, cache size). Needs only torch and transformers. Prints one JSON line.

    PYTHONPATH=/tmp/site python3 bench/diag/continuous_batching_probe.py --prompts 1024 --new-tokens 128
"""
import argparse
import json
import logging
import sys
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

p = argparse.ArgumentParser()
p.add_argument("--prompts", type=int, default=1024)
p.add_argument("--prompt-tokens", type=int, default=300)
p.add_argument("--new-tokens", type=int, default=128)
p.add_argument("--rows", type=int, default=1024, help="max_requests_per_batch")
p.add_argument("--device", default="cuda")
args = p.parse_args()
logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(message)s")
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.INFO)

cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(args.device, torch.bfloat16).eval()
sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(100, 40000, (args.prompt_tokens - i % 50,), generator=g).tolist() for i in range(args.prompts)]
gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
result = {"prompts": args.prompts, "new_tokens": args.new_tokens, "rows": args.rows}
for attempt in ("first", "second"):
    sync()
    t = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=args.rows))
    sync()
    s = time.perf_counter() - t
    new = sum(len(o.generated_tokens) for o in out.values())
    result[attempt] = {"seconds": round(s, 1), "new_tokens": new, "tokens_per_s": round(new / s, 1)}
    print(attempt, result[attempt], file=sys.stderr, flush=True)
print(json.dumps(result))
