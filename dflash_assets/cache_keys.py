"""Keys of on-disk caches: a hash of what builds the cached artifact, never a hand-bumped version string.

Every cache under the cache root (`$DFLASH_CACHE`, else `~/.cache/dflash-assets`) is
keyed by `build_fingerprint(...)`, a SHA-256 over:

- the bytes of the builder modules and of every `dflash_assets` module they import,
  directly or transitively (found by parsing their `import` statements, those inside
  functions included, plus the `__init__.py` of every package on the way; `project_modules`),
- the bytes of the input data files (the ShareGPT file, the tiktoken ranks, a template),
- the build settings (as JSON),
- the installed versions of the libraries that shape the built bytes (torch,
  transformers, tokenizers, ...).

Change any of them and the key changes, so a cache built by other code or from other
data is never reused. (A version string bumped by hand went stale: a changed builder
kept its key, passed on machines with an old cache and failed on a fresh one.)

Hashing the 125 MB ShareGPT file takes ~0.5-1 s, so file digests are memoized in
`<cache root>/fingerprints/files.json`, keyed by path, size, mtime and inode (what git's
index does): a warm process pays a `stat`, not a hash. The memo is written atomically;
a missing or unreadable memo only costs a re-hash.

Reads the modules and files named; writes only that memo.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from dflash_assets import settings
from dflash_assets.atomic_write import write_atomic

PACKAGE = "dflash_assets"
PACKAGE_DIR = Path(__file__).resolve().parent  # where `dflash_assets.<name>` sources are read from


def default_cache_root() -> Path:
    """Cache root shared by dflash-assets: `$DFLASH_CACHE`, else `~/.cache/dflash-assets` (:mod:`dflash_assets.settings`)."""
    return settings.cache_root()


@dataclass(frozen=True)
class Fingerprint:
    """A cache key (`digest`, 16 hex chars) and what it was computed from (`inputs`, JSON-serializable)."""

    digest: str
    inputs: dict[str, Any]


def build_fingerprint(*, modules: Sequence[str] = (), files: Iterable[str | os.PathLike] = (),
                      settings: Any = None, packages: Sequence[str] = ()) -> Fingerprint:
    """Fingerprint of a build from its builder `modules` (and their project imports), input `files`,
    `settings` (anything `json.dumps` takes with `default=str`) and the versions of `packages`."""
    inputs = {
        "modules": {name: _file_digest(path, memo=False) for name, path in project_modules(modules).items()},
        "files": {str(Path(f)): file_digest(f) for f in files},
        "settings": json.loads(json.dumps(settings, sort_keys=True, default=str)),
        "packages": {name: package_version(name) for name in sorted(packages)},
    }
    return Fingerprint(content_key(inputs), inputs)


def content_key(value: Any, *, length: int = 16, default: Callable[[Any], Any] | None = None) -> str:
    """The first `length` hex chars of the SHA-256 of `value` as `json.dumps(value, sort_keys=True,
    default=default)`: the one key of a JSON-able config or signature (its bytes are the contract: a stored key
    stays valid only while this serialization does)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=default).encode()).hexdigest()[:length]


def package_version(name: str) -> str:
    """Installed version of distribution `name`, or "absent"."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def project_modules(roots: Iterable[str]) -> dict[str, Path]:
    """`roots` and every `dflash_assets` module they import, transitively: {module name: source file}.

    Imports are read from the source (`ast`), not executed, so a function-local
    `from dflash_assets.x import y` counts like a top-level one.
    """
    found: dict[str, Path] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = _module_file(name)
        if path is None:  # e.g. `from dflash_assets.target_model.tokenizer import nfc` names an attribute, not a module
            continue
        found[name] = path
        st = path.stat()
        todo += _imported_names(name, str(path), st.st_size, st.st_mtime_ns)
        todo += [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]  # parent packages run on import
    return dict(sorted(found.items()))


def _module_file(name: str) -> Path | None:
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    parts = name.split(".")[1:]
    base = PACKAGE_DIR.joinpath(*parts)
    for candidate in (base.with_suffix(".py") if parts else None, base / "__init__.py"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=256)
def _imported_names(module: str, path: str, size: int, mtime_ns: int) -> tuple[str, ...]:
    """Module names (and `module.attr` candidates) imported anywhere in `path` (memoized by size and mtime)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(Path(path).read_bytes(), filename=path)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return tuple(n for n in names if n == PACKAGE or n.startswith(PACKAGE + "."))


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of the file's bytes, memoized on disk by (path, size, mtime, inode)."""
    return _file_digest(Path(path), memo=True)


def _file_digest(path: Path, *, memo: bool) -> str:
    path = Path(path).resolve()
    if not memo:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    memo_path = default_cache_root() / "fingerprints" / "files.json"
    table = _read_memo(memo_path)
    entry = table.get(str(path))
    if entry and entry.get("stamp") == stamp:
        return entry["sha256"]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    table = _read_memo(memo_path)  # re-read: another process may have added entries meanwhile
    table[str(path)] = {"stamp": stamp, "sha256": digest}
    _write_memo(memo_path, table)
    return digest


def _read_memo(path: Path) -> dict[str, dict]:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _write_memo(path: Path, table: dict[str, dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(table, sort_keys=True))
    except OSError:  # a read-only cache root: the memo is an optimization only
        pass


@contextlib.contextmanager
def build_lock(path: Path):
    """An exclusive advisory lock on `path` while one process builds a cache entry (a no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent builders just race; the rename keeps that safe
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
