"""The user's reward functions as the command line takes them: found by name, reporting their own failures in one
line, and used as the classifier of `topr-trl evaluate` on the user's own prompts.

The Python API never wraps the user's functions this way (a raising reward function raises there, as in
GRPOTrainer); only `topr-trl` commands do, where a one-line stop is what a command-line user wants.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trl.trainer.utils import is_async_callable

from ..evaluation.rewards import CORRECT, INCORRECT, INVALID
from .arithmetic import arithmetic_reward
from .reasoning import reasoning_reward
from .word_problems import word_problem_reward


BUILTIN_REWARDS = ("arithmetic", "reasoning", "word_problems")
HOOK_KEYWORDS = ("trainer_state", "log_extra", "log_metric", "environments")


def builtin_reward(name: str):
    return {"arithmetic": arithmetic_reward, "reasoning": reasoning_reward, "word_problems": word_problem_reward}[name]


def resolve_reward(name: str):
    """A reward function by name: a built-in one (`BUILTIN_REWARDS`), 'module:function' (the current directory is
    importable, as for `python -m`), TRL's dotted 'package.module.function', or 'path/to/file.py:function'."""
    if name in BUILTIN_REWARDS:
        return builtin_reward(name)
    location, _, function_name = name.rpartition(":")
    if not location and "." in name and not name.endswith(".py"):  # TRL's spelling: trl.rewards.accuracy_reward
        location, _, function_name = name.rpartition(".")
    if not location or not function_name:
        raise ValueError(
            f"unknown reward function {name!r}: use one of {list(BUILTIN_REWARDS)}, 'module:function' "
            "(or 'module.function') or 'path/to/file.py:function'"
        )
    try:
        if location.endswith(".py") or _names_a_path(location):
            path = _module_file(name, location)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(location)
    except (ImportError, FileNotFoundError) as error:
        raise ValueError(
            f"cannot load the reward function {name!r}: {error}. Give 'module:function' with the module "
            "importable from the current directory (or on PYTHONPATH), or 'path/to/file.py:function'"
        ) from error
    function = getattr(module, function_name, None)
    if not callable(function):
        available = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(function_name, available, n=1)
        raise ValueError(
            f"{location} has no function {function_name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
        )
    return function


def _names_a_path(location: str) -> bool:
    """A location written as a path (`./my_rewards`, `~/rewards/mine`, `sub/mine`), which `import_module` cannot
    take, rather than a module name (`my_rewards`, `package.module`)."""
    return location.startswith((".", "~")) or "/" in location or "\\" in location


def _module_file(name: str, location: str) -> Path:
    """The Python file a path location names: `path/to/file.py`, or `path/to/file` for `path/to/file.py`."""
    path = Path(location).expanduser()
    with_suffix = Path(f"{path}.py")
    if path.suffix != ".py" and with_suffix.is_file():
        return with_suffix
    if path.is_file() and path.suffix == ".py":
        return path
    if path.is_dir():
        problem = f"{location} is a folder"
    elif path.exists():
        problem = f"{location} is not a Python file (.py)"
    else:
        problem = f"no such file {str(path) if path.suffix == '.py' else f'{location} or {location}.py'}"
    raise ValueError(
        f"--reward_funcs {name}: {problem}; give the module file and the function, "
        "'path/to/file.py:function' (or 'module:function' for a module importable from the current "
        "directory)"
    )


class RewardFunctionError(ValueError):
    """A user's reward function raised: the command line reports it in one line (`--debug` shows the traceback,
    which stays attached as the cause)."""


def _first_failing_row(function, kwargs: dict) -> int | None:
    """The first row on which `function` alone raises, called one row at a time (None when no single row does:
    the failure needs the whole batch)."""
    rows = len(kwargs.get("prompts") or kwargs.get("completions") or [])
    for row in range(rows):
        one = {
            key: (value[row : row + 1] if isinstance(value, list) and len(value) == rows else value)
            for key, value in kwargs.items()
        }
        one.update({key: _ignore for key in ("log_extra", "log_metric") if key in kwargs})
        try:
            function(**one)
        except Exception:  # noqa: BLE001 - any failure locates the row
            return row
    return None


