"""A recipe is checked where it is read: a stored JSON with a bad value or an unknown field fails at load, naming
each field, its value and what is allowed; the fingerprints of existing recipes stay what they were."""

import json

import pytest

from dflash_assets.demo import demo_recipe
from dflash_assets.drafter.recipe import DrafterRecipe, RecipeError
from dflash_assets.store.backends import LocalStore

SHARDS = ["shard-00000", "shard-00001", "shard-00002"]
# Fingerprints recorded with the recipe code before the fields were checked by pydantic: the work dirs and
# checkpoints of these recipes are found again. The values are kept as given (an int lr stays an int in the hash).
# A stored recipe names its objective, or reads as dflash.
RECORDED = {
    "demo": ({**demo_recipe(SHARDS).to_dict(), "objective": "dflash"}, "402ea7012389e60f"),
    "smollm2-study": ({"name": "smollm2-study", "block_size": 16, "num_layers": 5, "epochs": 30, "lr": 1e-3,
                       "max_length": 2048, "max_anchors": 512, "batch_size": 48, "weight_decay": 0.0,
                       "partitions": SHARDS, "online": True, "save_every": 600, "compile": False,
                       "checkpoint_dtype": "float32"}, "b961333a4d792434"),
    "default": ({"name": "qwen36-27b-v1"}, "afeaeb745bdc1144"),
    "json-ints": ({"name": "tiny-v1", "lr": 1, "grad_clip": 2, "weight_decay": 0, "partitions": ["a", "b"],
                   "target_layer_ids": [1, 3], "mask_token_id": 5, "gamma": 7}, "0ae3187dee630a69"),
    "dpace": ({"name": "d-v2", "objective": "dpace", "dpace_alpha": 0.25, "cache_limit_gb": 2.5, "family": "q"},
              "5512d0cc056bac77"),
    "early-stop": ({"name": "e-v1", "early_stop_patience": 3, "tau_every": 10, "init_from": "promoted",
                    "attention": "sdpa", "compile": False, "save_every": 7}, "b67c515c49ec4d2a"),
}


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_existing_recipes_keep_their_fingerprints(case):
    stored, fingerprint = RECORDED[case]
    recipe = DrafterRecipe.from_dict(json.loads(json.dumps(stored)))
    assert recipe.fingerprint() == fingerprint
    assert DrafterRecipe.from_dict(json.loads(json.dumps(recipe.to_dict()))).fingerprint() == fingerprint


def test_a_stored_recipe_with_bad_values_fails_at_load_naming_each(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.write_json("drafter_recipes/demo-v9.json", {**demo_recipe(SHARDS).to_dict(), "name": "demo-v9",
                                                      "attention": "flx", "block_size": 0, "colour": "red"})
    with pytest.raises(RecipeError) as e:
        DrafterRecipe.from_dict(store.read_json("drafter_recipes/demo-v9.json"))
    message = str(e.value)
    assert message.startswith("recipe 'demo-v9': ")
    assert "attention must be one of auto, flex, sdpa, got 'flx'" in message  # not the dense-mask path in silence
    assert "block_size: input should be greater than or equal to 2, got 0" in message
    assert "colour: unknown field (a recipe has name, version, block_size," in message


@pytest.mark.parametrize("field,value,expected", [
    ("checkpoint_dtype", "fp8", "checkpoint_dtype must be one of bfloat16, float32, float16, got 'fp8'"),
    ("objective", "domino", "objective must be one of dflash, dpace, got 'domino'"),
    ("init_from", "latest", "init_from must be one of promoted, got 'latest'"),
    ("lr", 0, "lr: input should be greater than 0, got 0"),
    ("epochs", -1, "epochs: input should be greater than or equal to 1, got -1"),
    ("warmup_ratio", 1.0, "warmup_ratio: input should be less than 1, got 1.0"),
    ("dpace_alpha", 1.5, "dpace_alpha: input should be less than or equal to 1, got 1.5"),
    ("block_size", "16", "block_size: input should be a valid integer, got '16'"),  # strict: no string coercion
    ("online", "yes", "online: input should be a valid boolean, got 'yes'"),
])
def test_each_bad_value_names_the_field_value_and_what_is_allowed(field, value, expected):
    with pytest.raises(RecipeError, match="^recipe 'r': .*" + expected.replace("(", r"\(").replace(")", r"\)")):
        DrafterRecipe.from_dict({"name": "r", field: value})


def test_a_recipe_built_in_python_is_checked_too():
    with pytest.raises(RecipeError, match="attention must be one of auto, flex, sdpa, got 'flex_attention'"):
        DrafterRecipe(name="r", attention="flex_attention")
    assert DrafterRecipe(name="r", block_size=2, attention="flex").block_size == 2
