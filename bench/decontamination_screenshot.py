"""docs/decontamination-check.png: drafter_checkpoint's blocking decontamination check failing in the Dagster UI.

A real `dagster dev` (tests/dagster_dev.py) over a 12-prompt source in shards of 4 with a planted exact and
near duplicate in the held-out shard and a benchmark file holding a trained prompt; `drafter_checkpoint` of a
recipe training on the first two shards fails before any GPU run; Debian's chromium (Playwright) takes the
Checks tab. Writes the PNG under docs/ and a temporary Dagster home.

    python bench/decontamination_screenshot.py
"""
import json, re, sys, tempfile
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from dagster_dev import dagster_dev
from playwright.sync_api import sync_playwright
from dagster_project.partitions import register_recipe
from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.store.backends import LocalStore
from test_decontamination import TOPICS, long_prompt

root = Path(tempfile.mkdtemp())
texts = [long_prompt(t) for t in TOPICS[:8]] + [long_prompt(TOPICS[3]).upper() + " !!",
        " ".join(long_prompt(TOPICS[6]).split()[:-1] + ["words"]), long_prompt(TOPICS[10]), long_prompt(TOPICS[11])]
src = root / "prompts.jsonl"
src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": t}]}) + "\n" for t in texts))
bench = root / "bench.txt"
bench.write_text(long_prompt(TOPICS[4]) + "\n")
store = LocalStore(root / "store")
env = {"DFLASH_PROMPT_SOURCE": str(src), "DFLASH_STORE": store.uri, "DFLASH_BENCHMARK_PROMPTS": str(bench)}
with dagster_dev(root / "home", env=env) as dev:
    run = dev.launch_run(["prompt_corpus"], {"ops": {"prompt_corpus": {"config": {"max_prompts_per_shard": 4}}}})
    assert dev.wait_for_run(run) == "SUCCESS", dev.log_tail()
    shards = sorted(dev.instance().get_dynamic_partitions("prompt_shards"))
    for shard in shards:
        assert dev.wait_for_run(dev.launch_run(["raw_prompts"], tags={"dagster/partition": shard})) == "SUCCESS"
    register_recipe(dev.instance(), store, DrafterRecipe(name="qwen36-27b-v1", partitions=tuple(shards[:2])))
    out = dev.wait_for_run(dev.launch_run(["drafter_checkpoint"], tags={"dagster/partition": "qwen36-27b-v1"}))
    print("drafter_checkpoint run:", out)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        ctx = browser.new_context(viewport={"width": 1600, "height": 1000})
        ctx.add_init_script("window.localStorage.setItem('communityNux', '\"1\"')")
        page = ctx.new_page()
        page.set_default_timeout(60_000)
        page.goto(dev.url + "/assets/drafter_checkpoint?view=checks", wait_until="domcontentloaded")
        page.get_by_text("decontamination").first.wait_for()
        page.get_by_text("decontamination").first.click()
        page.wait_for_timeout(4000)
        page.get_by_text("exact").first.wait_for()
        page.screenshot(path=str(REPO / "docs" / "decontamination-check.png"), full_page=True)
        browser.close()
print("ok")
