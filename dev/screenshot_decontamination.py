"""docs/decontamination-check.png: drafter_checkpoint's blocking decontamination check failing in the Dagster UI,
failed by a benchmark prompt found in training data, with the held-out duplicates left out of evaluation.

A real `dagster dev` (tests/dagster_dev.py) over a 12-prompt source in shards of 4; the recipe trains on the
first two shards. Planted: an exact duplicate (a trained prompt upper-cased) and a near duplicate (one word
changed) of trained prompts in the held-out shard, and a benchmark file (`DFLASH_BENCHMARK_PROMPTS`) holding a
trained prompt. Held-out prompts are selected clean (`decontamination.heldout_selection`): the two planted
duplicates are left out of evaluation and counted (`excluded_exact: 1`, `excluded_near: 1`,
`excluded_examples`), not failed, and the two clean ones remain (`eval_prompts: 2`). The benchmark prompt fails
the check (`exact: 1`, `by_origin`: benchmark): `drafter_checkpoint` fails before any GPU run. Debian's chromium
(Playwright) takes the check on the Checks tab with all its metadata. Writes the PNG under docs/ and a
temporary Dagster home (about 2 minutes on 2 busy cores).

    python dev/screenshot_decontamination.py
"""
import json, re, sys, tempfile
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.dagster_dev import dagster_dev, ui_page

from dagster_project.partitions import register_recipe
from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.store.backends import LocalStore
from tests.drafter.test_decontamination import TOPICS, long_prompt

root = Path(tempfile.mkdtemp())
# shards of 4: two trained, the third held out with an exact and a near duplicate of trained prompts 3 and 6
texts = [long_prompt(t) for t in TOPICS[:8]] + [long_prompt(TOPICS[3]).upper() + " !!",
        " ".join(long_prompt(TOPICS[6]).split()[:-1] + ["words"]), long_prompt(TOPICS[10]), long_prompt(TOPICS[11])]
src = root / "prompts.jsonl"
src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": t}]}) + "\n" for t in texts))
bench = root / "bench.txt"
bench.write_text(long_prompt(TOPICS[4]) + "\n")  # a trained prompt: the benchmark is contaminated
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
    with ui_page() as page:
        page.goto(dev.url + "/assets/drafter_checkpoint?view=checks", wait_until="domcontentloaded")
        page.get_by_text("decontamination").first.wait_for()
        page.get_by_text("decontamination").first.click()
        page.wait_for_timeout(4000)
        page.get_by_text("excluded_exact").first.wait_for()
        page.screenshot(path=str(REPO / "docs" / "decontamination-check.png"), full_page=True)
print("ok")
