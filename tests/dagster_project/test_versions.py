"""Code versions follow the configuration that changes outputs, so Dagster can mark partitions stale."""

import json
import os
import subprocess
import sys

import dagster as dg
from pydantic import Field

from dagster_project.versions import code_version


def _code_versions(env: dict) -> dict:
    code = ("import json; from dagster_project.definitions import defs; "
            "g = defs.resolve_asset_graph(); "
            "print(json.dumps({k.to_user_string(): g.get(k).code_version for k in g.get_all_asset_keys()}))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_target_change_changes_the_target_dependent_stages_only(tmp_path):
    default = _code_versions({"DFLASH_TARGET_MODEL": ""})
    other = _code_versions({"DFLASH_TARGET_MODEL": str(tmp_path / "Qwen3.6-27B")})
    changed = {k for k in default if default[k] != other[k]}
    assert {"completions", "tokenized_samples", "hidden_state_cache", "drafter_checkpoint", "drafter_eval"} <= changed
    assert not changed & {"prompt_corpus", "raw_prompts"}


def test_config_defaults_are_part_of_the_version():
    class A(dg.Config):
        temperature: float = Field(default=0.6)

    class B(dg.Config):
        temperature: float = Field(default=0.7)

    assert code_version("1", A) != code_version("1", B)
    assert code_version("1", A) == code_version("1", A)  # stable across calls
    assert code_version("1", A) != code_version("2", A)


def test_a_field_that_does_not_change_the_output_is_not_part_of_the_version():
    """How many processes share an evaluation changes its wall time, not its result: no partition goes stale."""
    class A(dg.Config):
        temperature: float = Field(default=0.6)

    class B(dg.Config):
        temperature: float = Field(default=0.6)
        workers: int = Field(default=4, json_schema_extra={"output": False})

    B.__name__ = A.__name__  # the class name is part of the version too
    assert code_version("1", A) == code_version("1", B)
    from dagster_project.config import DrafterEvalConfig
    assert DrafterEvalConfig.model_fields["workers"].json_schema_extra == {"output": False}


def test_the_target_part_is_the_spec_fingerprint_of_what_the_settings_name(tmp_path, monkeypatch):
    """The same settings naming a file whose content changed give another version: the spec's fingerprint hashes
    the template (and the model's config), not the variables' values; a layer choice changes it too."""
    from dagster_project.versions import target_fingerprint

    template = tmp_path / "chat_template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setenv("DFLASH_TARGET_CHAT_TEMPLATE", str(template))
    before = target_fingerprint()
    assert target_fingerprint() == before  # stable
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    after = target_fingerprint()
    assert after != before
    monkeypatch.setenv("DFLASH_TARGET_LAYER_IDS", "1,2,3")
    assert target_fingerprint() not in (before, after)
    assert code_version("1", target=True) != code_version("1")
