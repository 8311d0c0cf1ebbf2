"""Run-config fields with few valid values are enums: the launchpad offers the choices, a run with another value
fails at launch naming the field, and the code versions hashed from the defaults did not move."""

import dagster as dg
import pytest

from dagster_project.assets.prompts import prompt_corpus
from dagster_project.config import DrafterEvalConfig, IngestConfig, TokenizeStageConfig
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
