import importlib.util
import os
import sys


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


def pytest_terminal_summary(terminalreporter, config):
    # counted from the reports, which reach the main process also when workers (pytest-xdist) collected the tests
    reports = terminalreporter.stats.get("skipped", [])
    skipped = sum("vLLM is not installed here" in str(report.longrepr) for report in reports)
    if skipped:
        terminalreporter.write_line(
            f"{skipped} vLLM tests skipped: vLLM is not installed here; run them with "
            f"`{RUN_VLLM_TESTS}` (sets up .venv-vllm with vLLM's CPU build)"
        )


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


def small_trainer(model, reward_funcs, train_dataset, output_dir, **overrides):
    """A TOPRTrainer of `model` on `train_dataset`, configured by `small_config_kwargs(output_dir, **overrides)`."""
    from topr_trl import TOPRConfig, TOPRTrainer

    args = TOPRConfig(**small_config_kwargs(output_dir, **overrides))
    return TOPRTrainer(model=model, reward_funcs=reward_funcs, train_dataset=train_dataset, args=args)


FLOAT32_EPS = 2.0**-23  # torch.finfo(torch.float32).eps = 1.19e-7: one rounding, relative


def float32_tolerance(expected, roundings: int, scale: float | None = None) -> dict:
    """`rtol` and `atol` (for torch.allclose, torch.testing.assert_close) between `expected` and the same quantity
    computed in float32 by another path (packed against padded, batched against one at a time, other kernels, ISA or
    thread counts), derived from what float32 can promise rather than from what one CPU happened to give.

    Each of `roundings` rounding steps on the way (a stage of a forward or backward pass, a reduction summed in
    another order) can move a result by about eps relative to the largest magnitude it was computed from; the caller
    states the count and where it comes from. So the tolerance is `roundings * eps` relative to each entry (`rtol`),
    plus the same relative to the largest entry (`atol`): an entry far smaller than the largest (a gradient entry
    near 0, a log-prob near 0) is a sum of terms as large as the largest ones, and carries their rounding, not its
    own (`scale` replaces max |expected| where the results come from larger values the caller knows of). A real bug
    (a wrong aggregation, a sample weighted or masked wrongly) moves results by a fraction of their size, orders of
    magnitude above this while `roundings` stays far below 1 / eps."""
    import torch

    bound = roundings * FLOAT32_EPS
    largest = torch.as_tensor(expected if scale is None else scale).detach().abs().max().item()
    return {"rtol": bound, "atol": bound * largest}


def logged_values(trainer, key) -> list[float]:
    """Every value logged under `key` (TRL logs an empty metric, NaN, as None)."""
    return [entry[key] for entry in trainer.state.log_history if entry.get(key) is not None]


# The smallest and largest sequence ratio pi/mu of each logged step, on the positive and the negative samples.
RATIO_EXTREMES = tuple(f"topr/ratio_{branch}/{end}" for branch in ("positive", "negative") for end in ("min", "max"))


def ratio_extremes(log_history: list[dict]) -> list[float]:
    """Every value logged under RATIO_EXTREMES in `log_history` (a trainer state's), key by key."""
    return [entry[key] for key in RATIO_EXTREMES for entry in log_history if entry.get(key) is not None]


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


def cli_refusal(argv: list[str]) -> str:
    """The one line `topr-trl ARGV` stops with (checked to be one line starting `topr-trl: `)."""
    from topr_trl.commands.cli import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    text = str(stop.value.code)
    assert text.startswith("topr-trl: ") and "\n" not in text, text
    return text


def script_refusal(main, argv, capsys) -> str:
    """The last line argparse prints when an evidence script refuses `argv` (exit status 2): its one-line error."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def reasoning_model(tmp_path_factory) -> str:
    """The built-in reasoning model (shipped weights, head size 32: vLLM's CPU attention refuses 16), for the tests on
    a real vLLM engine."""
    from topr_trl.commands.arguments import TaskArguments
    from topr_trl.tasks.loading import builtin_model

    options = TaskArguments(task_digits=3, base_model_dir=str(tmp_path_factory.mktemp("reasoning")))
    return str(builtin_model("reasoning", options, seed=0))


# A user's reward module: scores a completion by its first character, and records the prompts it was asked to score
# so that a test can tell which data a run trained on.
REWARD_MODULE = """
import json, os

def correctness(prompts, completions, answer, **kwargs):
    with open(os.environ["SEEN_PROMPTS"], "a") as seen:
        seen.write(json.dumps(list(prompts)) + "\\n")
    return [1.0 if c[:1] == str(a)[:1] else -1.0 for c, a in zip(completions, answer)]
"""


def work_in(folder, monkeypatch):
    """Run the commands from `folder`, as its user would: its working directory, its modules importable (a reward
    module named again is imported afresh)."""
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("my_rewards", None)
    return folder


@pytest.fixture
def user_dir(tmp_path, monkeypatch, tiny_model_path):
    """A working directory with a reward module and prompts, as a user would have them."""
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SEEN_PROMPTS", str(tmp_path / "seen.jsonl"))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    return tmp_path
