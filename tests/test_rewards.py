"""Answer extraction, correctness classes and TRL reward functions of `topr_trl.evaluation.rewards`."""

import ast
import json
import re
from pathlib import Path

import pytest

from topr_trl.evaluation import rewards
from topr_trl.evaluation.rewards import (
    CORRECT,
    INCORRECT,
    INVALID,
    classify_gsm8k,
    classify_math,
    extract_boxed,
    extract_gsm8k_answer,
    format_reward,
    gsm8k_numbers_equal,
    gsm8k_reward,
    make_format_reward,
    make_gsm8k_reward,
    make_math_reward,
    math_answers_equal,
    math_reward,
    parse_gsm8k_number,
)


GSM8K_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"
SOLUTION_KEYS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")

# ------------------------------------------------------------------------------------------------------------
# GSM8K extraction
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She makes 9 * 2 = $18 every day.\nA: 18", "18"),
        ("The answer is 1,234.", "1234"),
        ("The answer is $1,200,000.", "1200000"),
        ("#### $18", "18"),
        ("A: 18 dollars", "18"),
        ("A: 18 eggs", "18"),
        ("The answer is 5 km.", "5"),
        ("The answer is -3.", "-3"),
        ("The answer is \u22123", "-3"),
        ("The answer is -$3", "-3"),
        ("The answer is $-3", "-3"),
        ("#### 2.50", "2.50"),
        ("A: $.40", ".40"),
        ("The answer is 1/2 of the cake.", "1/2"),
        ("The answer is 3 + 4 = 7.", "7"),
        ("The answer is 18. Then x = 4 is the rest.", "18"),
        ("A: $<<9*2=18>>18", "18"),
        ("So the total is \\boxed{18}.", "18"),
        ("\\boxed{\\$1{,}200}", "1200"),
        ("\\boxed{\\frac{1}{2}}", "1/2"),
        ("\\boxed{-\\dfrac{3}{4}}", "-3/4"),
        ("\\boxed{18 \\text{ eggs}}", "18"),
        ("The answer is:\n\n42", "42"),
        ("Final Answer: 7", "7"),
    ],
)
def test_extracts_marked_answers(text, expected):
    assert extract_gsm8k_answer(text) == expected
    assert extract_gsm8k_answer(text, fallback_to_last_number=False) == expected


def test_last_marker_wins():
    text = "The answer is 5.\nWait, I made a mistake.\n#### 7\nLet me check: \\boxed{9}\nA: 11"
    assert extract_gsm8k_answer(text) == "11"
    assert extract_gsm8k_answer("A: 11\nSo the answer is \\boxed{12}.") == "12"
    assert extract_gsm8k_answer("\\boxed{3} no, \\boxed{4}") == "4"
    # A marker without a number does not hide an earlier one that has a number.
    assert extract_gsm8k_answer("The answer is 6.\nThe answer is unknown to me", fallback_to_last_number=False) == "6"


def test_a_colon_counts_only_at_a_line_start():
    assert extract_gsm8k_answer("Plan A: 3 apples, then 4 more", fallback_to_last_number=False) is None
    assert extract_gsm8k_answer("Plan A: 3 apples, then 4 more") == "4"
    assert extract_gsm8k_answer("  A: 3", fallback_to_last_number=False) == "3"


def test_fallback_to_last_number_on_and_off():
    text = "16 - 3 - 4 = <<16-3-4=9>>9 eggs, and 9 * 2 = $<<9*2=18>>18 a day"
    assert extract_gsm8k_answer(text) == "18"
    assert extract_gsm8k_answer(text, fallback_to_last_number=False) is None
    assert extract_gsm8k_answer("costs $5-$3 in the end") == "3"  # "-" glued to a digit is not a sign
    assert extract_gsm8k_answer("so 10 - 3 = 7 and then 20 - 5") == "5"  # "- 5" is not negative
    assert extract_gsm8k_answer("she has 1,234 marbles") == "1234"
    assert extract_gsm8k_answer("so the list is 3,4") == "4"
    assert extract_gsm8k_answer("I do not know.") is None
    assert extract_gsm8k_answer("") is None


def test_truncated_box_is_ignored():
    assert extract_boxed("\\boxed{1} and \\boxed{\\frac{1}{2}") == "1"
    assert extract_gsm8k_answer("\\boxed{\\frac{1}{2}", fallback_to_last_number=False) is None


@pytest.mark.parametrize(
    "a, b",
    [
        ("18.00", "18"),
        ("$1,200", "1200"),
        ("1,200 dollars", "1200.0"),
        ("1/2", "0.5"),
        ("-3", "\u22123"),
        ("\\frac{3}{4}", ".75"),
        ("18", 18),
        ("2.5", 2.5),
    ],
)
def test_numbers_equal(a, b):
    assert gsm8k_numbers_equal(a, b)
    assert gsm8k_numbers_equal(b, a)


@pytest.mark.parametrize(
    "a, b", [("18", "19"), ("-3", "3"), ("0.33", "1/3"), ("1,200", "12"), ("18", "no number"), (None, "1")]
)
def test_numbers_differ(a, b):
    assert not gsm8k_numbers_equal(a, b)


