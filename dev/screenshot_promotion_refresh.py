"""docs/promotion-check.png, docs/learning-curve-by-slice.png and docs/target-refresh-sensor.png: a drafter's
lifecycle in the Dagster UI.

A real `dagster dev` (tests/dagster_dev.py) whose deployment names target B (a copy of the tiny dense target
with one weight changed: a fine-tune) while this process, on the same Dagster instance and store, runs the
demo graph on target A (the tiny target's copy) in process (`dagster_project.demo.run_demo`: 8 prompts in
shards of 4, the in-process engine; `demo-v1` trained and promoted), then registers `demo-v2` (the same recipe,
`init_from: promoted`, a learning-curve checkpoint every 2 steps) and runs `refresh_drafter_job` for it: the `promotion` check on `drafter_eval`
re-measures demo-v1 on the same held-out prompts and compares (`previous_tau`, `candidate_tau`, `tau_delta`,
`regressed_slices`). Then `target_refresh_sensor` is started in the UI's instance: under target B every shard
is stale, and its first tick requests `prepare_data_job` for each shard. Debian's chromium (Playwright) takes
drafter_eval's Checks tab (the promotion check and its metadata), the sensor's page with its tick, and, when
the UI lets it find them, the tick's log (docs/target-refresh-sensor-logs.png) and the `learning_curve_by_slice`
chart of demo-v2's materialization. Writes the PNGs under docs/ and a temporary
Dagster home and store (about 4 minutes on 2 busy cores).

    python dev/screenshot_promotion_refresh.py
"""
import json, os, shutil, sys, tempfile, time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOCS = REPO / "docs"

root = Path(tempfile.mkdtemp())
from dflash_assets.embedded.tiny_targets import tiny_target_path  # noqa: E402

target_a = root / "a" / "tiny"
shutil.copytree(tiny_target_path("dense"), target_a)
from tests.drafter.test_target_change import with_one_weight_changed  # noqa: E402

target_b = with_one_weight_changed(target_a, root / "b" / "tiny")
store_dir = root / "store"


def deployment(target: Path) -> dict[str, str]:
    return {"DFLASH_PROFILE": "local", "DFLASH_STORE": str(store_dir), "DFLASH_TARGET_MODEL": str(target),
            "DFLASH_TARGET_DTYPE": "float32", "DFLASH_ENGINE_URLS": f"transformers:inprocess://{target.name}"}


for key in [k for k in os.environ if k.startswith(("DFLASH_TARGET_", "DFLASH_ENGINE_"))]:
    del os.environ[key]
os.environ.update(deployment(target_a))  # this process: target A, before the code location is imported

import dagster as dg  # noqa: E402


from dagster_project.definitions import defs  # noqa: E402
from dagster_project.demo import QUIET_CONSOLE, run_demo  # noqa: E402
from dagster_project.partitions import register_recipe  # noqa: E402
from dflash_assets.drafter.promotion import read_promoted  # noqa: E402
from dflash_assets.drafter.recipe import DrafterRecipe  # noqa: E402
from dflash_assets.drafter.stages import load_recipe  # noqa: E402
from dflash_assets.store.backends import LocalStore  # noqa: E402
from tests.dagster_dev import dagster_dev, ui_page  # noqa: E402

CURVE = {"ops": {"drafter_eval": {"config": {"num_prompts": 2, "max_new_tokens": 16, "curve_prompts": 2}}}}
TICKS = """query($s: SensorSelector!) { sensorOrError(sensorSelector: $s) { __typename ... on Sensor {
  sensorState { ticks(limit: 5) { status runIds skipReason error { message } } } } } }"""


def shoot(page, path: Path, wait_text: str, click: str | None = None) -> None:
    if click:
        page.get_by_text(click, exact=True).first.wait_for()
        page.get_by_text(click, exact=True).first.click()
    page.get_by_text(wait_text).first.wait_for()
    page.wait_for_timeout(3000)
    page.screenshot(path=str(path), full_page=True)
    print("wrote", path)


