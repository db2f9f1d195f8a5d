"""The real model's built-in task: one-step arithmetic word problems in natural language ("Mia has 12 apples. She buys
7 more. How many apples does Mia have now?"), asked through the model's chat template and scored +1/-1 by the last
number of the completion (`word_problem_reward`).

Problems are drawn from a finite space (template x name x object x numbers), and every problem belongs to exactly one
split by a hash of its text (`split_of`): train, validation and test are disjoint by construction and the same on
every machine. `experiments/real_task_candidates.py` measured SmolLM2-135M-Instruct's sampled pass@1 on this task and
on the other candidates (docs/real-model.md).
"""

from __future__ import annotations

import hashlib
import random
import statistics

from accelerate import PartialState
from datasets import Dataset

from ..evaluation.rewards import classify_gsm8k, completion_text
from ..evaluation.runner import evaluate_model, gsm8k_classify


NAMES = ("Mia", "Tom", "Ava", "Leo", "Emma", "Noah", "Lily", "Sam", "Zoe", "Ben", "Ella", "Max")
OBJECTS = ("apples", "books", "marbles", "pencils", "stickers", "cookies", "cards", "shells", "stamps", "balloons")
# (text, answer): one arithmetic step each; {a} > {b} where a subtraction needs it
TEMPLATES = (
    ("{name} has {a} {obj}. {pronoun} buys {b} more. How many {obj} does {name} have now?", lambda a, b: a + b),
    (
        "{name} has {a} {obj}. {pronoun} gives {b} of them to a friend. How many {obj} does {name} have left?",
        lambda a, b: a - b,
    ),
    ("There are {a} {obj} in a box. {name} puts in {b} more. How many {obj} are in the box now?", lambda a, b: a + b),
    ("{name} had {a} {obj} and lost {b} of them. How many {obj} does {name} have now?", lambda a, b: a - b),
)
# the plain style: the same one-step sums and differences asked directly
QUESTIONS = (
    ("What is {a} plus {b}?", lambda a, b: a + b),
    ("What is the sum of {a} and {b}?", lambda a, b: a + b),
    ("What do you get when you add {b} to {a}?", lambda a, b: a + b),
    ("What is {a} minus {b}?", lambda a, b: a - b),
    ("What do you get when you take {b} away from {a}?", lambda a, b: a - b),
)
STYLES = {"story": TEMPLATES, "plain": QUESTIONS}
PRONOUNS = {"Mia": "She", "Ava": "She", "Emma": "She", "Lily": "She", "Zoe": "She", "Ella": "She"}
INSTRUCTION = "Answer with the number."
WORKED_EXAMPLES = (
    ("Ben has 4 cards. He buys 3 more. How many cards does Ben have now?", "Ben has 4 + 3 = 7 cards. The answer is 7."),
    (
        "Ella had 9 stamps and lost 5 of them. How many stamps does Ella have now?",
        "Ella has 9 - 5 = 4 stamps. The answer is 4.",
    ),
)
"""Worked answers shown as earlier chat turns (`few_shot`): the answer's form, one equation then the number. They are
never asked as problems."""
SPLITS = {"train": range(0, 8), "validation": range(8, 9), "test": range(9, 10)}
"""Each problem's split: its text's hash modulo 10 (80 % train, 10 % validation, 10 % test)."""
WORD_PROBLEM_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The task's model when none is given: the packaged copy where the Hub cannot be reached."""
WORD_PROBLEM_TOKENS = 64
"""The completion budget: a worked answer takes 20-40 tokens; the rest is room to go wrong."""
MAX_NUMBER = 9
"""The numbers in a problem run from 1 to this (SmolLM2-135M's sums beyond 20 are mostly wrong: docs/real-model.md)."""


FEW_SHOT = 2
"""Worked examples before each problem in the task's prompts: without them the base model's answers wander (sampled
pass@1 0.07-0.09, most completions cut at the budget); with two, 0.27 (docs/real-model.md)."""


def split_of(question: str) -> str:
    bucket = int(hashlib.sha256(question.encode()).hexdigest(), 16) % 10
    return next(name for name, buckets in SPLITS.items() if bucket in buckets)


