"""The tasks the commands know, one registry as the losses have one (`topr_trl.loss.POLICY_LOSSES`): each `Task` says
where its prompts and held-out problems come from, what scores them, and whether the built-in tiny model is built
for it. `topr-trl train|generate|iterate` take the tasks that `trains`; `topr-trl evaluate` takes every one.

A new task is one `register_task(Task(...))`: the commands' `--task` choices, their checks, the data they load, the
rewards they train on, the answer checker `evaluate` uses and the completion budget all come from it. Data is
built or loaded inside the functions, when the task is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..evaluation.benchmarks import load_gsm8k, load_math, load_math500
from ..evaluation.runner import gsm8k_classify, math_classify
from ..inputs.sources import load_data_source
from ..offline.held_out import load_test_prompts
from .arithmetic import (
    accuracy,
    arithmetic_classify,
    build_warm_model,
    make_arithmetic_dataset,
    warm_model_folder,
    warm_model_key,
)
from .reasoning import (
    WarmStartSettings,
    build_reasoning_warm_model,
    make_reasoning_dataset,
    max_completion_tokens,
    measure_base_model,
    reasoning_classify,
    warm_model_path,
)
from .tiny import prebuilt_model
from .word_problems import (
    WORD_PROBLEM_MODEL,
    WORD_PROBLEM_TOKENS,
    make_word_problems,
    measure_word_problems,
)


@dataclass(frozen=True)
class TrainingData:
    """What a training command loads for a task: its prompts, the built-in task's held-out problems (scored before
    and after training) and an evaluation set for the trainer (`eval_split`)."""

    train: object = None
    held_out: object = None
    evaluation: object = None


@dataclass(frozen=True)
class Task:
    """One task. `options` in the functions are a command's task arguments
    (`topr_trl.commands.arguments.TaskArguments`, and `EvaluateArguments` for `evaluation_data`)."""

    name: str
    # train|generate|iterate take it; False: evaluation only (MATH's full test set)
    trains: bool
    # the training prompts (and held-out set, evaluation set) of a training command: (options, eval_split) -> ...
    training_data: Callable[..., TrainingData] | None
    # `topr-trl evaluate`'s problems: options -> Dataset with `prompt` and `answer`
    evaluation_data: Callable[..., object]
    # the completion budget of evaluate (when --max_completion_length is not given) and of a built-in run's recipe:
    # task_digits (None: the task's default) -> int
    max_new_tokens: Callable[[int | None], int]
    # the reward functions it trains on, by name (`topr_trl.tasks.user_rewards.resolve_reward`); () for the user's
    reward_funcs: tuple[str, ...] = ()
    # evaluate's answer checker (`topr_trl.evaluation.runner.evaluate_model`'s `classify`): () -> classify; None for a
    # task scored by the user's reward functions
    classifier: Callable[[], Callable] | None = None
    # the built-in tiny model is built for it (a run needs no --model_name_or_path) and its problems are its own
    # (no --dataset_name)
    builtin: bool = False
    # how a training command scores the built-in task's held-out problems: held_out -> evaluate(model, tokenizer)
    held_out_evaluator: Callable[..., Callable] | None = None
    # the built-in tiny model of a built-in task: (options, seed) -> TinyModel
    tiny_model: Callable[..., TinyModel] | None = None
    # the recipe (topr_trl/commands/recipes/<name>.yaml) a built-in run of it adds to the command's own
    recipe: str | None = None
    # a built-in task's model when it is not a tiny one the package builds: a Hub id (resolved offline from its
    # packaged copy, `topr_trl.inputs.sources.resolve_model_source`)
    default_model: str | None = None


@dataclass(frozen=True)
class TinyModel:
    """A built-in task's tiny model for a run's settings: its folder, whether the package ships its weights, what
    building it does (said before it starts), and `build(progress)`, which writes it to `folder`."""

    folder: Path
    shipped: bool
    what: str
    build: Callable[[Callable[[int, int, float], None]], object]


TASKS: dict[str, Task] = {}
BUILTIN_TASK = "arithmetic"  # what a command runs with no model, no dataset and no task
CUSTOM_TASK = "custom"  # the user's prompts and reward functions


def register_task(task: Task) -> Task:
    if task.name in TASKS:
        raise ValueError(f"a task named {task.name!r} is already registered.")
    TASKS[task.name] = task
    return task


def training_task_names() -> tuple[str, ...]:
    return tuple(name for name, task in TASKS.items() if task.trains)


def builtin_task_names() -> tuple[str, ...]:
    return tuple(name for name, task in TASKS.items() if task.builtin)


# ------------------------------------------------------------------ the built-in tasks


def _arithmetic_training(options, eval_split: bool) -> TrainingData:
    return TrainingData(
        train=make_arithmetic_dataset(options.task_train_prompts, options.task_digits, seed=1),
        held_out=make_arithmetic_dataset(options.task_eval_prompts, options.task_digits, seed=2),
    )


def _arithmetic_tiny_model(options, seed: int) -> TinyModel:
    folder = warm_model_folder(options.base_model_dir, options.task_digits, options.warm_start_accuracy, seed)
    return TinyModel(
        folder,
        prebuilt_model(warm_model_key(options.task_digits, options.warm_start_accuracy, seed)) is not None,
        f"SFT warm start until {options.warm_start_accuracy:.0%} greedy accuracy (at most 3,000 steps)",
        lambda progress: build_warm_model(
            folder,
            digits=options.task_digits,
            target_accuracy=options.warm_start_accuracy,
            seed=seed,
            progress=progress,
        ),
    )


def _arithmetic_evaluation(options):
    return make_arithmetic_dataset(options.task_eval_prompts, options.task_digits or 2, seed=2)


def _arithmetic_held_out(held_out):
    return lambda model, tokenizer: accuracy(model, tokenizer, held_out)


def _arithmetic_classifier():
    return arithmetic_classify


def _reasoning_training(options, eval_split: bool) -> TrainingData:
    # train and held-out problems come from splits that are disjoint by construction
    return TrainingData(
        train=make_reasoning_dataset(options.task_train_prompts, options.task_digits, "train", seed=1),
        held_out=make_reasoning_dataset(options.task_eval_prompts, options.task_digits, "heldout", seed=0),
    )


def _reasoning_tiny_model(options, seed: int) -> TinyModel:
    settings = WarmStartSettings(digits=options.task_digits, error_rate=options.task_error_rate, seed=seed)
    return TinyModel(
        warm_model_path(options.base_model_dir, settings),
        prebuilt_model(settings.key()) is not None,
        f"SFT on written solutions that drop each carry with probability {options.task_error_rate:g}, "
        f"{settings.steps} steps (1-3 min on an idle 2-core CPU)",
        lambda progress: build_reasoning_warm_model(options.base_model_dir, settings, progress=progress),
    )


def _reasoning_evaluation(options):
    # held-out problems: disjoint from its train and warm-start splits
    return make_reasoning_dataset(options.task_eval_prompts, options.task_digits or 3, split="heldout")


def _reasoning_max_new_tokens(task_digits: int | None) -> int:
    return max_completion_tokens(task_digits or 3)  # a written solution of its digits, plus room to go wrong


def _reasoning_held_out(held_out):
    return lambda model, tokenizer: measure_base_model(model, tokenizer, held_out)


def _reasoning_classifier():
    return reasoning_classify


def _word_problems_training(options, eval_split: bool) -> TrainingData:
    # three splits, disjoint by construction: train, validation (the trainer's eval set) and test (held out)
    return TrainingData(
        train=make_word_problems(options.task_train_prompts, "train", seed=1),
        held_out=make_word_problems(options.task_eval_prompts, "test"),
        evaluation=make_word_problems(options.task_eval_prompts, "validation") if eval_split else None,
    )


def _word_problems_evaluation(options):
    return make_word_problems(options.task_eval_prompts, options.dataset_test_split or "test")


def _word_problems_held_out(held_out):
    return lambda model, tokenizer: measure_word_problems(model, tokenizer, held_out)


def _word_problems_classifier():
    return gsm8k_classify


def _benchmark_common(options) -> dict:
    split = options.dataset_test_split or "test"
    source = {"source": options.dataset_name} if options.dataset_name else {}
    return dict(
        split=split,
        **source,
        chat=not options.plain_prompts,
        few_shot=options.few_shot,
        system_prompt=options.system_prompt,
    )


def _gsm8k_training(options, eval_split: bool) -> TrainingData:
    source = options.dataset_name or "openai/gsm8k"
    return TrainingData(
        train=load_gsm8k(options.dataset_train_split, source=source, few_shot=options.few_shot),
        evaluation=load_gsm8k(options.dataset_test_split, source=source, few_shot=options.few_shot)
        if eval_split
        else None,
    )


def _gsm8k_evaluation(options):
    return load_gsm8k(**_benchmark_common(options))


def _math500_training(options, eval_split: bool) -> TrainingData:
    return TrainingData(
        train=load_math500(source=options.dataset_name or "HuggingFaceH4/MATH-500", few_shot=options.few_shot)
    )


def _math500_evaluation(options):
    return load_math500(**_benchmark_common(options))


def _math_evaluation(options):
    return load_math(config=options.dataset_config, **_benchmark_common(options))


def _gsm8k_classifier():
    return gsm8k_classify


def _math_classifier():
    return math_classify


def load_prompts(options, split: str):
    """The custom prompt dataset: Hub id, local data files, or a save_to_disk folder; it must have `prompt`."""
    try:
        dataset = load_data_source(options.dataset_name, split, config=options.dataset_config)
    except FileNotFoundError as error:  # not on the Hub, or the Hub out of reach: the message says what to do
        raise SystemExit(f"topr-trl: {error}") from error
    if "prompt" not in dataset.column_names:
        raise SystemExit(
            f"topr-trl: dataset {options.dataset_name!r} has no `prompt` column (it has "
            f"{dataset.column_names}); rename the column that holds the prompts to `prompt`"
        )
    return dataset


def _custom_training(options, eval_split: bool) -> TrainingData:
    if not options.dataset_name:  # an offline run: the prompts come with the offline dataset
        return TrainingData()
    train = load_prompts(options, options.dataset_train_split)
    if not eval_split:
        return TrainingData(train=train)
    # the rule `iterate` measures by: a single file holds the training split only, and a test split that holds the
    # training prompts themselves is no held-out set; evaluating on either would report training rows as eval
    split = options.dataset_test_split or "test"
    evaluation, why = load_test_prompts(
        options.dataset_name, split, options.dataset_train_split, options.dataset_config, train
    )
    if evaluation is None:
        raise no_held_out_split(why)
    return TrainingData(train=train, evaluation=evaluation)


def no_held_out_split(why: str) -> SystemExit:
    """The one line for an evaluation asked of a custom dataset with no held-out split."""
    return SystemExit(
        f"topr-trl: --eval_strategy evaluates on a held-out split of --dataset_name, and there is "
        f"none: {' '.join(why.split())}. Pass --dataset_test_split SPLIT naming one (a folder with "
        f"train.jsonl and test.jsonl has 'test'), or leave --eval_strategy at 'no'"
    )


# a custom dataset's "reference" in `evaluate`: the row the reward functions read their columns from
ROW_COLUMN = "__row__"


def _custom_evaluation(options):
    dataset = load_data_source(
        options.dataset_name, options.dataset_test_split or "test", config=options.dataset_config
    )
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"dataset {options.dataset_name!r} has no `prompt` column (it has "
            f"{dataset.column_names}); rename the column that holds the prompts to `prompt`"
        )
    return dataset.add_column(ROW_COLUMN, list(range(len(dataset))))


def _fixed(tokens: int) -> Callable[[int | None], int]:
    return lambda task_digits: tokens


register_task(
    Task(
        "arithmetic",
        trains=True,
        training_data=_arithmetic_training,
        evaluation_data=_arithmetic_evaluation,
        max_new_tokens=_fixed(8),
        reward_funcs=("arithmetic",),
        classifier=_arithmetic_classifier,
        builtin=True,
        held_out_evaluator=_arithmetic_held_out,
        tiny_model=_arithmetic_tiny_model,
    )
)
register_task(
    Task(
        "reasoning",
        trains=True,
        training_data=_reasoning_training,
        evaluation_data=_reasoning_evaluation,
        max_new_tokens=_reasoning_max_new_tokens,
        reward_funcs=("reasoning",),
        classifier=_reasoning_classifier,
        builtin=True,
        held_out_evaluator=_reasoning_held_out,
        tiny_model=_reasoning_tiny_model,
        recipe="builtin-reasoning",
    )
)
register_task(
    Task(
        "word_problems",
        trains=True,
        training_data=_word_problems_training,
        evaluation_data=_word_problems_evaluation,
        max_new_tokens=_fixed(WORD_PROBLEM_TOKENS),
        reward_funcs=("word_problems",),
        classifier=_word_problems_classifier,
        builtin=True,
        held_out_evaluator=_word_problems_held_out,
        recipe="builtin-word_problems",
        default_model=WORD_PROBLEM_MODEL,
    )
)
register_task(
    Task(
        "gsm8k",
        trains=True,
        training_data=_gsm8k_training,
        evaluation_data=_gsm8k_evaluation,
        max_new_tokens=_fixed(512),
        reward_funcs=("topr_trl.evaluation.rewards:gsm8k_reward",),
        classifier=_gsm8k_classifier,
    )
)
register_task(
    Task(
        "math500",
        trains=True,
        training_data=_math500_training,
        evaluation_data=_math500_evaluation,
        max_new_tokens=_fixed(1024),
        reward_funcs=("topr_trl.evaluation.rewards:math_reward",),
        classifier=_math_classifier,
    )
)
register_task(
    Task(
        "math",
        trains=False,
        training_data=None,
        evaluation_data=_math_evaluation,
        max_new_tokens=_fixed(1024),
        classifier=_math_classifier,
    )
)
register_task(
    Task(
        CUSTOM_TASK,
        trains=True,
        training_data=_custom_training,
        evaluation_data=_custom_evaluation,
        max_new_tokens=_fixed(256),
    )
)