def test_parse_number_values():
    from fractions import Fraction

    assert parse_gsm8k_number("1,234.5 km") == Fraction(24690, 20)
    assert parse_gsm8k_number("-$2.50") == Fraction(-5, 2)
    assert parse_gsm8k_number("1/0") is None
    assert parse_gsm8k_number("none") is None


def test_classify_gsm8k():
    assert classify_gsm8k("So she earns $18.00 a day.\nA: $18.00", "18") == CORRECT
    assert classify_gsm8k("#### 1,200", "1200") == CORRECT
    assert classify_gsm8k("The answer is 19.", "18") == INCORRECT
    assert classify_gsm8k("I cannot solve this.", "18") == INVALID
    assert classify_gsm8k("She gets 18", "18") == CORRECT
    assert classify_gsm8k("She gets 18", "18", fallback_to_last_number=False) == INVALID
    # References can be full GSM8K solutions or carry thousands commas.
    assert classify_gsm8k("A: 72", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == CORRECT
    assert classify_gsm8k("A: 2125", "2,125") == CORRECT
    assert classify_gsm8k([{"role": "assistant", "content": "A: 5"}], "5") == CORRECT
    with pytest.raises(ValueError):
        classify_gsm8k("A: 5", "no number here")


# ------------------------------------------------------------------------------------------------------------
# Reward functions
# ------------------------------------------------------------------------------------------------------------


def test_gsm8k_reward_paper_defaults_plain_and_conversational():
    completions = ["The answer is 18.", "The answer is 19.", "no idea"]
    conversational = [[{"role": "assistant", "content": text}] for text in completions]
    expected = [1.0, -1.0, -1.0]
    assert gsm8k_reward(completions, answer=["18", "18", "18"]) == expected
    assert gsm8k_reward(conversational, answer=["18", "18", "18"], prompts=None, trainer_state=None) == expected
    assert gsm8k_reward.__name__ == "gsm8k_reward"
    with pytest.raises(ValueError):
        gsm8k_reward(completions, answer=["18"])


def test_gsm8k_reward_mapping_is_configurable():
    reward = make_gsm8k_reward(correct=2.0, incorrect=-0.5, invalid=-3.0, name="gsm8k_strict")
    assert reward.__name__ == "gsm8k_strict"
    assert reward(["#### 4", "#### 5", "nothing"], answer=["4", "4", "4"]) == [2.0, -0.5, -3.0]
    strict = make_gsm8k_reward(fallback_to_last_number=False)
    assert strict(["she has 4", "#### 4"], answer=["4", "4"]) == [-1.0, 1.0]
    invalid_is_zero = make_gsm8k_reward(invalid=0.0)
    assert invalid_is_zero(["she has 4", "nothing"], answer=["4", "4"]) == [1.0, 0.0]


def test_format_reward():
    completions = ["The answer is 3", "\\boxed{x+1}", "#### 2", "A: 7", "it is 3", "\\boxed{}", "The answer is"]
    assert format_reward(completions) == [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
    assert format_reward([[{"role": "assistant", "content": "#### 2"}]]) == [1.0]
    assert format_reward.__name__ == "format_reward"
    assert make_format_reward(present=0.5, absent=0.0, name="fmt")(["#### 1", "1"]) == [0.5, 0.0]


# ------------------------------------------------------------------------------------------------------------
# Real model solutions (OpenAI grade-school-math, labelled by its authors)
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def labelled_solutions():
    path = GSM8K_DATA / "example_model_solutions.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is absent (no ../shared checkout)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    items = []
    for row in rows:
        reference = re.search(r"A:\s*(.+?)\s*$", row["ground_truth"]).group(1)
        for key in SOLUTION_KEYS:
            items.append((row[key]["solution"], reference, row[key]["is_correct"]))
    return items


def _agreement(items, fallback_to_last_number=True):
    agree, disagreements = 0, []
    for solution, reference, label in items:
        correct = classify_gsm8k(solution, reference, fallback_to_last_number=fallback_to_last_number) == CORRECT
        agree += correct == label
        if correct != label:
            disagreements.append((reference, label, solution[-120:]))
    return agree / len(items), disagreements


def test_agreement_with_labelled_model_solutions(labelled_solutions):
    assert len(labelled_solutions) == 4 * 1319
    for fallback in (True, False):
        agreement, disagreements = _agreement(labelled_solutions, fallback)
        print(f"\nGSM8K label agreement (fallback={fallback}): {agreement:.4%}, disagreements: {disagreements[:5]}")
        # Measured: 100 % (5276 / 5276) with and without the last-number fallback.
        assert agreement >= 0.999, disagreements[:10]
    # Without the fallback, exactly the solutions that never state "A:" on a line are invalid.
    no_marker = sum(not re.search(r"(?m)^A:", solution) for solution, _, _ in labelled_solutions)
    invalid = sum(classify_gsm8k(s, r, fallback_to_last_number=False) == INVALID for s, r, _ in labelled_solutions)
    assert invalid == no_marker > 0


@pytest.mark.parametrize(
    "template",
    ["The answer is ${value}.", "#### {value}", "So the final answer is \\boxed{{{value}}}.", "A: {value} units"],
)
def test_agreement_survives_other_answer_formats(labelled_solutions, template):
    """The same real solutions with their final `A: <n>` line rewritten in other formats (with currency,
    thousands commas for integers, units), against the same labels."""
    rewritten = []
    for solution, reference, label in labelled_solutions:
        match = re.search(r"(?m)^A:\s*(.*?)\s*$", solution)
        if not match:
            continue
        value = match.group(1)
        if re.fullmatch(r"-?\d+", value):
            value = f"{int(value):,}"
        rewritten.append((solution[: match.start()] + template.format(value=value), reference, label))
    agreement, disagreements = _agreement(rewritten, fallback_to_last_number=False)
    assert agreement >= 0.999, disagreements[:10]


def test_shifted_answers_are_incorrect(labelled_solutions):
    """A control: the correct solutions with their answer changed by one are all judged incorrect."""
    for solution, reference, label in labelled_solutions:
        if label:
            shifted = re.sub(r"(?m)^A:.*$", f"A: {parse_gsm8k_number(reference) + 1}", solution)
            assert classify_gsm8k(shifted, reference) == INCORRECT


# ------------------------------------------------------------------------------------------------------------
# MATH
# ------------------------------------------------------------------------------------------------------------


def test_extract_boxed_nested_and_last():
    assert extract_boxed("so \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} then \\boxed{\\sqrt{\\frac{a}{b}}} done") == "\\sqrt{\\frac{a}{b}}"
    assert extract_boxed("$\\boxed{\\{1, 2\\}}$") == "\\{1, 2\\}"
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_boxed("$\\boxed 5$") == "5"
    assert extract_boxed("no box here") is None


def test_math_verify_is_imported_lazily():
    tree = ast.parse(Path(rewards.__file__).read_text())
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [alias.name for node in top_level for alias in node.names] + [
        node.module for node in top_level if isinstance(node, ast.ImportFrom) and node.module
    ]
    assert not any(name.startswith("math_verify") for name in names)


@pytest.mark.parametrize(
    "prediction, reference",
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{1}{2}", "\\frac12"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("x^2+2x", "x(x+2)"),
        ("\\frac{\\pi}{2}", "\\pi/2"),
        ("-0.75", "-\\frac{3}{4}"),
        ("\\{2, 1\\}", "\\{1,2\\}"),
    ],
)
def test_math_verify_equivalences(prediction, reference):
    pytest.importorskip("math_verify")
    assert math_answers_equal(prediction, reference)


@pytest.mark.parametrize(
    "prediction, reference",
    [("\\frac{1}{3}", "0.5"), ("\\sqrt{2}", "2"), ("x^2+2x", "x^2+2"), ("[2, 5)", "(2, 5)"), ("3", "4")],
)
def test_math_verify_differences(prediction, reference):
    pytest.importorskip("math_verify")
    assert not math_answers_equal(prediction, reference)


def test_classify_math_and_reward():
    pytest.importorskip("math_verify")
    assert classify_math("First \\boxed{1}, no: \\boxed{\\frac{1}{2}}", "0.5") == CORRECT
    assert classify_math("\\boxed{\\frac{1}{2}} then \\boxed{1}", "0.5") == INCORRECT
    assert classify_math("the answer is one half", "0.5") == INVALID
    assert classify_math("\\boxed{}", "0.5") == INVALID
    assert classify_math("\\boxed{2\\sqrt{2}}", "Hence $x = \\boxed{\\sqrt{8}}$.") == CORRECT
    completions = [[{"role": "assistant", "content": c}] for c in ("\\boxed{\\dfrac{1}{2}}", "\\boxed{3}", "none")]
    assert math_reward(completions, answer=["\\frac12"] * 3) == [1.0, -1.0, -1.0]
    assert math_reward.__name__ == "math_reward"
    assert make_math_reward(invalid=-2.0)(completions, answer=["\\frac12"] * 3) == [1.0, -1.0, -2.0]


@pytest.mark.parametrize(
    "prediction, reference, equal",
    [
        ("\\dfrac{1}{2}", "\\frac12", True),
        ("\\frac{1}{2}", "0.5", True),
        ("1,000", "1000", True),
        ("10^\\circ", "10", True),
        ("\\left(1,2\\right)", "(1, 2)", True),
        ("\\text{(B)}", "(B)", True),
        ("5\\%", "5", True),
        ("\\frac{1}{3}", "0.33", False),
        ("2\\sqrt{2}", "\\sqrt{8}", False),  # nothing symbolic without math-verify
        ("x+1", "x+2", False),
    ],
)
def test_normalised_string_fallback(prediction, reference, equal):
    assert math_answers_equal(prediction, reference, use_math_verify=False) is equal


def test_math_verify_works_outside_the_main_thread():
    """math-verify's timeouts use SIGALRM, which raises outside the main thread: they are switched off there."""
    pytest.importorskip("math_verify")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(math_answers_equal, "2\\sqrt{2}", "\\sqrt{8}").result()
        assert not pool.submit(math_answers_equal, "\\sqrt{2}", "2").result()