t0 = time.time()
with dagster_dev(root / "home", env=deployment(target_b)) as dev:  # the UI's deployment: the fine-tune, B
    instance = dev.instance()
    summary = run_demo(instance, prompts=8, shard_size=4, max_new_tokens=24, max_turns=1, eval_prompts=2,
                       eval_new_tokens=16, target=str(target_a), engine="inprocess", engine_concurrency=8,
                       pilot_prompts=0)
    assert summary.ok, summary.failures
    store = LocalStore(store_dir)
    print(f"demo on A: {time.time() - t0:.0f} s, promoted {read_promoted(store, 'demo')['recipe']}")
    v2 = DrafterRecipe.from_dict({**load_recipe(store, "demo-v1").to_dict(), "name": "demo-v2",
                                  "init_from": "promoted", "save_every": 2})  # curve checkpoints: the chart
    register_recipe(instance, store, v2)
    result = defs.resolve_job_def("refresh_drafter_job").execute_in_process(
        run_config={**CURVE, **QUIET_CONSOLE}, instance=instance, partition_key="demo-v2", raise_on_error=False)
    promotion = {e.check_name: e for e in result.get_asset_check_evaluations()}["promotion"]
    print("demo-v2:", result.success, {k: getattr(v, "value", v) for k, v in promotion.metadata.items()
                                       if k in ("previous_tau", "candidate_tau", "tau_delta", "regressed_slices")})
    print(f"demo-v2 trained and evaluated: {time.time() - t0:.0f} s")

    dev.start_sensor("target_refresh_sensor")
    selector = {**dev.repository_selector(), "sensorName": "target_refresh_sensor"}
    deadline, ticks = time.time() + 180, []
    while time.time() < deadline:
        ticks = dev.graphql(TICKS, {"s": selector})["sensorOrError"]["sensorState"]["ticks"]
        if any(t["status"] != "STARTED" for t in ticks):
            break
        time.sleep(3)
    print("sensor ticks:", json.dumps(ticks)[:600])

    with ui_page() as page:
        page.goto(dev.url + "/assets/drafter_eval?view=checks", wait_until="domcontentloaded")
        shoot(page, DOCS / "promotion-check.png", "candidate_tau", click="promotion")
        page.goto(dev.url + "/locations/dflash_assets/sensors/target_refresh_sensor", wait_until="domcontentloaded")
        shoot(page, DOCS / "target-refresh-sensor.png", "target_refresh_sensor")
        try:  # the tick's log: what the sensor requested and what it waits for
            page.get_by_text("View logs").first.click()
            page.get_by_text("prepare").first.wait_for(timeout=20_000)
            page.wait_for_timeout(2000)
            page.screenshot(path=str(DOCS / "target-refresh-sensor-logs.png"))
            print("wrote", DOCS / "target-refresh-sensor-logs.png")
        except Exception as e:  # noqa: BLE001 - optional; the sensor page above is the point
            print("no tick-log screenshot:", type(e).__name__, str(e)[:300])
        try:  # the chart: drafter_eval's latest materialization (demo-v2), its markdown metadata opened
            page.goto(dev.url + "/assets/drafter_eval?view=events&partition=demo-v2", wait_until="domcontentloaded")
            page.get_by_text("learning_curve_by_slice").first.wait_for()
            row = page.locator("tr", has=page.get_by_text("learning_curve_by_slice")).last
            row.get_by_text("Show Markdown").first.click()
            page.locator("img[alt='learning curve by slice']").first.wait_for()
            page.wait_for_timeout(2000)
            page.screenshot(path=str(DOCS / "learning-curve-by-slice.png"))
            print("wrote", DOCS / "learning-curve-by-slice.png")
        except Exception as e:  # noqa: BLE001 - optional; say why this one is missing
            print("no learning-curve screenshot:", type(e).__name__, str(e)[:300])
            page.screenshot(path=str(root / "drafter_eval-events.png"))
            print("what the page showed:", root / "drafter_eval-events.png", page.inner_text("body")[:1500])
print(f"ok in {time.time() - t0:.0f} s")
