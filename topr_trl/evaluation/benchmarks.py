"""Loaders for GSM8K and MATH that produce the two columns every part of this package uses:

* ``prompt``: a conversational prompt (``[{"role": "user", "content": ...}]``, optionally after a system
  message and few-shot turns) or, with ``chat=False``, a plain string;
* ``answer``: the final reference answer as a string (``"18"`` for GSM8K, the content of the last
  ``\\boxed{}`` of the reference solution for MATH), what `topr_trl.evaluation.rewards` and
  `topr_trl.evaluation.runner` compare completions with.

The other columns of the source are kept (GSM8K's full reference solution moves to ``solution``, since
``answer`` now holds the bare number), so per-level or per-subject breakdowns stay possible.

``source`` is what `topr_trl.inputs.sources.load_data_source` loads: a Hugging Face Hub dataset id, or local data: one
``.json``/``.jsonl``/``.csv``/``.parquet`` file (it holds the requested split), a mapping ``{split: file}``, a
``save_to_disk`` folder, or a directory holding files named after their split (``test.jsonl``,
``train-00000-of-00001.parquet``, ...), as in a downloaded copy of a Hub dataset repository.

The few-shot examples are short original problems written for this package (not taken from GSM8K or MATH),
each with a worked solution ending the way the rewards expect: ``The answer is N.`` for GSM8K, a final
``\\boxed{}`` for MATH.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from datasets import Dataset, concatenate_datasets

from ..inputs.sources import load_data_source
from .rewards import extract_boxed, extract_gsm8k_answer


logger = logging.getLogger(__name__)

__all__ = [
    "GSM8K_FEW_SHOT",
    "MATH_FEW_SHOT",
    "MATH_INSTRUCTION",
    "build_prompt",
    "gsm8k_reference_answer",
    "load_gsm8k",
    "load_math",
    "load_math500",
]

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""Appended to every MATH problem by default: answers are only read from a final `\\boxed{}`."""

GSM8K_FEW_SHOT: tuple[tuple[str, str], ...] = (
    (
        "Lena has 12 stickers. She buys 3 packs with 5 stickers in each pack. How many stickers does she have now?",
        "The 3 packs hold 3 * 5 = 15 stickers. Lena now has 12 + 15 = 27 stickers. The answer is 27.",
    ),
    (
        "A baker makes 48 rolls and puts them into bags of 6. He sells 5 of the bags. How many bags are left?",
        "The baker fills 48 / 6 = 8 bags. After selling 5 of them, 8 - 5 = 3 bags are left. The answer is 3.",
    ),
    (
        "Tom runs 3 kilometers on every weekday and 5 kilometers on each day of the weekend. "
        "How many kilometers does he run in a week?",
        "On the 5 weekdays he runs 5 * 3 = 15 kilometers. On the 2 weekend days he runs 2 * 5 = 10 kilometers. "
        "In a week he runs 15 + 10 = 25 kilometers. The answer is 25.",
    ),
    (
        "A notebook costs $4 and a pen costs $2 less than a notebook. How much do 3 notebooks and 2 pens cost?",
        "A pen costs 4 - 2 = $2. Three notebooks cost 3 * 4 = $12 and two pens cost 2 * 2 = $4. "
        "Together they cost 12 + 4 = $16. The answer is 16.",
    ),
    (
        "There are 30 students in a class. One third of them walk to school and the rest take the bus. "
        "How many students take the bus?",
        "One third of 30 is 30 / 3 = 10 students who walk. So 30 - 10 = 20 students take the bus. The answer is 20.",
    ),
    (
        "Maria reads 15 pages a day. Her book has 120 pages and she has already read 45 of them. "
        "How many more days does she need to finish the book?",
        "She still has 120 - 45 = 75 pages to read. At 15 pages a day that takes 75 / 15 = 5 days. The answer is 5.",
    ),
    (
        "A garden has 4 rows of 7 tomato plants. Each plant gives 6 tomatoes. How many tomatoes does the garden give?",
        "The garden has 4 * 7 = 28 plants. They give 28 * 6 = 168 tomatoes. The answer is 168.",
    ),
    (
        "Sam saved $50. He spent $18 on a game and then half of the remaining money on a book. "
        "How much money does he have left?",
        "After the game Sam has 50 - 18 = $32. The book costs half of that, 32 / 2 = $16. "
        "He has 32 - 16 = $16 left. The answer is 16.",
    ),
)
"""Eight original grade-school problems with worked solutions ending in `The answer is N.`"""

