"""The library's settings read from the environment: defaults, precedence, blank values."""

from pathlib import Path

import pytest

from dflash_assets import settings
from dflash_assets.cache_keys import default_cache_root
from dflash_assets.store.backends import default_store_uri

NAMES = ("DFLASH_CACHE", "DFLASH_STORE", "DAGSTER_HOME", "AWS_ENDPOINT_URL", "DFLASH_TARGET_MODEL", "DFLASH_TARGET")


@pytest.fixture
def env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_cache_root_defaults_under_home_and_expands_a_user_path(env, tmp_path):
    assert settings.cache_root() == Path.home() / ".cache" / "dflash-assets"
    env.setenv("DFLASH_CACHE", "  ")  # blank reads as unset
    assert settings.cache_root() == Path.home() / ".cache" / "dflash-assets"
    env.setenv("DFLASH_CACHE", "~/x")
    assert settings.cache_root() == Path.home() / "x"
    env.setenv("DFLASH_CACHE", str(tmp_path))
    assert default_cache_root() == settings.cache_root() == tmp_path


def test_store_uri_prefers_the_store_then_dagster_home_then_the_working_directory(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert settings.store_uri() == str(tmp_path / ".dflash" / "store")
    env.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    assert settings.store_uri() == str(tmp_path / "home" / "dflash-store")
    env.setenv("DFLASH_STORE", "s3://bucket/root")
    assert default_store_uri() == settings.store_uri() == "s3://bucket/root"


def test_endpoint_and_target(env):
    assert settings.s3_endpoint_url() is None and settings.target_model() is None
    env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    env.setenv("DFLASH_TARGET_MODEL", " /models/t ")
    assert settings.s3_endpoint_url() == "http://127.0.0.1:9000"
    assert settings.target_model() == "/models/t"


def test_the_legacy_target_name_alone_is_reported(env):
    env.setenv("DFLASH_TARGET", "/models/t")
    assert settings.legacy_target_only()
    env.setenv("DFLASH_TARGET_MODEL", "/models/t")
    assert not settings.legacy_target_only()
