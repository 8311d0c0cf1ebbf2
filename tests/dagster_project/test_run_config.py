"""Run-config fields with few valid values are enums: the launchpad offers the choices, a run with another value
fails at launch naming the field, and the code versions hashed from the defaults did not move. Bounded fields and
the prompt mix's weights fail naming the field and value."""

import dagster as dg
import pytest
from pydantic import ValidationError

from dagster_project.assets.prompts import prompt_corpus
from dagster_project.config import DrafterEvalConfig, IngestConfig, PromptMixConfig, TokenizeStageConfig
from dagster_project.resources import StoreResource
from dagster_project.versions import code_version
from dflash_assets.tokenization.samples import SUPERVISE_MODES


@pytest.mark.parametrize("config,field,choices", [
    (IngestConfig, "leading_assistant", {"drop", "quarantine"}),
    (TokenizeStageConfig, "supervise", set(SUPERVISE_MODES)),
    (DrafterEvalConfig, "dtype", {"float32", "bfloat16", "float16"}),
])
def test_the_config_schema_offers_the_choices(config, field, choices):
    field_type = config.to_fields_dict()[field].config_type
    enum_type = field_type.inner_type if field_type.kind.name == "NONEABLE" else field_type
    assert enum_type.kind.name == "ENUM"
    assert {v.config_value for v in enum_type.enum_values} == choices


def test_a_value_outside_the_choices_fails_at_launch_naming_the_field(tmp_path):
    config = {"ops": {"prompt_corpus": {"config": {"leading_assistant": "keep"}}}}
    with pytest.raises(dg.DagsterInvalidConfigError, match="leading_assistant.*keep|keep.*leading_assistant"):
        dg.materialize([prompt_corpus], resources={"store": StoreResource(uri=str(tmp_path / "store"))},
                       run_config=config)
    assert not (tmp_path / "store").exists()  # nothing ran


def test_the_library_gets_plain_strings_and_the_code_versions_are_unchanged():
    assert TokenizeStageConfig(supervise="every_turn").to_library().supervise == "every_turn"
    assert type(IngestConfig().to_library().leading_assistant) is str
    # the code versions hash the defaults: an enum default hashes as its value, as the str default did
    assert code_version("1", IngestConfig) == "1-929e08c0"
    assert code_version("1", TokenizeStageConfig) == "1-f4a11cc7"


def test_the_eval_payload_holds_the_plain_dtype_name():
    dumped = DrafterEvalConfig(dtype="bfloat16").model_dump()["dtype"]
    assert dumped == "bfloat16" and type(dumped) is str  # what the GPU host's torch_dtype reads


@pytest.mark.parametrize("config,values,named", [
    (PromptMixConfig, {"weights": {"web": 1.0}}, "unknown prompt sources.*web"),
    (PromptMixConfig, {"weights": {"self_generated": -0.5}}, "weights must be >= 0"),
    (PromptMixConfig, {"weights": {"corpus": 2.0}}, "corpus's weight is the unit"),
    (IngestConfig, {"max_prompts_per_shard": 0}, "max_prompts_per_shard"),
    (IngestConfig, {"limit": 0}, "limit"),
])
def test_a_run_config_out_of_bounds_fails_naming_the_field(config, values, named):
    with pytest.raises(ValidationError, match=named) as e:
        config(**values)
    assert next(iter(values)) in str(e.value)


def test_a_mix_in_bounds_is_kept_as_given():
    assert PromptMixConfig(weights={"corpus": 1.0, "self_generated": 0.25}).checked() == {"self_generated": 0.25}
    assert IngestConfig(limit=None).to_library().limit is None
