"""docs/tau-while-training.png and docs/preflight-check.png: tau while training and the preflight in the Dagster UI.

A real `dagster dev` (tests/dagster_dev.py) on a temporary Dagster home and store, with the tiny dense target and
the in-process engine; this process runs the demo graph in process (`dagster_project.demo.run_demo`: 8 prompts in
shards of 4, `demo-v1` trained and evaluated), then registers `demo-v2`: demo-v1's recipe with more epochs and a
saved state (so a tau estimate) every 2 steps, and materializes its `drafter_checkpoint`. Debian's chromium
(Playwright) takes demo-v2's `tau_while_training` chart (its materialization on the Events tab, the Markdown
opened: the held-out tau estimate per evaluation, the best checkpoint in red, beside `loss_curve`) and the
`preflight` check on drafter_checkpoint's Checks tab. Writes the PNGs under docs/ (about 5 minutes on 2 busy
cores).

    python dev/screenshot_tau_while_training.py
"""
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOCS = REPO / "docs"

root = Path(tempfile.mkdtemp())
from dflash_assets.embedded.tiny_targets import tiny_target_path  # noqa: E402

target = root / "target" / "tiny"
shutil.copytree(tiny_target_path("dense"), target)
store_dir = root / "store"
deployment = {"DFLASH_PROFILE": "local", "DFLASH_STORE": str(store_dir), "DFLASH_TARGET_MODEL": str(target),
              "DFLASH_TARGET_DTYPE": "float32", "DFLASH_ENGINE_URLS": f"transformers:inprocess://{target.name}"}
for key in [k for k in os.environ if k.startswith(("DFLASH_TARGET_", "DFLASH_ENGINE_"))]:
    del os.environ[key]
os.environ.update(deployment)  # before the code location is imported

import dagster as dg  # noqa: E402

from dagster_project.definitions import defs  # noqa: E402
from dagster_project.demo import QUIET_CONSOLE, run_demo  # noqa: E402
from dagster_project.partitions import register_recipe  # noqa: E402
from dflash_assets.drafter.recipe import DrafterRecipe  # noqa: E402
from dflash_assets.drafter.stages import load_recipe  # noqa: E402
from dflash_assets.store.backends import LocalStore  # noqa: E402
from tests.dagster_dev import dagster_dev, ui_page  # noqa: E402


def open_markdown(page, key: str, alt: str, path: Path) -> None:
    """The latest materialization's Markdown metadata ``key`` opened, its image ``alt`` shown, the page shot."""
    page.get_by_text(key, exact=True).first.wait_for()
    row = page.locator("tr", has=page.get_by_text(key, exact=True)).last
    row.get_by_text("Show Markdown").first.click()
    page.locator(f"img[alt='{alt}']").first.wait_for()
    page.wait_for_timeout(2000)
    page.screenshot(path=str(path))
    print("wrote", path)


t0 = time.time()
with dagster_dev(root / "home", env=deployment) as dev:
    instance = dev.instance()
    summary = run_demo(instance, prompts=8, shard_size=4, max_new_tokens=24, max_turns=1, eval_prompts=2,
                       eval_new_tokens=16, target=str(target), engine="inprocess", engine_concurrency=8,
                       pilot_prompts=0)
    assert summary.ok, summary.failures
    print(f"demo: {time.time() - t0:.0f} s, tau {summary.tau}")
    store = LocalStore(store_dir)
    v2 = DrafterRecipe.from_dict({**load_recipe(store, "demo-v1").to_dict(), "name": "demo-v2", "epochs": 8,
                                  "save_every": 2, "tau_prompts": 4, "tau_new_tokens": 32})
    register_recipe(instance, store, v2)
    result = dg.materialize(defs.assets, selection=["drafter_checkpoint"], partition_key="demo-v2",
                            instance=instance, resources=defs.resources, run_config=QUIET_CONSOLE,
                            raise_on_error=False)
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    meta = {k: getattr(v, "value", v) for m in result.asset_materializations_for_node("drafter_checkpoint")
            for k, v in m.metadata.items() if k in ("best_checkpoint", "stop_reason", "objective", "preflight")}
    print("demo-v2:", result.success, checks, meta, f"{time.time() - t0:.0f} s")

    with ui_page() as page:
        try:
            page.goto(dev.url + "/assets/drafter_checkpoint?view=events&partition=demo-v2",
                      wait_until="domcontentloaded")
            open_markdown(page, "tau_while_training", "tau while training", DOCS / "tau-while-training.png")
        except Exception as e:  # noqa: BLE001 - say why it is missing, and what the page showed
            print("no tau-while-training screenshot:", type(e).__name__, str(e)[:300])
            page.screenshot(path=str(root / "drafter_checkpoint-events.png"))
            print("what the page showed:", root / "drafter_checkpoint-events.png", page.inner_text("body")[:1500])
        page.goto(dev.url + "/assets/drafter_checkpoint?view=checks", wait_until="domcontentloaded")
        page.get_by_text("preflight", exact=True).first.wait_for()
        page.get_by_text("preflight", exact=True).first.click()
        page.get_by_text("tau_max").first.wait_for()
        page.wait_for_timeout(3000)
        page.screenshot(path=str(DOCS / "preflight-check.png"), full_page=True)
        print("wrote", DOCS / "preflight-check.png")
print(f"ok in {time.time() - t0:.0f} s")
