"""docs/column-schema-<asset>.png: the Dagster UI's catalog page of raw_prompts, completions and tokenized_samples,
showing the columns each reports (``dagster/column_schema``) and its row count (``dagster/row_count``).

A real `dagster dev` (tests/dagster_dev.py) over an 8-prompt source in one shard; completions come from a
loopback SGLang engine serving the tiny target's tokenizer (``DFLASH_ENGINE_URLS``), 16 new tokens a turn. One
partition of each asset is materialized, then Debian's chromium (Playwright) opens each asset's page. Writes the
three PNGs under docs/ and a temporary Dagster home (about 2 minutes on 2 busy cores).

    python dev/screenshot_column_schemas.py
"""
import json, sys, tempfile
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.dagster_dev import dagster_dev, ui_page

from dflash_assets.embedded.tiny_targets import tiny_target_path
from dflash_assets.store.backends import LocalStore
from tests.support.sglang_loopback import LoopbackServer

ASSETS = ("raw_prompts", "completions", "tokenized_samples")

root = Path(tempfile.mkdtemp())
src = root / "prompts.jsonl"
src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: why is the sky blue?"}]})
                       + "\n" for i in range(8)))
store = LocalStore(root / "store")
with LoopbackServer(model_path=str(tiny_target_path("dense"))) as engine:
    env = {"DFLASH_PROMPT_SOURCE": str(src), "DFLASH_STORE": store.uri, "DFLASH_ENGINE_URLS": f"sglang:{engine.url}"}
    with dagster_dev(root / "home", env=env) as dev:
        assert dev.wait_for_run(dev.launch_run(["prompt_corpus"])) == "SUCCESS", dev.log_tail()
        (shard,) = dev.instance().get_dynamic_partitions("prompt_shards")
        config = {"ops": {"completions": {"config": {"max_new_tokens": 16}}}}
        for asset in ASSETS:
            run = dev.launch_run([asset], config if asset == "completions" else None, tags={"dagster/partition": shard})
            print(asset, dev.wait_for_run(run))
        with ui_page() as page:
            for asset in ASSETS:
                page.goto(f"{dev.url}/assets/{asset}", wait_until="domcontentloaded")
                page.get_by_text("prompt_id").first.wait_for()  # the columns table is drawn
                page.wait_for_timeout(2000)
                page.screenshot(path=str(REPO / "docs" / f"column-schema-{asset}.png"), full_page=True)
print("ok")