MATH_FEW_SHOT: tuple[tuple[str, str], ...] = (
    (
        "What is the value of $3x + 2$ when $x = 5$?",
        "Substituting $x = 5$ gives $3 \\cdot 5 + 2 = 15 + 2 = 17$. The final answer is $\\boxed{17}$.",
    ),
    (
        "Simplify $\\frac{12}{18}$.",
        "The greatest common divisor of 12 and 18 is 6, so $\\frac{12}{18} = \\frac{12 \\div 6}{18 \\div 6} = "
        "\\frac{2}{3}$. The final answer is $\\boxed{\\frac{2}{3}}$.",
    ),
    (
        "Solve for $x$: $2x - 7 = 11$.",
        "Adding 7 to both sides gives $2x = 18$, and dividing by 2 gives $x = 9$. The final answer is $\\boxed{9}$.",
    ),
    (
        "How many positive divisors does $12$ have?",
        "Since $12 = 2^2 \\cdot 3$, it has $(2 + 1)(1 + 1) = 6$ positive divisors: 1, 2, 3, 4, 6 and 12. "
        "The final answer is $\\boxed{6}$.",
    ),
)
"""Four original MATH-style problems with worked solutions ending in a `\\boxed{}` answer."""

_PLAIN_LABELS = {"gsm8k": ("Question", "Answer"), "math": ("Problem", "Solution")}


# ---------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------


def _with_instruction(question: str, instruction: str | None) -> str:
    question = question.strip()
    return f"{question}\n{instruction}" if instruction else question


def build_prompt(
    question: str,
    examples: Sequence[tuple[str, str]] = (),
    chat: bool = True,
    system_prompt: str | None = None,
    instruction: str | None = None,
    labels: tuple[str, str] = ("Question", "Answer"),
):
    """The prompt for `question` after the worked `examples` ((question, solution) pairs).

    `chat=True`: a list of messages: the optional system message, one user/assistant turn per example, and a
    final user turn with the question. `chat=False`: one string, the optional system prompt, then
    `"<Question>: ...\\n<Answer>: ..."` blocks separated by blank lines, ending with `"<Question>: ...\\n<Answer>:"`
    for the model to complete (`labels` names the two parts). `instruction`, when given, follows every question."""
    if chat:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        for example_question, solution in examples:
            messages.append({"role": "user", "content": _with_instruction(example_question, instruction)})
            messages.append({"role": "assistant", "content": solution})
        messages.append({"role": "user", "content": _with_instruction(question, instruction)})
        return messages
    question_label, answer_label = labels
    blocks = [system_prompt.strip()] if system_prompt else []
    for example_question, solution in examples:
        blocks.append(
            f"{question_label}: {_with_instruction(example_question, instruction)}\n{answer_label}: {solution}"
        )
    blocks.append(f"{question_label}: {_with_instruction(question, instruction)}\n{answer_label}:")
    return "\n\n".join(blocks)


def _few_shot_examples(few_shot: int, pool: Sequence[tuple[str, str]], name: str) -> list[tuple[str, str]]:
    if isinstance(few_shot, bool) or not isinstance(few_shot, int) or not 0 <= few_shot <= len(pool):
        raise ValueError(f"{name}: few_shot must be an integer from 0 to {len(pool)}, got {few_shot!r}")
    return list(pool[:few_shot])


