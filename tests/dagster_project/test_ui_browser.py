"""The Dagster UI in a real browser: Debian's chromium, headless, driven by Playwright, against ``dagster dev``.

One ``dagster dev`` on 127.0.0.1 for the module, over a 30-prompt source
ingested into three ``prompt_shards`` partitions of 10. Runs launched over
GraphQL as the UI's "Materialize" buttons launch them: ``raw_prompts`` for
two partitions, then ``tokenized_samples`` for a partition whose completions
answer (checks pass) and one whose completions are ``OK.`` stubs (the
blocking ``empty_response_ratio`` check fails). Then, in the browser:

- the global asset lineage, all groups expanded, shows every asset of the
  definitions;
- a materialized ``raw_prompts`` partition shows its own metadata
  (``num_prompts`` 10, its store key);
- the ``tokenized_samples`` checks tab shows ``empty_response_ratio`` as a
  blocking check, its failed evaluation with ``ratio`` and ``threshold``, and
  the passed one in the execution history.

A second ``dagster dev`` runs the embedded default (local profile, no
``DFLASH_ENGINE_URLS``: each step that generates starts its own
``transformers serve`` on the tiny target and stops it) over 8 one-turn
prompts in shards of 4 (a JSONL source: ShareGPT's first prompts run to six
user turns, which the tiny target answers one after another), with
``prompt_corpus`` and ``raw_prompts`` materialized cheaply over GraphQL. In
the browser, by clicking:

- ``completions`` -> **Materialize…**: the dialog opens with 0 partitions and
  **Launch backfill** disabled; **All** -> 2 partitions -> **Launch
  backfill**; the daemon's runs (two at once, each with its own engine)
  succeed and the backfill page says Succeeded;
- Jobs -> ``prepare_data_job`` -> **Materialize all…** -> **All** ->
  **Launch backfill**: the runs are the job's own (listed on its Runs tab,
  tagged ``dflash/host_kind``), raw prompts -> completions -> tokenized
  samples; a run fails only where a blocking check says the shard's answers
  are too short. (Runs launched from an asset's
  page run as Dagster's hidden ``__ASSET_JOB``: they show under Runs and on
  the backfill's page, never under a named job.)

Screenshots of every page land in ``test-artifacts/ui/`` (gitignored), also
when a test fails.
"""

import re

import dagster as dg
import pytest
from tests.dagster_dev import REPO_ROOT, dagster_dev, write_completions, write_prompt_source
from playwright.sync_api import Page, expect, sync_playwright

from dagster_project.definitions import defs
from dflash_assets.store.backends import LocalStore

pytestmark = pytest.mark.slow

ARTIFACTS = REPO_ROOT / "test-artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000
expect.set_options(timeout=TIMEOUT_MS)
# The embedded default: local profile, no engine configured.
EMBEDDED_DEFAULT_ENV = {"DFLASH_PROFILE": "", "DFLASH_ENGINE_URLS": ""}
UI_PROMPTS, UI_SHARD_SIZE = 8, 4
BACKFILL_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """dagster dev with materialized partitions: raw_prompts x2, tokenized_samples good + stub."""
    root = tmp_path_factory.mktemp("ui")
    source = write_prompt_source(root / "prompts.jsonl", 30)
    store = LocalStore(root / "store")
    with dagster_dev(root / "home", env={"DFLASH_PROMPT_SOURCE": str(source), "DFLASH_STORE": store.uri}) as dev:
        run = dev.launch_run(["prompt_corpus"], {"ops": {"prompt_corpus": {"config": {"max_prompts_per_shard": 10}}}})
        assert dev.wait_for_run(run) == "SUCCESS", dev.log_tail()
        shards = dev.instance().get_dynamic_partitions("prompt_shards")
        assert len(shards) == 3
        good, bad = shards[0], shards[1]
        for shard in (good, bad):
            assert dev.wait_for_run(dev.launch_run(["raw_prompts"], tags={"dagster/partition": shard})) == "SUCCESS"
        write_completions(store, good)
        write_completions(store, bad, stub=True)
        outcomes = {shard: dev.wait_for_run(dev.launch_run(["tokenized_samples"], tags={"dagster/partition": shard}))
                    for shard in (good, bad)}  # bad last: its evaluation is the latest
        assert outcomes == {good: "SUCCESS", bad: "FAILURE"}  # the blocking check fails the run
        yield dev, {"good": good, "bad": bad}


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    # Dagster shows a one-time "Join the Dagster community" dialog over the first page; mark it seen.
    context.add_init_script("window.localStorage.setItem('communityNux', '\"1\"')")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-final.png"), full_page=True)
    context.close()


def _goto(page: Page, url: str) -> None:
    page.goto(url, wait_until="domcontentloaded")
    skip = page.get_by_role("button", name="Skip")  # the community dialog, should it still appear
    if skip.count() and skip.first.is_visible():
        skip.first.click()


def _metadata_row(page: Page, label: str):
    """The row of ``label`` in a metadata table (its accessible name is "label value")."""
    return page.get_by_role("row", name=re.compile(rf"^{re.escape(label)}\s")).first