def _problem(rng: random.Random, max_number: int, style: str) -> tuple[str, int]:
    template, answer = rng.choice(STYLES[style])
    a, b = rng.randint(1, max_number), rng.randint(1, max_number)
    a, b = max(a, b), min(a, b)  # a subtraction never goes below zero
    name = rng.choice(NAMES)
    question = template.format(name=name, obj=rng.choice(OBJECTS), a=a, b=b, pronoun=PRONOUNS.get(name, "He"))
    return question, answer(a, b)


def make_word_problems(
    num_problems: int,
    split: str,
    seed: int = 0,
    instruction: str | None = INSTRUCTION,
    system_prompt: str | None = None,
    max_number: int = MAX_NUMBER,
    style: str = "story",
    few_shot: int = FEW_SHOT,
) -> Dataset:
    """`num_problems` distinct problems of `split` (`SPLITS`), as chat prompts with an `answer` column (the number as
    text, as GSM8K's loader gives it) and the plain `question`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {list(STYLES)}, got {style!r}")
    rng, seen, rows = random.Random(f"word-problems-{split}-{seed}"), set(), []
    for _ in range(200 * num_problems):
        if len(rows) == num_problems:
            break
        question, answer = _problem(rng, max_number, style)
        if question in seen or split_of(question) != split or question in dict(WORKED_EXAMPLES):
            continue
        seen.add(question)
        content = f"{question} {instruction}" if instruction else question
        shots = [
            {"role": role, "content": text}
            for example, answer_text in WORKED_EXAMPLES[:few_shot]
            for role, text in (
                ("user", f"{example} {instruction}" if instruction else example),
                ("assistant", answer_text),
            )
        ]
        messages = (
            ([{"role": "system", "content": system_prompt}] if system_prompt else [])
            + shots
            + [{"role": "user", "content": content}]
        )
        rows.append({"prompt": messages, "answer": str(answer), "question": question})
    if len(rows) < num_problems:
        raise ValueError(f"the {split} split has only {len(rows)} distinct word problems; ask for fewer")
    return Dataset.from_list(rows)


def word_problem_reward(completions, answer, **kwargs) -> list[float]:
    """+1 for a correct final number, -1 otherwise (the paper's +1/-1 reward)."""
    return [
        1.0 if classify_gsm8k(completion_text(completion), reference) == "correct" else -1.0
        for completion, reference in zip(completions, answer, strict=True)
    ]


def measure_word_problems(
    model,
    tokenizer,
    held_out: Dataset,
    num_samples: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
) -> dict:
    """Sampled pass@1 on `held_out` at `temperature` over the whole vocabulary (`num_samples` per problem), with the
    bootstrap SE over samples (`pass@1_se`) and the SE over problems (`pass@1_problem_se`), the mean completion
    length and the share cut at the budget; greedy accuracy beside it."""
    # minutes on a CPU for the real model: a bar (samples done, time left) on the main process
    shown = PartialState().is_main_process
    common = dict(max_new_tokens=WORD_PROBLEM_TOKENS, batch_size=batch_size, seed=seed, show_progress=shown)
    sampled = evaluate_model(
        model, tokenizer, held_out, gsm8k_classify, k=1, num_samples=num_samples, temperature=temperature, **common
    )
    greedy = evaluate_model(model, tokenizer, held_out, gsm8k_classify, k=1, temperature=0.0, **common)
    per_problem = [record["num_correct"] / num_samples for record in sampled.records]
    lengths = [tokens for record in sampled.records for tokens in record["num_tokens"]]
    spread = statistics.stdev(per_problem) if len(per_problem) > 1 else float("nan")
    return {
        "num_problems": len(held_out),
        "num_samples": num_samples,
        "temperature": temperature,
        "pass@1": sampled.pass_at_1,
        "pass@1_se": sampled.standard_errors["pass@1"],
        "pass@1_problem_se": spread / len(per_problem) ** 0.5,
        "problems_0<p<1": sum(0 < p < 1 for p in per_problem) / len(per_problem),
        "greedy_accuracy": greedy.pass_at_1,
        "mean_completion_tokens": sum(lengths) / len(lengths),
        "truncated_rate": sum(t for record in sampled.records for t in record["truncated"]) / len(lengths),
    }
