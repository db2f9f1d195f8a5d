"""The lab's fixtures: what the experiments' tests share (a tiny model and a second one to play mu, a work dir that
keeps the reasoning testbed's warm model for the session, an evidence script's one-line refusal)."""

import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from topr_trl.tasks.tiny import build_model, build_tokenizer, save_pretrained  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A random-init tiny Qwen2 and character tokenizer saved to disk (loadable by path, no Hub)."""
    tokenizer = build_tokenizer()
    return str(save_pretrained(build_model(tokenizer, seed=0), tokenizer, tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def behaviour_model_path(tmp_path_factory) -> str:
    """A second tiny model with larger random weights: a behaviour policy mu far from pi."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=123, initializer_range=0.5)
    return str(save_pretrained(model, tokenizer, tmp_path_factory.mktemp("behaviour")))


@pytest.fixture(scope="session")
def evidence_work_dir(tmp_path_factory) -> Path:
    """A work dir shared by the evidence scripts' tests, so the reasoning testbed's warm model (~2-3 min on one
    thread) is built once per session, under WORK_DIR/cache."""
    return tmp_path_factory.mktemp("evidence")


def script_refusal(main, argv, capsys) -> str:
    """The last line argparse prints when an evidence script refuses `argv` (exit status 2): its one-line error."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]