def _require_columns(dataset: Dataset, columns: Sequence[str], name: str) -> None:
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise ValueError(f"{name}: missing column(s) {missing}; the data has {dataset.column_names}")


# ---------------------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------------------

_BARE_NUMBER = re.compile(r"\s*[-\u2212]?\s*\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:\s*/\s*\d+)?\s*")


def gsm8k_reference_answer(solution) -> str:
    """The final answer of a GSM8K reference: the number after the last `####` (or another answer marker) of a
    full solution, or a bare number as it is; returned canonically (`"1,200"` -> `"1200"`).
    Raises ValueError when there is none."""
    if isinstance(solution, (int, float)) and not isinstance(solution, bool):
        solution = str(solution)
    text = str(solution)
    if any(char.isdigit() for char in text) and _BARE_NUMBER.fullmatch(text):
        answer = extract_gsm8k_answer(text, fallback_to_last_number=True)
    else:
        answer = extract_gsm8k_answer(text, fallback_to_last_number=False)
    if answer is None:
        raise ValueError(f"no final answer ('#### <number>') in the GSM8K reference {text[-200:]!r}")
    return answer


def load_gsm8k(
    split: str = "train",
    source="openai/gsm8k",
    config: str | None = "main",
    chat: bool = True,
    few_shot: int = 0,
    system_prompt: str | None = None,
    instruction: str | None = None,
    question_column: str = "question",
    answer_column: str = "answer",
    cache_dir: str | None = None,
) -> Dataset:
    """GSM8K with columns `prompt` (the question, conversational or plain, after `few_shot` worked examples)
    and `answer` (the reference number as a string, e.g. `"18"`); the full reference solution is kept in
    `solution`, other source columns as they are.

    `source`: a Hub id (schema `question` / `answer`, the answer ending in `#### <n>`), a local
    `.json`/`.jsonl`/`.csv`/`.parquet` file, a `{split: file}` mapping or a directory (see
    `topr_trl.inputs.sources.load_data_source`); the answer column may also hold bare numbers. `few_shot` (0 to 8)
    prepends this package's own worked examples, as user/assistant turns with `chat=True`, as
    `Question: ...\\nAnswer: ...` blocks otherwise. `instruction` (none by default) is appended to every question;
    `system_prompt` starts the prompt."""
    examples = _few_shot_examples(few_shot, GSM8K_FEW_SHOT, "load_gsm8k")
    dataset = load_data_source(source, split, config, cache_dir)
    _require_columns(dataset, [question_column, answer_column], "load_gsm8k")

    answers = []
    for index, solution in enumerate(dataset[answer_column]):
        try:
            answers.append(gsm8k_reference_answer(solution))
        except ValueError as error:
            raise ValueError(f"load_gsm8k: row {index} of {source!r}: {error}") from None
    prompts = [
        build_prompt(question, examples, chat, system_prompt, instruction, _PLAIN_LABELS["gsm8k"])
        for question in dataset[question_column]
    ]
    solutions = [str(solution) for solution in dataset[answer_column]]
    removed = [column for column in dataset.column_names if column in ("prompt", "answer", "solution", answer_column)]
    dataset = dataset.remove_columns(removed)
    return _finish(
        dataset.add_column("prompt", prompts).add_column("answer", answers).add_column("solution", solutions)
    )


# ---------------------------------------------------------------------------------------------------------
# MATH
# ---------------------------------------------------------------------------------------------------------


def _finish(dataset: Dataset) -> Dataset:
    """`prompt` and `answer` first, the other columns after them."""
    rest = [column for column in dataset.column_names if column not in ("prompt", "answer")]
    return dataset.select_columns(["prompt", "answer", *rest])


