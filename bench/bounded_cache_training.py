"""Benchmark: drafter training through the bounded part cache against the same run from local disk.

Writes a synthetic hidden-state cache at Qwen3-8B shapes (5 layers x 4096, bf16: 40,960 B per token) as
``--parts`` one-part partitions totalling ``--parts-gb`` into a "remote" directory store, then trains the same
recipe (``cache_limit_gb = --limit-gb``, so both runs use the same windowed sample order) twice:

- local: ``train_drafter`` on the part files where they lie (the reference);
- bounded: ``train_drafter`` on the store keys through ``BoundedPartCache`` (at most ``--limit-gb`` on local
  disk: parts copied in ahead of the reader, evicted behind it).

The "remote" is a directory on the same machine: a part's fetch is a file copy (from the page cache once the
parts were written), so this measures what the cache's fetch/evict/prefetch machinery costs the training
loop, not a network. ``--s3`` adds a third run against moto's S3 server on 127.0.0.1 when moto is installed
(moto is a Python server: its throughput, not S3's). Goal: bounded >= 0.9 x local tokens/s (steady state:
the second half of the steps). Needs torch, safetensors, numpy. Prints one JSON object; progress on stderr.

    python bench/bounded_cache_training.py                          # GPU: 8 GB of parts, 2 GB limit
    python bench/bounded_cache_training.py --quick                  # tiny shapes on CPU (seconds)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from bench.machine import gpu_info, machine_info  # noqa: E402
from dflash_assets.drafter.recipe import DrafterRecipe  # noqa: E402
from dflash_assets.drafter.training import train_drafter  # noqa: E402
from dflash_assets.hidden_states.format import SafetensorsStreamWriter, ShardMetadata, shard_tensor_specs  # noqa: E402
from dflash_assets.hidden_states.part_cache import BoundedPartCache  # noqa: E402
from dflash_assets.target_model.conventions import dflash_target_layer_ids  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151_936, num_target_layers=36, mask_token_id=151_669)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=1024, num_target_layers=8, mask_token_id=1023)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class DirStore:
    """The few store methods the part cache uses, over a directory (no pyarrow needed on the GPU host)."""

    def __init__(self, root: Path):
        self.root, self.uri = root, str(root)

    def local_path(self, key: str) -> Path:
        return self.root / key

    def size(self, key: str) -> int:
        return (self.root / key).stat().st_size

    def url(self, key: str) -> str:
        return (self.root / key).as_uri()


def write_target(target: Path, dims: dict, dev: str) -> None:
    from safetensors.torch import save_file

    H, V, L = dims["hidden_size"], dims["vocab_size"], dims["num_target_layers"]
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": H,
        "intermediate_size": dims["intermediate_size"], "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"], "head_dim": dims["head_dim"], "num_hidden_layers": L,
        "vocab_size": V, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}))
    g = torch.Generator(device=dev).manual_seed(0)
    save_file({"model.embed_tokens.weight": (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16().cpu(),
               "lm_head.weight": (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16().cpu()},
              str(target / "model.safetensors"))


def write_parts(store_root: Path, dims: dict, args, dev: str) -> list[str]:
    """``--parts`` partitions of random sequences (lengths seq/2..seq) totalling about ``--parts-gb``."""
    H, V = dims["hidden_size"], dims["vocab_size"]
    layer_ids = dflash_target_layer_ids(dims["num_target_layers"], 5)
    per_token = 5 * H * 2
    tokens_per_part = int(args.parts_gb * 1e9 / args.parts / per_token)
    rng = np.random.default_rng(0)
    g = torch.Generator(device=dev).manual_seed(1)
    keys = []
    for k in range(args.parts):
        lengths, total = [], 0
        while total < tokens_per_part:
            n = int(rng.integers(args.seq // 2, args.seq + 1))
            lengths.append(n)
            total += n
        key = f"hidden_state_cache/shard-{k:05d}/v1/shard-{k:05d}.safetensors"
        path = store_root / key
        meta = ShardMetadata(target_model="synthetic", layer_ids=tuple(layer_ids), dtype="bfloat16", hidden_size=H,
                             prompt_ids=tuple(f"s{k}-{i}" for i in range(len(lengths))))
        with SafetensorsStreamWriter(path, shard_tensor_specs(total, len(lengths), 5, H, "bfloat16"),
                                     meta.to_header(), fsync=False) as w:
            for n in lengths:
                w.write("hidden", torch.randn(n, 5 * H, device=dev, generator=g).bfloat16().cpu())
                w.write("input_ids", rng.integers(0, V - 1, n).astype(np.int32))
                lm = np.ones(n, dtype=np.uint8)
                lm[: n // 10] = 0
                w.write("loss_mask", lm)
            w.write("cu_seqlens", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        keys.append(key)
    return keys


def timed_run(recipe, files, target, out, source=None, max_steps=None) -> dict:
    steps: list[tuple[float, int]] = []
    t = time.perf_counter()
    res = train_drafter(recipe, files, target, out, resume=False, log=lambda m: steps.append((time.perf_counter(), m["tokens"])),
                        source=source, max_steps=max_steps)
    wall = time.perf_counter() - t
    tail = steps[len(steps) // 2:]
    steady = sum(n for _, n in tail[1:]) / max(tail[-1][0] - tail[0][0], 1e-9) if len(tail) > 2 else None
    return {"steps": res.steps, "wall_s": round(wall, 2), "tokens_per_s_all": round(res.tokens_per_s, 1),
            "steady_tokens_per_s": round(steady, 1) if steady else None, "loss_last": res.losses[-1],
            "part_cache": res.data_stats}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes on CPU")
    p.add_argument("--parts-gb", type=float, default=None, help="total size of the parts (default 8; quick 0.004)")
    p.add_argument("--parts", type=int, default=16)
    p.add_argument("--limit-gb", type=float, default=None, help="the cache limit (default 2; quick 0.001)")
    p.add_argument("--seq", type=int, default=None, help="max sequence length (default 3072; quick 64)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir; needs 2x parts-gb free)")
    p.add_argument("--s3", action="store_true", help="also train from moto's S3 server on 127.0.0.1")
    p.add_argument("--out", default=None, help="write the JSON result here too")
    args = p.parse_args(argv)
    quick = args.quick
    args.parts_gb = args.parts_gb or (0.004 if quick else 8.0)
    args.limit_gb = args.limit_gb or (0.001 if quick else 2.0)
    args.seq = args.seq or (64 if quick else 3072)
    if quick:
        args.parts = min(args.parts, 8)
    cuda = torch.cuda.is_available() and not quick
    dev = "cuda" if cuda else "cpu"
    dims = TINY if quick else QWEN3_8B
    root = Path(args.dir or tempfile.mkdtemp(prefix="dflash-bounded-"))
    root.mkdir(parents=True, exist_ok=True)
    res: dict = {"env": {"device": dev, "machine": machine_info("torch", "transformers", "safetensors", "numpy"), "gpu": gpu_info()},
                 "config": {k: v for k, v in vars(args).items() if k not in ("out", "dir")}}
    try:
        target = root / "target"
        write_target(target, dims, dev)
        store_root = root / "store"
        t = time.perf_counter()
        keys = write_parts(store_root, dims, args, dev)
        store = DirStore(store_root)
        sizes = {k: store.size(k) for k in keys}
        res["parts"] = {"count": len(keys), "gb": round(sum(sizes.values()) / 1e9, 3),
                        "largest_gb": round(max(sizes.values()) / 1e9, 3), "write_s": round(time.perf_counter() - t, 1)}
        log(f"parts: {res['parts']}")
        recipe = DrafterRecipe(name="bounded-bench", epochs=args.epochs, batch_size=args.batch,
                               mask_token_id=dims["mask_token_id"], max_length=args.seq, max_anchors=512 if not quick else 16,
                               save_every=10**9, cache_limit_gb=args.limit_gb, num_layers=5 if not quick else 2,
                               block_size=16 if not quick else 4)
        limit = int(args.limit_gb * 1e9)
        log("warm-up: 20 steps from local files (kernels, compile caches, allocator), not counted")
        res["warmup"] = timed_run(recipe, [store.local_path(k) for k in keys], target, root / "out-warm", max_steps=20)
        log("run: local files")
        res["local"] = timed_run(recipe, [store.local_path(k) for k in keys], target, root / "out-local")
        log(f"local: {res['local']}")
        log("run: bounded cache")
        cache = BoundedPartCache(store, keys, limit, sizes=sizes, cache_dir=root / "cache")
        res["bounded"] = timed_run(recipe, keys, target, root / "out-bounded", source=cache)
        log(f"bounded: {res['bounded']}")
        a, b = res["local"]["steady_tokens_per_s"], res["bounded"]["steady_tokens_per_s"]
        res["ratio_bounded_to_local"] = round(b / a, 3) if a and b else None
        res["goal"] = ">= 0.9"
        if args.s3:
            res["s3_moto"] = s3_run(recipe, keys, store, sizes, limit, target, root)
            if res["s3_moto"].get("steady_tokens_per_s") and a:
                res["ratio_s3_moto_to_local"] = round(res["s3_moto"]["steady_tokens_per_s"] / a, 3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def s3_run(recipe, keys, store, sizes, limit, target, root) -> dict:
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        return {"skipped": f"{e}"}
    from dflash_assets.store.backends import S3Store

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                              aws_access_key_id="bench", aws_secret_access_key="bench")
        client.create_bucket(Bucket="bench")
        s3 = S3Store("s3://bench/run", client)
        t = time.perf_counter()
        for k in keys:
            s3.upload_file(k, store.local_path(k))
        upload_s = time.perf_counter() - t
        cache = BoundedPartCache(s3, keys, limit, sizes=sizes, cache_dir=root / "cache-s3")
        out = timed_run(recipe, keys, target, root / "out-s3", source=cache)
        return {**out, "upload_s": round(upload_s, 1)}
    finally:
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