def test_asset_graph_shows_every_asset(ui, page):
    dev, _ = ui
    keys = sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys())
    groups = sorted({defs.resolve_asset_graph().get(dg.AssetKey(k)).group_name for k in keys})
    _goto(page, dev.url + "/asset-groups")
    expect(page.get_by_text("Global asset lineage")).to_be_visible()
    for group in groups:  # several groups: the graph opens with each collapsed to one node
        expect(page.get_by_text(group, exact=True).last).to_be_visible()
    page.keyboard.press("Alt+e")  # "Expand all groups" (the graph settings menu names the shortcut)
    for key in keys:  # a long name is middle-truncated in its node ("self_gene…_prompts"): its two ends
        expect(page.get_by_text(re.compile(rf"^{re.escape(key[:6])}.*{re.escape(key[-5:])}$")).first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "asset-graph.png"))


def test_partition_page_shows_its_metadata(ui, page):
    dev, shards = ui
    _goto(page, f"{dev.url}/assets/raw_prompts?view=partitions&partition={shards['bad']}")
    expect(page.get_by_text("Latest materialization")).to_be_visible()
    expect(_metadata_row(page, "num_prompts")).to_contain_text("10")
    expect(_metadata_row(page, "key")).to_contain_text(f"raw_prompts/{shards['bad']}.parquet")
    expect(_metadata_row(page, "shard")).to_contain_text(shards["bad"])
    page.screenshot(path=str(ARTIFACTS / "raw-prompts-partition.png"), full_page=True)


def test_empty_response_ratio_on_the_asset_page(ui, page):
    dev, _ = ui
    _goto(page, f"{dev.url}/assets/tokenized_samples?view=checks&checkDetail=empty_response_ratio")
    expect(page.get_by_text("This is a blocking asset check.")).to_be_visible()
    # The checks list: the latest evaluation (the stub partition) failed.
    entry = page.locator("div", has_text=re.compile(r"^empty_response_ratio\s*empty_response_ratio\s*Failed$")).last
    expect(entry).to_be_visible()
    expect(page.get_by_text(re.compile(r"10/10 samples \(100\.00%\) have < 16 supervised tokens")).first).to_be_visible()
    expect(_metadata_row(page, "ratio")).to_contain_text("1")
    expect(_metadata_row(page, "threshold")).to_contain_text("0.02")
    page.screenshot(path=str(ARTIFACTS / "empty-response-ratio.png"), full_page=True)

    page.get_by_role("tab", name="Execution history").click()
    expect(page.get_by_text("Passed", exact=True).first).to_be_visible()  # the partition with real answers
    expect(page.get_by_text(re.compile(r"0/10 samples \(0\.00%\)")).first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "empty-response-ratio-history.png"), full_page=True)


# --- the embedded default: backfills launched by clicking, generation on the embedded engine ---------------------


@pytest.fixture(scope="module")
def embedded_ui(tmp_path_factory):
    """dagster dev on the embedded default, with one-turn prompts ingested and their raw_prompts materialized."""
    root = tmp_path_factory.mktemp("embedded-ui")
    source = write_prompt_source(root / "prompts.jsonl", UI_PROMPTS)
    store = LocalStore(root / "store")
    env = {**EMBEDDED_DEFAULT_ENV, "DFLASH_PROMPT_SOURCE": str(source), "DFLASH_STORE": store.uri}
    with dagster_dev(root / "home", env=env) as dev:
        run = dev.launch_run(["prompt_corpus"], {"ops": {"prompt_corpus": {"config": {
            "limit": UI_PROMPTS, "max_prompts_per_shard": UI_SHARD_SIZE}}}})
        assert dev.wait_for_run(run) == "SUCCESS", dev.log_tail()
        shards = dev.instance().get_dynamic_partitions("prompt_shards")
        assert len(shards) == UI_PROMPTS // UI_SHARD_SIZE
        for shard in shards:
            assert dev.wait_for_run(dev.launch_run(["raw_prompts"], tags={"dagster/partition": shard})) == "SUCCESS"
        yield dev, store, shards


def _shot(page: Page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _launch_backfill_of_all_partitions(page: Page, shards: list[str], name: str) -> str:
    """In the open Materialize dialog: check it starts empty, pick All, launch; returns the backfill id."""
    dialog = page.get_by_role("dialog")
    launch = dialog.get_by_role("button", name="Launch backfill")
    expect(dialog.get_by_text("0 partitions", exact=True)).to_be_visible()
    expect(launch).to_be_disabled()
    _shot(page, f"{name}-1-dialog-opened")
    dialog.get_by_role("button", name="All", exact=True).click()
    expect(dialog.get_by_text(f"{len(shards)} partitions", exact=True)).to_be_visible()
    expect(launch).to_be_enabled()
    _shot(page, f"{name}-2-all-partitions")
    launch.click()
    toast = page.get_by_text(re.compile(r"Created backfill \w+"))
    expect(toast).to_be_visible()
    _shot(page, f"{name}-3-launched")
    return re.search(r"Created backfill (\w+)", toast.inner_text()).group(1)


def _embedded_engine_messages(instance, run_id: str) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id) if "embedded engine" in (e.user_message or "")]


