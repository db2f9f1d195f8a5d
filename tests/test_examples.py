"""Every shipped recipe validates (dry run, no model loaded); launch configs and DeepSpeed JSONs are well-formed."""

import json
import re
from pathlib import Path

import pytest
import yaml

from topr_trl.commands.cli import main


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def documented_command(recipe: Path) -> str:
    """The subcommand in the recipe's own usage line (`... -m topr_trl iterate --config ...`)."""
    match = re.search(
        r"(?:-m topr_trl|topr-trl) (\w+) --config " + re.escape(f"examples/recipes/{recipe.name}"), recipe.read_text()
    )
    assert match, f"{recipe.name} has no usage line naming its subcommand"
    return match.group(1)


@pytest.mark.parametrize("recipe", sorted((EXAMPLES / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_recipe_validates(recipe, capsys):
    # GPU recipes ask for bf16 and vLLM, which TrainingArguments refuses on a CPU-only machine: the dry run turns
    # those off, says so, and validates everything else.
    main([documented_command(recipe), "--config", str(recipe), "--dry_run", "true"])
    assert "configuration valid" in capsys.readouterr().out


@pytest.mark.parametrize("config", sorted((EXAMPLES / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_config_is_well_formed(config):
    settings = yaml.safe_load(config.read_text())
    assert settings["distributed_type"] in {"NO", "MULTI_GPU", "DEEPSPEED", "FSDP"}
    assert settings["num_processes"] >= 1
    if settings["distributed_type"] == "DEEPSPEED":
        ds_file = EXAMPLES.parent / settings["deepspeed_config"]["deepspeed_config_file"]
        stage = json.loads(ds_file.read_text())["zero_optimization"]["stage"]
        assert f"zero{stage}" in config.name


def test_misspelt_recipe_key_is_rejected(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("task: arithmetic\nloss_typee: sft\n")
    with pytest.raises(SystemExit) as error:
        main(["train", "--config", str(recipe), "--dry_run", "true"])
    assert "loss_typee" in str(error.value)
