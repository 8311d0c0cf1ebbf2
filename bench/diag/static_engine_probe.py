"""Probe the in-process engine's static-cache path on a GPU: shapes, threads, memory, full tracebacks."""
import asyncio, sys, time, traceback
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
from dflash_assets.generation.engines import GenerationConfig, TransformersEngine

target = Path(Path("/tmp/smollm2-product/target_dir").read_text())
eng = TransformersEngine(target, device="cuda", dtype="bfloat16", cache="static", max_concurrency=1024,
                         max_batch_tokens=524288)
eng._load()
gen = GenerationConfig(max_new_tokens=256, temperature=0.0)
stop = sorted(eng.tok.stop_ids)
g = torch.Generator().manual_seed(0)

def rows(n, w):
    return [torch.randint(100, 40000, (w - (i % 7),), generator=g).tolist() for i in range(n)]

def case(name, fn):
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    try:
        out = fn()
        print(f"{name}: ok {time.perf_counter() - t:.1f}s rows={len(out)} new={sum(map(len, out))} "
              f"peak={torch.cuda.max_memory_allocated() / 2**30:.1f}GiB shapes={eng.batch_shapes[-1]}", flush=True)
    except Exception:
        print(f"{name}: FAILED {time.perf_counter() - t:.1f}s", flush=True)
        traceback.print_exc(limit=8)
        print(f"{name}: mem reserved {torch.cuda.memory_reserved() / 2**30:.1f}GiB", flush=True)

case("main 1000x300", lambda: eng._generate(rows(1000, 300), gen, stop))
case("main 1000x300 again", lambda: eng._generate(rows(1000, 300), gen, stop))
case("thread 1000x300", lambda: asyncio.run(asyncio.to_thread(eng._generate, rows(1000, 300), gen, stop)))
case("main 300x1700", lambda: eng._generate(rows(300, 1700), gen, stop))
case("main 40x300", lambda: eng._generate(rows(40, 300), gen, stop))