def _math_dataset(
    dataset: Dataset,
    name: str,
    problem_column: str,
    answer_of,
    chat: bool,
    few_shot: int,
    system_prompt: str | None,
    instruction: str | None,
) -> Dataset:
    examples = _few_shot_examples(few_shot, MATH_FEW_SHOT, name)
    answers = [answer_of(row) for row in dataset]
    keep = [index for index, answer in enumerate(answers) if answer]
    if len(keep) < len(answers):
        logger.warning(
            "%s: dropped %d of %d rows without a reference answer (no \\boxed{} in the solution)",
            name,
            len(answers) - len(keep),
            len(answers),
        )
        if not keep:
            raise ValueError(f"{name}: no row has a reference answer")
        dataset = dataset.select(keep)
        answers = [answers[index] for index in keep]
    prompts = [
        build_prompt(problem, examples, chat, system_prompt, instruction, _PLAIN_LABELS["math"])
        for problem in dataset[problem_column]
    ]
    removed = [column for column in ("prompt", "answer") if column in dataset.column_names]
    dataset = dataset.remove_columns(removed).add_column("prompt", prompts).add_column("answer", answers)
    return _finish(dataset)


def load_math(
    split: str = "train",
    source="EleutherAI/hendrycks_math",
    config: str | Sequence[str] | None = None,
    chat: bool = True,
    few_shot: int = 0,
    system_prompt: str | None = None,
    instruction: str | None = MATH_INSTRUCTION,
    problem_column: str = "problem",
    solution_column: str = "solution",
    cache_dir: str | None = None,
) -> Dataset:
    """MATH (Hendrycks et al., 2021) with columns `prompt` and `answer` (the content of the last `\\boxed{}`
    of the reference solution, via `topr_trl.evaluation.rewards.extract_boxed`); the source columns are kept. Rows whose
    solution has no box are dropped with a warning.

    `source` is a Hub id or local data (see `topr_trl.inputs.sources.load_data_source`); the default Hub id and its
    configs are not checked here: some copies of MATH have one config per subject, so `config` may be a list of
    configs, whose splits are concatenated. `instruction` (default `MATH_INSTRUCTION`, asking for a boxed answer)
    is appended to every problem; `few_shot` (0 to 4) prepends worked examples ending in a box."""
    configs = list(config) if isinstance(config, (list, tuple)) else [config]
    parts = [load_data_source(source, split, name, cache_dir) for name in configs]
    dataset = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    _require_columns(dataset, [problem_column, solution_column], "load_math")
    return _math_dataset(
        dataset,
        "load_math",
        problem_column,
        lambda row: extract_boxed(str(row[solution_column])),
        chat,
        few_shot,
        system_prompt,
        instruction,
    )


def load_math500(
    source="HuggingFaceH4/MATH-500",
    split: str = "test",
    chat: bool = True,
    few_shot: int = 0,
    system_prompt: str | None = None,
    instruction: str | None = MATH_INSTRUCTION,
    problem_column: str = "problem",
    answer_column: str = "answer",
    solution_column: str = "solution",
    config: str | None = None,
    cache_dir: str | None = None,
) -> Dataset:
    """MATH-500 (the 500-problem test subset of Lightman et al., 2023) with columns `prompt` and `answer`
    (its `answer` column as a string; where that column is missing or empty, the last `\\boxed{}` of
    `solution`). Same prompt options as `load_math`."""
    dataset = load_data_source(source, split, config, cache_dir)
    if answer_column not in dataset.column_names and solution_column not in dataset.column_names:
        raise ValueError(
            f"load_math500: need a {answer_column!r} or {solution_column!r} column; the data has {dataset.column_names}"
        )
    _require_columns(dataset, [problem_column], "load_math500")

    def answer_of(row):
        answer = row.get(answer_column)
        if answer is not None and str(answer).strip():
            return str(answer).strip()
        solution = row.get(solution_column)
        return extract_boxed(str(solution)) if solution is not None else None

    return _math_dataset(dataset, "load_math500", problem_column, answer_of, chat, few_shot, system_prompt, instruction)
