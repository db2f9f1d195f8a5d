"""`train --offline_dataset` checks the policy against the data before training on it (issue 54): stored completion
ids are mu's tokens, which another tokenizer reads as other text. From a user's folder with their own model (the
shared tool's Qwen2 with a byte-level BPE tokenizer)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from topr_trl.commands.cli import main
from topr_trl.offline import load_offline_dataset
from topr_trl.offline.schema import StoredTokensMismatch, check_stored_tokens

from .conftest import SHARED, work_in
from .launching import run_cli, user_data_flags


MAKER = SHARED / "tools" / "user_folder" / "make_user_folder.py"
TRAIN = [
    "--per_device_train_batch_size",
    "4",
    "--num_generations",
    "4",
    "--max_steps",
    "1",
    "--topr_unscored_batch",
    "train",
    "--topr_signal",
    "reward",
]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """A user's folder with 2 prompts x 4 completions sampled from their model by `topr-trl generate`, and a second
    model with the same tokenizer and other weights."""
    if not MAKER.is_file():
        pytest.skip(f"the shared user-folder tool is not beside the repository ({MAKER})")
    folder = tmp_path_factory.mktemp("offline-user")
    subprocess.run([sys.executable, str(MAKER), str(folder)], check=True, capture_output=True, timeout=600)
    completed = run_cli(
        [
            "generate",
            *user_data_flags("my-model", "data/prompts.jsonl"),
            "--num_generations",
            "4",
            "--max_prompts",
            "2",
            "--max_completion_length",
            "8",
            "--output_dir",
            "data-mu",
        ],
        folder,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(folder / "my-model")
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    other.save_pretrained(folder / "fine-tuned")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / "my-model" / name).exists():
            shutil.copy(folder / "my-model" / name, folder / "fine-tuned" / name)
    return folder


@pytest.fixture
def in_generated(generated, monkeypatch) -> Path:
    return work_in(generated, monkeypatch)


def one_line(stop: pytest.ExceptionInfo) -> str:
    text = str(stop.value.code)
    assert text.startswith("topr-trl: ") and "\n" not in text, text
    return text


def test_without_a_model_the_command_asks_for_the_one_that_sampled_the_data(in_generated):
    """Before, the built-in arithmetic model was taken, its accuracy printed, then training crashed on ids beyond its
    20-token vocabulary."""
    with pytest.raises(SystemExit) as stop:
        main(["train", "--offline_dataset", "data-mu", "--output_dir", "no-model", *TRAIN])
    message = one_line(stop)
    assert "--model_name_or_path" in message and str(in_generated / "my-model") in message
    assert not (in_generated / "no-model").exists()


def test_a_policy_with_another_tokenizer_is_refused_before_training(in_generated, tiny_model_path):
    """Before, another tokenizer trained on the stored ids with exit 0 (pi/mu about 0.007)."""
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "train",
                "--offline_dataset",
                "data-mu",
                "--model_name_or_path",
                tiny_model_path,
                "--output_dir",
                "other-tokenizer",
                *TRAIN,
            ]
        )
    message = one_line(stop)
    assert "completion_ids" in message and "another tokenizer" in message
    assert not (in_generated / "other-tokenizer").exists()


def test_another_model_with_mus_tokenizer_trains_and_is_said(in_generated, capsys):
    main(
        ["train", "--offline_dataset", "data-mu", "--model_name_or_path", "fine-tuned", "--output_dir", "other", *TRAIN]
    )
    said = capsys.readouterr().out
    assert "another model than mu" in said and "my-model" in said
    main(["train", "--offline_dataset", "data-mu", "--model_name_or_path", "my-model", "--output_dir", "same", *TRAIN])
    assert "another model than mu" not in capsys.readouterr().out


def test_the_check_reads_stored_ids_against_stored_text(generated):
    """The function itself: mu's tokenizer passes its own rows; a row whose ids were changed is named; ids beyond
    the vocabulary are reported, not decoded; text alone has nothing to check."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(generated / "my-model")
    data = load_offline_dataset(generated / "data-mu")
    check_stored_tokens(data, tokenizer)
    rows = data.to_list()
    rows[1]["completion_ids"] = [token + 1 for token in rows[1]["completion_ids"]]
    rows[2]["completion_ids"] = [len(tokenizer) + 5]
    with pytest.raises(StoredTokensMismatch, match=r"2 of the first 8 .* the first reads as '"):
        check_stored_tokens(Dataset.from_list(rows), tokenizer)
    with pytest.raises(StoredTokensMismatch, match="beyond its vocabulary"):
        check_stored_tokens(Dataset.from_list(rows[2:3]), tokenizer)
    check_stored_tokens(Dataset.from_list(rows).remove_columns("completion_ids"), tokenizer)
