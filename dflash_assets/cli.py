"""The ``dflash`` command line (argparse; one subcommand per module, more get added).

``dflash engine``: prints, or starts on this host (``--start``), the server
that generates completions for the target:

- ``--kind sglang`` (default when a target is given): ``python -m
  sglang.launch_server --model-path ... --port ... --tp ... --host 127.0.0.1
  --reasoning-parser qwen3`` (no parser for a target whose template has no
  thinking mode, e.g. SmolLM2); reach it with endpoint kind ``sglang``.
  SGLang needs a CUDA host (``pip install 'dflash-assets[sglang]'``).
- ``--kind transformers`` (default with no target, the embedded default):
  ``transformers serve <tiny target dir> --host 127.0.0.1 --port N``, which
  pins and preloads that model; endpoint kind ``openai``.

Target: ``--target``, else ``$DFLASH_TARGET_MODEL`` (the same variable the
``target`` resource reads), else the tiny dense target
(random weights, built locally). ``--start`` waits until the server is healthy
and serves the target, prints one JSON line ``{"ready": url, "pid", "endpoint"}``,
then stays in the foreground (Ctrl-C stops the server) or, with ``--detach``,
returns and leaves it running. Reads/writes nothing but the optional log file.

``dflash plan``: prints the corpus's cost plan for given numbers
(``dflash_assets.planning.costs``): generation wall time, hidden-state cache bytes,
capture and training GPU-hours, offline or online, e.g. ``dflash plan
--conversations 914000 --tokens-per-sample 3000 --target qwen3.6-27b --budget-tb 50``.

``dflash inspect CHECKPOINT``: prints a drafter checkpoint's ``provenance.json``
(``dflash_assets.drafter.provenance``): a checkpoint directory, or ``dflash inspect STORE_URI --recipe
NAME`` for the recipe's published checkpoint (``--json``: the raw record). Reads only.

``dflash bundle SRC OUT [--part-size 1G]`` and ``dflash unbundle BUNDLE DEST``: a file or directory (a model,
a checkpoint, a store) as checksummed parts and a manifest, for a host with no network
(``dflash_assets.bundle``).

Adding a subcommand: write ``_add_<name>(subparsers)`` that sets
``func=<callable(args) -> int>`` and append it to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
from typing import Callable

from dflash_assets import settings

__all__ = ["main", "build_parser", "SUBCOMMANDS"]


def _add_engine(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="print or start the generation server for the target",
                       description="Print, or start on this host (--start), the server that generates completions "
                       "for the target: SGLang (the default when a target is given; it needs a CUDA host) or "
                       "transformers serve (the default for the embedded tiny target), bound to 127.0.0.1 unless "
                       "--host says otherwise.")
    p.add_argument("--kind", choices=["sglang", "transformers"], default=None,
                   help="server to run (default: sglang with a target, transformers for the embedded default)")
    p.add_argument("--target", default=None, help="model path or id (default: $DFLASH_TARGET_MODEL, else the tiny target)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 30000 (sglang) / 8000 (transformers); 0: a free port")
    p.add_argument("--tp", type=int, default=1, help="sglang tensor parallel size (GPUs per server)")
    p.add_argument("--served-model-name", default=None, help="sglang: name to serve the target under")
    p.add_argument("--start", action="store_true", help="start it on this host and wait until healthy")
    p.add_argument("--detach", action="store_true", help="with --start: return once ready, leave the server running")
    p.add_argument("--wait-s", type=float, default=600.0, help="with --start: give up after this many seconds")
    p.add_argument("--log", default=None, help="with --start: append the server's output to this file")
    p.add_argument("--max-concurrency", type=int, default=None, help="max_concurrency of the printed endpoint config")
    p.add_argument("--json", action="store_true", help="print the command as JSON (argv, url, endpoint config)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra arguments for the server")
    p.set_defaults(func=_run_engine)


def _reasoning_parser(target: str) -> str | None:
    """SGLang's `qwen3` reasoning parser for a target whose template has a thinking mode; none for one without
    (SmolLM2). A target whose template cannot be read here (e.g. only on the GPU host) keeps `qwen3`."""
    from dflash_assets.target_model.conventions import TargetModelError
    from dflash_assets.target_model.spec import TargetModelSpec

    try:
        return "qwen3" if TargetModelSpec(model_path=target).chat_conventions().thinking_supported else None
    except TargetModelError:
        return "qwen3"


def _run_engine(args: argparse.Namespace) -> int:
    from dflash_assets.embedded.defaults import embedded_engine_server
    from dflash_assets.generation.server import local_engine_server

    if settings.legacy_target_only() and not args.target:
        print("DFLASH_TARGET is not read: set DFLASH_TARGET_MODEL (the name every part of dflash-assets reads), "
              "or pass --target", file=sys.stderr)
        return 2
    target = args.target or settings.target_model()
    kind = args.kind or ("sglang" if target else "transformers")
    extra = [a for a in (args.extra or []) if a != "--"]
    options = dict(port=args.port, host=args.host, tp=args.tp, served_model_name=args.served_model_name,
                   log_path=args.log, extra_args=extra)
    if target is not None and kind == "sglang":
        options["reasoning_parser"] = _reasoning_parser(target)
    server = (local_engine_server(kind, target, **options) if target is not None
              else embedded_engine_server(kind, **options))  # the tiny target, in float32 on CPU
    ep = server.endpoint_config(args.max_concurrency)
    endpoint = {"url": ep.url, "kind": ep.kind, "max_concurrency": ep.max_concurrency}
    if not args.start:
        if args.json:
            print(json.dumps({"argv": server.argv, "command": server.command, "url": server.url,
                              "target_model": server.expect_model, "endpoint": endpoint}))
        else:
            print(server.command)
        return 0
    if kind == "sglang" and importlib.util.find_spec("sglang") is None:
        print("SGLang is not installed on this host. On a GPU host: pip install 'dflash-assets[sglang]', then:\n"
              f"  {server.command}", file=sys.stderr)
        return 2
    print(f"starting: {server.command}", file=sys.stderr, flush=True)
    try:
        server.start(wait_s=args.wait_s, detach=args.detach)
    except (RuntimeError, TimeoutError) as e:
        print(f"engine failed to start: {e}", file=sys.stderr)
        return 1
    assert server.proc is not None
    print(json.dumps({"ready": server.url, "pid": server.proc.pid, "kind": kind, "target_model": server.expect_model,
                      "endpoint": endpoint}), flush=True)
    if args.detach:
        return 0

    def forward(signum, _frame):  # stop the server with us
        server.stop()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return server.proc.wait()


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from dflash_assets.planning import costs

    p = sub.add_parser("plan", help="print the cost plan (generation, cache bytes, GPU-hours) for given numbers",
                       description=costs.__doc__.split("\n\n")[0])
    costs.add_arguments(p)
    p.set_defaults(func=costs.run)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print a drafter checkpoint's provenance (provenance.json)",
                       description="Print what made a drafter checkpoint: prompt sources, partitions, target "
                       "identity, completions' engines and sampling, recipe, code versions, decontamination.")
    p.add_argument("checkpoint", help="a checkpoint directory (or its provenance.json), or a store URI with --recipe")
    p.add_argument("--recipe", help="the recipe whose published checkpoint to read from the store URI")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.set_defaults(func=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    from dflash_assets.drafter.provenance import format_provenance, read_provenance

    try:
        if args.recipe:
            from dflash_assets.store.backends import open_store

            doc = read_provenance(store=open_store(args.checkpoint), recipe=args.recipe)
        else:
            doc = read_provenance(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        print(f"dflash inspect: {e}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else format_provenance(doc))
    return 0


def _add_bundle(sub: argparse._SubParsersAction) -> None:
    from dflash_assets import bundle

    p = sub.add_parser("bundle", help="write a file or directory as checksummed parts and a manifest",
                       description=bundle.__doc__.split("\n\n")[0])
    p.add_argument("src", help="the file or directory to ship (a model directory, a checkpoint, a store)")
    p.add_argument("out", help="an empty (or new) directory for the parts and manifest.json")
    p.add_argument("--part-size", default="1G", type=bundle.parse_size,
                   help="the largest part (default 1G; e.g. 40M for a transfer capped at 50 MB a file)")
    p.set_defaults(func=_bundle)
    p = sub.add_parser("unbundle", help="check a bundle's parts and extract it",
                       description="Check every part of a bundle against its manifest, extract it beside DEST, "
                       "check every file, then move it into DEST/<name>.")
    p.add_argument("bundle", help="the directory holding manifest.json and the parts")
    p.add_argument("dest", help="where the bundled file or directory goes (as DEST/<its name>)")
    p.set_defaults(func=_unbundle)


def _bundle(args: argparse.Namespace) -> int:
    from dflash_assets.bundle import BundleError, bundle_path

    try:
        manifest = bundle_path(args.src, args.out, args.part_size)
    except (BundleError, FileNotFoundError, ValueError) as e:
        print(f"dflash bundle: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"bundle": args.out, "files": len(manifest["files"]), "parts": len(manifest["parts"]),
                      "bytes": manifest["bytes"]}))
    return 0


def _unbundle(args: argparse.Namespace) -> int:
    from dflash_assets.bundle import BundleError, unbundle

    try:
        path = unbundle(args.bundle, args.dest)
    except (BundleError, FileExistsError) as e:
        print(f"dflash unbundle: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"unbundled": str(path)}))
    return 0


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_engine, _add_plan, _add_inspect,
                                                                    _add_bundle]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="dflash-assets: data and training pipeline for "
                                     "DFlash speculative-decoding drafters.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
