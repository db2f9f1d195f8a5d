"""A reasoning testbed: multi-digit addition written out digit by digit, with a planted systematic error.

The built-in arithmetic task (`topr_trl.tasks.arithmetic`) answers in 3-4 tokens, so sequence ratios stay near one
and a wrong answer is a wrong last digit. Here the completion is a written solution of tens of tokens, one step per
digit from the right with the carry written in, then the final answer the reward checks:

    prompt      "4587+2896="
    completion  "7+6+0=13|8+9+1=18|5+8+1=14|4+2+1=07|=7483"

Step i reads `a_i+b_i+c_i=s_i`: the operands' i-th digits from the right, the carry into position i (the tens digit
of the previous sum; 0 at the units) and their sum as two digits. The answer is the units digits of the sums, most
significant first, after the carry out of the last step when it is 1. Both operands have exactly `digits` digits.

The warm-start (SFT) solutions carry a SYSTEMATIC error RL can fix: each carry (at `error_positions`, default all)
is dropped with probability `error_rate` -- the step writes `+0` instead of `+1` (or, for the carry out of the top
digit, the answer loses its leading 1) and everything after it is computed consistently from the wrong step, so the
final answer is wrong by exactly that carry. The model learns to drop carries at that rate; the right behaviour stays
in its distribution (probability 1 - error_rate per carry), which is what RL reinforces. A second planted error,
off by default (`spurious_carry_rate`), writes a carry of 1 into a step where none arrives, so the answer is too
large by that power of ten: two systematic errors of opposite kinds, for a harder setting.

Splits are disjoint by construction: a hash of the unordered pair {a, b} puts every problem in exactly one of
`SPLITS` (RL train prompts, warm-start problems, held-out problems, and a validation split for choosing settings,
so that the held-out problems only report), whatever the seeds.

Rewards are +1 for a correct final answer and -1 otherwise; a completion that breaks the format is invalid (-1).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..evaluation.rewards import CORRECT, INCORRECT, INVALID, completion_text
from ..evaluation.runner import evaluate_model
from . import arithmetic
from .tiny import (
    HEAD_DIM,
    build_model,
    build_tokenizer,
    install_prebuilt,
    machine_key,
    prebuilt_model,
    record_build,
    save_pretrained,
    staged_folder,
)


FORMAT_VERSION = 1
"""Bumped whenever the written-solution format or the warm-start recipe changes: part of every cache key, so a
model cached under an older format is never loaded as if it were current."""

STEP_SEPARATOR = "|"
ANSWER_MARK = "="

SPLITS: dict[str, tuple[float, float]] = {
    "heldout": (0.0, 0.1),
    "warm_start": (0.1, 0.55),
    "train": (0.55, 0.95),
    "validation": (0.95, 1.0),
}
"""Each split's share of the unit interval the pair hash falls in: a problem's split depends on {a, b} only.
"validation" is where settings (learning rate, error rates, baselines) are chosen; "heldout" only reports."""

_STEP = re.compile(r"(\d)\+(\d)\+([01])=(\d\d)")
_SOLUTION = re.compile(r"((?:\d\+\d\+[01]=\d\d\|)+)=(\d+)")
_PROBLEM = re.compile(r"\s*(\d+)\+(\d+)=\s*")

# Problems per split at or under which sampling enumerates the split instead of rejection-sampling it
_ENUMERATE_LIMIT = 200_000


# ---------------------------------------------------------------------------------------------------------
# Problems and splits
# ---------------------------------------------------------------------------------------------------------


def _operand_range(digits: int) -> tuple[int, int]:
    if digits < 1:
        raise ValueError(f"digits must be at least 1, got {digits}")
    return (10 ** (digits - 1) if digits > 1 else 0), 10**digits - 1


def pair_hash(a: int, b: int) -> float:
    """A deterministic number in [0, 1) for the unordered pair {a, b} (a+b and b+a share their split, so a held-out
    problem is never a commuted training problem)."""
    low, high = sorted((a, b))
    digest = hashlib.blake2b(f"{low}+{high}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def split_of(a: int, b: int) -> str:
    """The split (a key of `SPLITS`) the problem a+b belongs to."""
    value = pair_hash(a, b)
    return next(name for name, (low, high) in SPLITS.items() if low <= value < high)


def split_size(digits: int, split: str) -> int:
    """About how many ordered problems of `digits`-digit operands `split` holds (exact when small enough to count)."""
    _check_split(split)
    low, high = _operand_range(digits)
    total = (high - low + 1) ** 2
    if total <= _ENUMERATE_LIMIT:
        return len(_enumerate_split(digits, split))
    share = SPLITS[split][1] - SPLITS[split][0]
    return int(total * share)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")


def _enumerate_split(digits: int, split: str) -> list[tuple[int, int]]:
    low, high = _operand_range(digits)
    return [(a, b) for a in range(low, high + 1) for b in range(low, high + 1) if split_of(a, b) == split]


def make_problems(num_problems: int, digits: int = 3, split: str = "train", seed: int = 0) -> list[tuple[int, int]]:
    """`num_problems` distinct (a, b) pairs of `digits`-digit operands from `split`, in a seeded random order."""
    _check_split(split)
    low, high = _operand_range(digits)
    rng = random.Random(f"{split}-{digits}-{seed}")
    if (high - low + 1) ** 2 <= _ENUMERATE_LIMIT:
        pool = _enumerate_split(digits, split)
        if num_problems > len(pool):
            raise ValueError(
                f"the {split!r} split has only {len(pool)} problems with {digits} digit(s); "
                f"ask for fewer or use more digits"
            )
        rng.shuffle(pool)
        return pool[:num_problems]
    if num_problems > split_size(digits, split) // 2:
        raise ValueError(
            f"the {split!r} split has about {split_size(digits, split)} problems with {digits} digits; "
            f"ask for at most half of them"
        )
    seen: set[tuple[int, int]] = set()
    problems = []
    while len(problems) < num_problems:
        pair = rng.randint(low, high), rng.randint(low, high)
        if pair not in seen and split_of(*pair) == split:
            seen.add(pair)
            problems.append(pair)
    return problems


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def parse_problem(prompt) -> tuple[int, int]:
    """(a, b) of a prompt, conversational (`[{"role": "user", "content": "a+b="}]`) or plain."""
    text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    match = _PROBLEM.fullmatch(text)
    if match is None:
        raise ValueError(f"not a reasoning-task prompt (expected 'a+b='): {text!r}")
    return int(match.group(1)), int(match.group(2))


def make_reasoning_dataset(num_prompts: int, digits: int = 3, split: str = "train", seed: int = 0) -> Dataset:
    """Conversational prompts `a+b=` with the final answer as `answer` (what the reward checks), from `split`:
    "train" for RL prompts, "validation" for choosing settings, "heldout" for reporting (see `SPLITS`)."""
    problems = make_problems(num_prompts, digits, split, seed)
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": prompt_text(a, b)}] for a, b in problems],
            "answer": [str(a + b) for a, b in problems],
        }
    )


# ---------------------------------------------------------------------------------------------------------
# Written solutions
# ---------------------------------------------------------------------------------------------------------


def _digits_from_right(value: int, count: int) -> list[int]:
    return [value // 10**i % 10 for i in range(count)]


def _solve(a: int, b: int, drop, add=None) -> tuple[str, list[int], list[int]]:
    """The written solution of a+b where `drop(position)` says whether the carry arriving at `position` (i in
    1..digits-1: the carry into step i; `digits`: the carry out of the top step, the answer's leading 1) is lost,
    and `add(position)` (i in 1..digits-1; None: never) whether a carry of 1 is written into step i where none
    arrives. Steps after a changed carry follow from the wrong step, so `drop` is asked only about carries that still
    arrive and `add` only where none does. Returns the text, the positions dropped and the positions added."""
    if a < 0 or b < 0:
        raise ValueError("operands must be non-negative")
    digits = len(str(max(a, b)))
    steps, units, dropped, added, carry = [], [], [], [], 0
    for i, (x, y) in enumerate(zip(_digits_from_right(a, digits), _digits_from_right(b, digits), strict=True)):
        if carry and drop(i):
            dropped.append(i)
            carry = 0
        elif i > 0 and not carry and add is not None and add(i):
            added.append(i)
            carry = 1
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total:02d}")
        units.append(total % 10)
        carry = total // 10
    if carry and drop(digits):
        dropped.append(digits)
        carry = 0
    answer = ("1" if carry else "") + "".join(str(unit) for unit in reversed(units))
    return STEP_SEPARATOR.join(steps) + STEP_SEPARATOR + ANSWER_MARK + (answer.lstrip("0") or "0"), dropped, added


def count_carries(a: int, b: int) -> int:
    """How many carries the correct written solution of a+b has (the carry out of the top step included): the
    number of places where the planted error can strike."""
    carries, carry = 0, 0
    digits = len(str(max(a, b)))
    for x, y in zip(_digits_from_right(a, digits), _digits_from_right(b, digits), strict=True):
        carry = (x + y + carry) // 10
        carries += carry
    return carries


def write_solution(a: int, b: int, dropped: Iterable[int] = (), added: Iterable[int] = ()) -> str:
    """The written solution of a+b; a carry arriving at a position in `dropped` (1..digits-1: into that step;
    digits: the answer's leading 1) is lost, a carry of 1 is written into a step in `added` (1..digits-1) where none
    arrives, and everything after either follows from the wrong step."""
    dropped, added = set(dropped), set(added)
    return _solve(a, b, lambda position: position in dropped, lambda position: position in added)[0]


def planted_error_solution(
    a: int,
    b: int,
    error_rate: float,
    rng: random.Random,
    error_positions: Sequence[int] | None = None,
    spurious_carry_rate: float = 0.0,
) -> tuple[str, list[int], list[int]]:
    """A warm-start solution of a+b: each carry that arrives at one of `error_positions` (None: any position) is
    dropped with probability `error_rate`, and a carry is written into each step where none arrives with probability
    `spurious_carry_rate`, independently. Returns the text, the positions dropped and the positions added (both
    empty: the solution is correct). With `spurious_carry_rate` 0 the generator is drawn exactly as before it
    existed, so every earlier warm start is unchanged."""
    for name, rate in (("error_rate", error_rate), ("spurious_carry_rate", spurious_carry_rate)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {rate}")
    add = (lambda position: rng.random() < spurious_carry_rate) if spurious_carry_rate > 0 else None
    return _solve(
        a,
        b,
        lambda position: (error_positions is None or position in error_positions) and rng.random() < error_rate,
        add,
    )


def make_warm_start_dataset(
    num_examples: int,
    digits: int = 3,
    error_rate: float = 0.0,
    error_positions: Sequence[int] | None = None,
    seed: int = 0,
    spurious_carry_rate: float = 0.0,
) -> Dataset:
    """Warm-start (SFT) examples from the "warm_start" split: `prompt`, `answer` (the correct final answer),
    `solution` (the SFT target: the written solution, with planted errors), `dropped` (its dropped carries) and
    `added` (its spurious carries)."""
    rng = random.Random(f"planted-{seed}")
    problems = make_problems(num_examples, digits, "warm_start", seed)
    solutions = [
        planted_error_solution(a, b, error_rate, rng, error_positions, spurious_carry_rate) for a, b in problems
    ]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": prompt_text(a, b)}] for a, b in problems],
            "answer": [str(a + b) for a, b in problems],
            "solution": [text for text, _, _ in solutions],
            "dropped": [dropped for _, dropped, _ in solutions],
            "added": [added for _, _, added in solutions],
        }
    )


def max_completion_tokens(digits: int) -> int:
    """Tokens a correct solution needs with the tiny character tokenizer (EOS included), plus a little slack."""
    return digits * (len("0+0+0=00") + 1) + len(ANSWER_MARK) + digits + 1 + 1 + 4


# ---------------------------------------------------------------------------------------------------------
# Reading completions: answer, class, reward, diagnosis
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrittenSolution:
    """A completion that follows the format: its steps as (a_i, b_i, carry_i, sum_i), and its final answer."""

    steps: tuple[tuple[int, int, int, int], ...]
    answer: str


def parse_solution(text) -> WrittenSolution | None:
    """The steps and final answer of a completion, or None when it breaks the format (it is then invalid)."""
    match = _SOLUTION.fullmatch(completion_text(text).strip())
    if match is None:
        return None
    steps = tuple(tuple(int(group) for group in step) for step in _STEP.findall(match.group(1)))
    return WrittenSolution(steps=steps, answer=match.group(2))


def extract_answer(text) -> str | None:
    """The final answer of a well-formed completion (leading zeros dropped), None for an invalid one."""
    solution = parse_solution(text)
    return None if solution is None else (solution.answer.lstrip("0") or "0")


def _reasoning_classify(text, reference) -> str:
    answer = extract_answer(text)
    if answer is None:
        return INVALID
    return CORRECT if answer == str(reference).strip() else INCORRECT


reasoning_classify = _reasoning_classify
reasoning_classify.extract = extract_answer
reasoning_classify.equivalent = None
"""classify(text, reference) -> "correct" | "incorrect" | "invalid" (format broken or no final answer), with the
`extract` / `equivalent` attributes `topr_trl.evaluation.runner.evaluate_model` uses for maj@k."""


def reasoning_reward(completions, answer, **kwargs) -> list[float]:
    """+1 when the completion is well formed and its final answer equals the reference, -1 otherwise (TRL's
    reward-function signature; conversational or plain completions)."""
    return [1.0 if _reasoning_classify(c, a) == CORRECT else -1.0 for c, a in zip(completions, answer, strict=True)]


PLANTED = "planted"
"""`diagnose`'s name for a wrong answer whose only departures from the algorithm are dropped carries."""


def diagnose(text, a: int, b: int) -> dict:
    """What a completion for a+b did: `class` (correct / incorrect / invalid) and, for a well-formed one, the set
    `errors` of its departures from the algorithm -- "dropped_carry" (a carry of 1 written as 0, or a missing
    leading 1: the planted error), "wrong_carry" (any other carry that does not follow from the previous sum),
    "copy" (a step's digits are not the operands'), "arithmetic" (a step's sum is wrong), "steps" (not one step per
    digit), "answer" (the answer does not follow from the steps) -- and `kind`: "correct", "invalid", `PLANTED`
    (wrong with only dropped carries) or "other" (any other error)."""
    answer_class = _reasoning_classify(text, a + b)
    solution = parse_solution(text)
    if solution is None:
        return {"class": answer_class, "errors": set(), "kind": INVALID}
    digits = len(str(max(a, b)))
    errors: set[str] = set()
    if len(solution.steps) != digits:
        errors.add("steps")
    a_digits, b_digits = _digits_from_right(a, digits), _digits_from_right(b, digits)
    previous_carry = 0
    for i, (x, y, carry, total) in enumerate(solution.steps):
        if i >= digits or (x, y) != (a_digits[i], b_digits[i]):
            errors.add("copy")
        if carry != previous_carry:
            errors.add("dropped_carry" if (previous_carry, carry) == (1, 0) else "wrong_carry")
        if total != x + y + carry:
            errors.add("arithmetic")
        previous_carry = total // 10
    units = "".join(str(total % 10) for *_, total in reversed(solution.steps))
    expected = ((str(previous_carry) if previous_carry else "") + units).lstrip("0") or "0"
    written = solution.answer.lstrip("0") or "0"
    if written != expected:
        errors.add("dropped_carry" if previous_carry and written == (units.lstrip("0") or "0") else "answer")
    if answer_class == CORRECT:
        kind = "correct"
    else:
        kind = PLANTED if errors == {"dropped_carry"} else "other"
    return {"class": answer_class, "errors": errors, "kind": kind}


# ---------------------------------------------------------------------------------------------------------
# The warm-started tiny model
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmStartSettings:
    """Everything that changes the warm-started model; all of it is in the cache key (`warm_model_path`).

    `digits`: operand digits (>= 2; 3 gives 81,000 held-out problems). `error_rate`: probability that the SFT
    solution drops a carry that arrives at one of `error_positions` (carry positions 1..digits, `digits` being the
    answer's leading 1; None: all). `num_examples`: distinct warm-start problems. `steps`, `batch_size`,
    `learning_rate`: the SFT run (`topr_trl.tasks.arithmetic.warm_start`, AdamW, constant rate). `hidden_size`,
    `num_layers`: the tiny model (`topr_trl.tasks.tiny.build_model`). `seed`: model init, problems, planted errors
    and batches.
    `device`: where the warm start trains ("cpu", "cuda"); part of the key since kernels differ in rounding.
    `spurious_carry_rate`: the second planted error, a carry of 1 written where none arrives (0: off; only a nonzero
    rate enters the key, so every model built before it existed keeps its key).

    Once the warm start is long enough for the model to learn the algorithm, the base model's sampled pass@1 is set
    by the planted errors and its greedy accuracy by whether `error_rate` is over one half. Measured at temperature
    1, 4 samples per problem (CPU, one thread, seed 0, 64x2 model):

    - defaults (3 digits, error_rate 0.25 at all positions, 3,000 steps at 2e-3, head size 32; ~2 min warm start),
      500 held-out problems: pass@1 0.669 +- 0.013, greedy 0.978, invalid 0.3 % -- the paper's two thirds, but
      greedy decoding hides the error (the majority step is right). The same recipe's 2,000 steps at 3e-3 (the
      head-size-16 model's, pass@1 0.68 and greedy 0.99 on 1,000 problems) gives the head-size-32 model only
      pass@1 0.46, 4,000 steps at 3e-3 0.52: it learns the algorithm more slowly;
    - with the head-size-16 model (2,000 steps at 3e-3), 1,000 problems: error_rate 0.6 at position 1 only: pass@1
      0.69, greedy 0.53 (greedy always drops that carry); stress, error_rate 0.9 at all positions: pass@1 0.14
      (3 digits), 0.08 (digits 4, ~42-token completions).

    A larger setting for a GPU (not measured): digits 5, hidden_size 256, num_layers 4, num_examples 100,000,
    steps 5,000, batch_size 128, learning_rate 1e-3, device "cuda"; check where its pass@1 lands with
    `measure_base_model` before using it, and tune `error_rate` against it."""

    digits: int = 3
    error_rate: float = 0.25
    error_positions: tuple[int, ...] | None = None
    num_examples: int = 20_000
    steps: int = 3000
    batch_size: int = 32
    learning_rate: float = 2e-3
    hidden_size: int = 64
    num_layers: int = 2
    seed: int = 0
    device: str = "cpu"
    spurious_carry_rate: float = 0.0

    def __post_init__(self):
        if self.digits < 2:
            raise ValueError(f"digits must be at least 2 (a carry needs two digits), got {self.digits}")
        for name in ("error_rate", "spurious_carry_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.error_positions is not None:
            positions = tuple(sorted(set(self.error_positions)))
            if not positions or not all(1 <= p <= self.digits for p in positions):
                raise ValueError(
                    f"error_positions must be carry positions in 1..{self.digits} (or None: all), "
                    f"got {self.error_positions}"
                )
            object.__setattr__(self, "error_positions", positions)
        for name in ("num_examples", "steps", "batch_size", "hidden_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")

    def to_dict(self) -> dict:
        settings = asdict(self)
        settings["error_positions"] = list(self.error_positions) if self.error_positions is not None else None
        if not self.spurious_carry_rate:  # off: the settings (and the key) of every model built before it existed
            del settings["spurious_carry_rate"]
        # the tiny model's head size is fixed by `build_model`, but a change of it must change the key
        return {"format_version": FORMAT_VERSION, "head_dim": HEAD_DIM, **settings}

    def key(self) -> str:
        """A directory name: the main settings readable, and a hash of all of them (and the format version)."""
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:10]
        positions = "all" if self.error_positions is None else "-".join(map(str, self.error_positions))
        device = "" if self.device == "cpu" else f"-{self.device.replace(':', '')}"
        spurious = f"-s{self.spurious_carry_rate:g}" if self.spurious_carry_rate else ""
        return (
            f"reasoning-d{self.digits}-q{self.error_rate:g}{spurious}-at{positions}-steps{self.steps}"
            f"-h{self.hidden_size}x{self.num_layers}-seed{self.seed}{device}-{digest}"
        )


SETTINGS_FILE = "reasoning_warm_start.json"


def warm_model_path(cache_dir: str | Path, settings: WarmStartSettings) -> Path:
    """Where `build_reasoning_warm_model` keeps the model of `settings` under `cache_dir`. A shipped model (the
    default settings, `topr_trl.tasks.tiny.PREBUILT_DIR`) is the same everywhere and named by its settings
    alone; a locally trained one's name adds the torch version, CPU kernels and threads that trained it, since they
    change its weights."""
    key = settings.key()
    return Path(cache_dir) / (key if prebuilt_model(key) is not None else f"{key}-{machine_key()}")


def build_reasoning_warm_model(
    cache_dir: str | Path, settings: WarmStartSettings | None = None, progress=None, **overrides
):
    """The tiny model warm-started by SFT on written solutions with planted errors (`WarmStartSettings`, or its
    fields as keyword arguments), installed from the shipped weights (default settings) or built once, under
    `warm_model_path(cache_dir, settings)`, and loaded from there afterwards. Returns (model, tokenizer, path); the
    model is loaded from `path`, so GRPOTrainer can reload it by name. A cached model whose recorded settings
    differ from the requested ones is refused, never reused. `progress(step, steps, loss)` hears from a build."""
    if settings is None:
        settings = WarmStartSettings(**overrides)
    elif overrides:
        settings = replace(settings, **overrides)
    path = warm_model_path(cache_dir, settings)
    recorded = path / SETTINGS_FILE
    if not (path / "config.json").exists() and not install_prebuilt(settings.key(), path):
        tokenizer = build_tokenizer()
        model = build_model(
            tokenizer, hidden_size=settings.hidden_size, num_layers=settings.num_layers, seed=settings.seed
        ).to(settings.device)
        examples = make_warm_start_dataset(
            settings.num_examples,
            settings.digits,
            settings.error_rate,
            settings.error_positions,
            seed=settings.seed,
            spurious_carry_rate=settings.spurious_carry_rate,
        )
        # arithmetic.warm_start trains on its `answer` column: here the SFT target is the whole written solution
        targets = examples.select_columns(["prompt", "solution"]).rename_column("solution", "answer")
        arithmetic.warm_start(
            model,
            tokenizer,
            targets,
            settings.steps,
            batch_size=settings.batch_size,
            lr=settings.learning_rate,
            seed=settings.seed,
            progress=progress,
        )
        with staged_folder(path) as staging:
            save_pretrained(model, tokenizer, staging)
            (staging / SETTINGS_FILE).write_text(json.dumps(settings.to_dict(), indent=2))
            record_build(staging, settings.to_dict())
    if not recorded.exists() or json.loads(recorded.read_text()) != settings.to_dict():
        raise ValueError(
            f"{path} holds a model built with other settings ({recorded.name} differs from "
            f"{settings.to_dict()}); delete the directory or use another cache_dir"
        )
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), path


# ---------------------------------------------------------------------------------------------------------
# Measuring a base model
# ---------------------------------------------------------------------------------------------------------


def measure_base_model(
    model,
    tokenizer,
    held_out: Dataset,
    num_samples: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
) -> dict:
    """Where a model stands on `held_out` (from `make_reasoning_dataset(..., split="heldout")`): sampled pass@1 at
    `temperature` with `num_samples` per problem and its bootstrap SE, the invalid rate, greedy accuracy, the mean
    completion length in tokens (EOS included) and the share of wrong, well-formed samples whose only error is a
    dropped carry (`planted_share`: what the warm start planted, as opposed to noise).

    `pass@1_se` is the paper's bootstrap SE (samples redrawn within each problem: the sampling noise for this
    problem set); `pass@1_problem_se` is the SE over problems (std of per-problem pass@1 / sqrt(problems)), the
    one to use when comparing with another problem set or asking how well the problems represent the task."""
    digits = len(str(parse_problem(held_out[0]["prompt"])[0]))
    common = dict(max_new_tokens=max_completion_tokens(digits), batch_size=batch_size, seed=seed, show_progress=False)
    sampled = evaluate_model(
        model, tokenizer, held_out, reasoning_classify, k=1, num_samples=num_samples, temperature=temperature, **common
    )
    greedy = evaluate_model(model, tokenizer, held_out, reasoning_classify, k=1, temperature=0.0, **common)
    kinds = [
        diagnose(text, *parse_problem(record["prompt"]))["kind"]
        for record in sampled.records
        for text in record["completions"]
    ]
    wrong = [kind for kind in kinds if kind in (PLANTED, "other")]
    lengths = [tokens for record in sampled.records for tokens in record["num_tokens"]]
    per_problem = [record["num_correct"] / num_samples for record in sampled.records]
    return {
        "num_problems": len(held_out),
        "num_samples": num_samples,
        "temperature": temperature,
        "pass@1": sampled.pass_at_1,
        "pass@1_se": sampled.standard_errors["pass@1"],
        "pass@1_problem_se": statistics.stdev(per_problem) / len(per_problem) ** 0.5
        if len(per_problem) > 1
        else float("nan"),
        "invalid_rate": sampled.invalid_rate,
        "incorrect_rate": sampled.metrics["incorrect_rate"],
        "planted_share": wrong.count(PLANTED) / len(wrong) if wrong else float("nan"),
        "greedy_accuracy": greedy.pass_at_1,
        "greedy_invalid_rate": greedy.invalid_rate,
        "mean_completion_tokens": sum(lengths) / len(lengths),
        "truncated_rate": sum(t for record in sampled.records for t in record["truncated"]) / len(lengths),
    }
