import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from topr_trl.tasks.arithmetic import make_arithmetic_dataset  # noqa: E402
from topr_trl.tasks.tiny import build_model, build_tokenizer, save_pretrained  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
RUN_VLLM_TESTS = "bash scripts/test.sh --vllm"


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` run on a real engine; where vLLM is not installed they are skipped, and said so once."""
    if VLLM_INSTALLED:
        return
    skip = pytest.mark.skip(reason=f"vLLM is not installed here; run these with `{RUN_VLLM_TESTS}`")
    skipped = [item for item in items if "vllm" in item.keywords]
    for item in skipped:
        item.add_marker(skip)
    config.stash[_VLLM_SKIPPED] = len(skipped)


_VLLM_SKIPPED = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config):
    skipped = config.stash.get(_VLLM_SKIPPED, 0)
    if skipped:
        terminalreporter.write_line(f"{skipped} vLLM tests skipped: vLLM is not installed here; run them with "
                                    f"`{RUN_VLLM_TESTS}` (sets up .venv-vllm with vLLM's CPU build)")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A random-init tiny Qwen2 and character tokenizer saved to disk (loadable by path, no Hub)."""
    tokenizer = build_tokenizer()
    return str(save_pretrained(build_model(tokenizer, seed=0), tokenizer, tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def behaviour_model_path(tmp_path_factory) -> str:
    """A second tiny model with larger random weights, so its distribution is peaked where the policy's is
    nearly uniform: a behaviour policy mu far from pi, as a different model generating the data would be."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=123, initializer_range=0.5)
    return str(save_pretrained(model, tokenizer, tmp_path_factory.mktemp("behaviour")))


@pytest.fixture(scope="session")
def evidence_work_dir(tmp_path_factory) -> Path:
    """A work dir shared by the evidence scripts' slow tests, so the reasoning testbed's warm model (~2-3 min on
    one thread) is built once per session, under WORK_DIR/cache."""
    return tmp_path_factory.mktemp("evidence")


@pytest.fixture(scope="session")
def arithmetic_dataset():
    return make_arithmetic_dataset(16, digits=1, seed=0)


def small_config_kwargs(output_dir, **overrides) -> dict:
    """Settings shared by the trainer tests: a few CPU steps on tiny batches, nothing written or reported."""
    kwargs = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        seed=0,
    )
    kwargs.update(overrides)
    return kwargs


def logged_values(trainer, key) -> list[float]:
    """Every value logged under `key` (TRL logs an empty metric, NaN, as None)."""
    return [entry[key] for entry in trainer.state.log_history if entry.get(key) is not None]


def parity_reward(completions, **kwargs) -> list[float]:
    """+1 when the completion's character codes sum to an even number, else -1: a coin flip for a random-init
    model, so groups have reward variance and every update is non-trivial."""
    from topr_trl.evaluation.rewards import completion_text

    return [1.0 if sum(map(ord, completion_text(c))) % 2 == 0 else -1.0 for c in completions]


def saved_model_accuracy(model_dir, eval_prompts: int, adapter_dir=None) -> dict:
    """Greedy accuracy of a saved model (with a saved LoRA adapter on top, if given) on the built-in task's held-out
    set as the command line builds it (`--task_eval_prompts` problems, 2 digits, seed 2): what `topr-trl train`
    reports, recomputed independently of the run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.tasks.arithmetic import accuracy, make_arithmetic_dataset

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    held_out = make_arithmetic_dataset(eval_prompts, 2, seed=2)
    return accuracy(model, AutoTokenizer.from_pretrained(model_dir), held_out)


def script_refusal(main, argv, capsys) -> str:
    """The last line argparse prints when an evidence script refuses `argv` (exit status 2): its one-line error."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]