def _assert_each_run_started_and_stopped_its_engine(instance, runs) -> None:
    for run in runs:
        messages = _embedded_engine_messages(instance, run.run_id)
        assert any(m.startswith("embedded engine ready at http://127.0.0.1:") for m in messages), messages
        assert any(m.startswith("embedded engine stopped") for m in messages), messages


def test_backfill_completions_from_the_asset_page(embedded_ui, page):
    dev, store, shards = embedded_ui
    _goto(page, dev.url + "/assets/completions")
    materialize = page.get_by_role("button", name=re.compile(r"Materialize…$")).first
    expect(materialize).to_be_visible()
    _shot(page, "completions-0-asset")
    materialize.click()
    backfill_id = _launch_backfill_of_all_partitions(page, shards, "completions")

    state = dev.wait_for_backfill(backfill_id, timeout_s=BACKFILL_TIMEOUT_S)
    assert state["status"] == "COMPLETED_SUCCESS", state
    [counts] = state["assetBackfillData"]["assetBackfillStatuses"]
    assert (counts["numPartitionsMaterialized"], counts["numPartitionsFailed"]) == (len(shards), 0), counts
    instance = dev.instance()
    runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
    assert sorted(r.tags["dagster/partition"] for r in runs) == shards
    assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [(r.run_id, r.status) for r in runs]
    assert {r.job_name for r in runs} == {"__ASSET_JOB"}  # what an asset page launches; see the module docstring
    _assert_each_run_started_and_stopped_its_engine(instance, runs)
    for shard in shards:  # one regenerated conversation per prompt of the shard
        prompts = store.read_parquet(f"raw_prompts/{shard}.parquet")
        assert store.read_parquet(f"completions/{shard}.parquet").num_rows == prompts.num_rows == UI_SHARD_SIZE

    _goto(page, f"{dev.url}/runs/b/{backfill_id}")
    expect(page.get_by_text("Succeeded", exact=True).first).to_be_visible()
    expect(page.get_by_role("link", name="completions")).to_be_visible()
    _shot(page, "completions-4-backfill-succeeded")


def _blocking_check_failures(instance, run_id: str) -> list[str]:
    """Step failures of a run that are blocking asset checks failing (the data's verdict, not the machinery's)."""
    out = []
    for event in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        error = event.dagster_event.event_specific_data.error
        out.append(error.cls_name if error is not None else "")
    return out


def test_backfill_of_a_job_from_its_page_runs_under_the_job(embedded_ui, page):
    dev, _, shards = embedded_ui
    _goto(page, f"{dev.url}/locations/dflash_assets/jobs/prepare_data_job")
    page.get_by_role("button", name=re.compile(r"Materialize all…$")).click()
    # raw_prompts reads self_generated_prompts (mixed in by weight, 0 here), which this job leaves out and nothing
    # has materialized: the UI asks first
    warning = page.get_by_role("dialog").filter(has_text="have not been materialized yet")
    expect(warning.get_by_text("self_generated_prompts", exact=True)).to_be_visible()
    warning.get_by_role("button", name="Confirm").click()
    backfill_id = _launch_backfill_of_all_partitions(page, shards, "prepare-data-job")

    state = dev.wait_for_backfill(backfill_id, timeout_s=BACKFILL_TIMEOUT_S)
    instance = dev.instance()
    runs = instance.get_runs(filters=dg.RunsFilter(job_name="prepare_data_job"))
    assert sorted(r.tags["dagster/partition"] for r in runs) == shards
    assert all(r.tags["dagster/backfill"] == backfill_id and r.tags["dflash/host_kind"] == "cpu" for r in runs)
    _assert_each_run_started_and_stopped_its_engine(instance, runs)
    run_ids = {r.run_id for r in runs}
    for asset in ("raw_prompts", "completions"):
        records = instance.fetch_materializations(dg.AssetKey(asset), limit=100).records
        assert {r.asset_materialization.partition for r in records if r.run_id in run_ids} == set(shards), asset
    # tokenized_samples is the data's verdict: a shard whose regenerated answers are too short fails its blocking
    # empty_response_ratio check (how often the tiny target does that is the demo's business, not the UI's);
    # a run may fail for that reason only.
    for run in runs:
        if run.status != dg.DagsterRunStatus.SUCCESS:
            assert _blocking_check_failures(instance, run.run_id) == ["DagsterAssetCheckFailedError"], run.run_id
    assert state["status"] == ("COMPLETED_SUCCESS" if all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
                               else "COMPLETED_FAILED"), state

    _goto(page, f"{dev.url}/locations/dflash_assets/jobs/prepare_data_job/runs")
    for run in runs:
        expect(page.get_by_role("link", name=run.run_id[:8])).to_be_visible()
    expect(page.get_by_role("link", name=backfill_id).first).to_be_visible()
    _shot(page, "prepare-data-job-4-runs")