def _describe_failure(name: str, error: Exception, kwargs: dict, row: int | None) -> str:
    prompts = kwargs.get("prompts") or []
    where = ""
    if prompts:
        prompt = prompts[row if row is not None else 0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
            prompt = prompt[-1].get("content", prompt)
        label = "on prompt" if row is not None else "on a batch whose first prompt is"
        where = f" {label} {' '.join(str(prompt).split())!r:.100}"
    detail = " ".join(str(error).split())
    return f"reward function '{name}' raised {type(error).__name__}" + (f": {detail}" if detail else "") + where


def reporting_reward(function):
    """`function` as the command line runs it: a failure becomes one `RewardFunctionError` line naming the function,
    the exception and the first prompt it failed on. Keyword arguments pass through untouched. A callable object, not
    a closure, so that it pickles when `function` does: TRL's asynchronous rollout worker runs the rewards in a
    spawned process."""
    if getattr(function, "_topr_reports_failures", False):
        return function

    return (AsyncReportingReward if is_async_callable(function) else ReportingReward)(function)


class ReportingReward:
    """`reporting_reward` of a synchronous reward function."""

    _topr_reports_failures = True

    def __init__(self, function):
        self.function = function
        self.name = getattr(function, "__name__", type(function).__name__)
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args, **kwargs):
        try:
            return self.function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - re-raised with what the user needs to find it
            row = _first_failing_row(self.function, kwargs) if not args else None
            raise RewardFunctionError(_describe_failure(self.name, error, kwargs, row)) from error


class AsyncReportingReward(ReportingReward):
    """`reporting_reward` of an `async` reward function."""

    async def __call__(self, *args, **kwargs):
        try:
            return await self.function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - re-raised with what the user needs to find it
            raise RewardFunctionError(_describe_failure(self.name, error, kwargs, None)) from error


def weighted_reward(function, weight: float):
    """`function` whose every score is multiplied by `weight` (None and NaN kept: no score), under the same name: for
    a trainer without `reward_weights` (TRL's asynchronous one), whose sum of such functions is GRPO's weighted sum.
    A callable object, so that it pickles when `function` does (see `reporting_reward`)."""
    return (AsyncWeightedReward if is_async_callable(function) else WeightedReward)(function, float(weight))


class WeightedReward:
    def __init__(self, function, weight: float):
        self.function, self.weight = function, weight
        functools.update_wrapper(self, function, updated=())

    def scaled(self, values):
        return [value if value is None else self.weight * value for value in values]

    def __call__(self, *args, **kwargs):
        return self.scaled(self.function(*args, **kwargs))


class AsyncWeightedReward(WeightedReward):
    async def __call__(self, *args, **kwargs):
        return self.scaled(await self.function(*args, **kwargs))


def _ignore(*args, **kwargs) -> None:
    return None


def reward_classifier(reward_funcs: Sequence[Callable], dataset, reward_weights: Sequence[float] | None = None):
    """A `classify(text, row_index)` for `evaluate_model` on the user's own prompts: the completion is scored by the
    user's reward functions as GRPOTrainer calls them (prompts, completions in the prompt's format, the dataset's
    columns), their weighted sum (None/NaN left out, as in GRPO) is the reward, and the completion is `correct` when
    it is > 0, `invalid` when no function could score it, else `incorrect`."""
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(reward_funcs)
    columns = [c for c in dataset.column_names if c not in ("prompt", "completion", "completion_ids")]

    def classify(text: str, row_index: Any) -> str:
        row = dataset[int(row_index)]
        prompt = row["prompt"]
        completion: Any = [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
        kwargs = {key: [row[key]] for key in columns}
        kwargs.update(trainer_state=None, log_extra=_ignore, log_metric=_ignore)  # GRPOTrainer's hooks: no trainer
        total, scored = 0.0, False
        for function, weight in zip(reward_funcs, weights, strict=True):
            values = function(prompts=[prompt], completions=[completion], completion_ids=[None], **kwargs)
            if asyncio.iscoroutine(values):
                values = asyncio.run(values)
            value = list(values)[0]
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            total, scored = total + weight * float(value), True
        if not scored:
            return INVALID
        return CORRECT if total > 0 else INCORRECT

    classify.__name__ = "reward>0 of " + "+".join(getattr(f, "__name__", "reward") for f in reward_funcs)
    return classify
