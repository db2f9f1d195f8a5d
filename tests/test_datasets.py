"""GSM8K / MATH / MATH-500 loaders on small local files in the Hub schemas (no Hub access)."""

import json
import logging
import re
from fractions import Fraction

import pytest
from datasets import Dataset

from topr_trl.evaluation.benchmarks import (
    GSM8K_FEW_SHOT,
    MATH_FEW_SHOT,
    MATH_INSTRUCTION,
    gsm8k_reference_answer,
    load_gsm8k,
    load_math,
    load_math500,
)
from topr_trl.evaluation.rewards import CORRECT, classify_gsm8k, classify_math, extract_boxed


GSM8K_ROWS = [
    {"question": "Ann has 3 boxes of 24 pens. How many pens?", "answer": "3 * 24 = <<3*24=72>>72\n#### 72"},
    {"question": "A car costs $1,000 more than $200. Price?", "answer": "200 + 1000 = 1200\n#### 1,200"},
    {"question": "It is 2 degrees and drops by 5. Temperature?", "answer": "2 - 5 = -3\n#### -3"},
]
MATH_ROWS = [
    {
        "problem": "Compute $\\frac{1}{4} + \\frac{1}{4}$.",
        "solution": "It is $\\boxed{\\frac{1}{2}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {
        "problem": "What is $2^3$?",
        "solution": "First $\\boxed{4}$ is wrong; $2^3 = \\boxed{8}$.",
        "level": "Level 2",
        "type": "Algebra",
    },
    {
        "problem": "Describe a circle.",
        "solution": "A set of points at a fixed distance.",
        "level": "Level 1",
        "type": "Geometry",
    },
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "hf-cache")


@pytest.fixture
def gsm8k_file(tmp_path):
    return write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)


def test_gsm8k_columns_answers_and_chat_prompts(gsm8k_file, cache):
    data = load_gsm8k(split="test", source=gsm8k_file, cache_dir=cache)
    assert data.column_names[:2] == ["prompt", "answer"]
    assert set(data.column_names) == {"prompt", "answer", "question", "solution"}
    assert data["answer"] == ["72", "1200", "-3"]
    assert data["solution"] == [row["answer"] for row in GSM8K_ROWS]
    assert data["prompt"][0] == [{"role": "user", "content": GSM8K_ROWS[0]["question"]}]
    # The references work with the GSM8K classifier.
    assert classify_gsm8k("so the answer is 1200.", data["answer"][1]) == CORRECT


def test_gsm8k_plain_prompts_and_system_prompt(gsm8k_file, cache):
    data = load_gsm8k(split="test", source=gsm8k_file, chat=False, system_prompt="Solve it.", cache_dir=cache)
    prompt = data["prompt"][0]
    assert isinstance(prompt, str)
    assert prompt == f"Solve it.\n\nQuestion: {GSM8K_ROWS[0]['question']}\nAnswer:"
    chat = load_gsm8k(split="test", source=gsm8k_file, system_prompt="Solve it.", cache_dir=cache)["prompt"][0]
    assert chat[0] == {"role": "system", "content": "Solve it."} and len(chat) == 2


@pytest.mark.parametrize("few_shot", [1, 3, 8])
def test_gsm8k_few_shot_counts(gsm8k_file, cache, few_shot):
    chat = load_gsm8k(split="test", source=gsm8k_file, few_shot=few_shot, system_prompt="S", cache_dir=cache)
    messages = chat["prompt"][2]
    assert len(messages) == 1 + 2 * few_shot + 1
    assert [m["role"] for m in messages[1:-1]] == ["user", "assistant"] * few_shot
    assert messages[-1] == {"role": "user", "content": GSM8K_ROWS[2]["question"]}
    assert [m["content"] for m in messages[2:-1:2]] == [solution for _, solution in GSM8K_FEW_SHOT[:few_shot]]
    plain = load_gsm8k(split="test", source=gsm8k_file, few_shot=few_shot, chat=False, cache_dir=cache)["prompt"][0]
    assert plain.count("Question:") == few_shot + 1 and plain.count("The answer is") == few_shot
    assert plain.endswith(f"Question: {GSM8K_ROWS[0]['question']}\nAnswer:")


@pytest.mark.parametrize("few_shot", [-1, 9, 1.5, True])
def test_gsm8k_few_shot_out_of_range(gsm8k_file, few_shot):
    with pytest.raises(ValueError, match="few_shot"):
        load_gsm8k(split="test", source=gsm8k_file, few_shot=few_shot)


_STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)")


def test_gsm8k_few_shot_examples_are_right():
    """Every calculation in the worked examples is correct, and each ends with its final result as the answer."""
    assert len(GSM8K_FEW_SHOT) == 8
    for _, solution in GSM8K_FEW_SHOT:
        steps = _STEP.findall(solution)
        assert steps, solution
        for a, op, b, result in steps:
            value = {
                "+": Fraction(a) + int(b),
                "-": Fraction(a) - int(b),
                "*": Fraction(a) * int(b),
                "/": Fraction(a) / int(b),
            }[op]
            assert value == int(result), (solution, a, op, b, result)
        assert solution.endswith(f"The answer is {steps[-1][3]}.")
        assert classify_gsm8k(solution, steps[-1][3]) == CORRECT


def test_gsm8k_parquet_directory_and_mapping_sources(tmp_path, cache):
    Dataset.from_list(GSM8K_ROWS).to_parquet(str(tmp_path / "rows.parquet"))
    assert load_gsm8k(split="train", source=str(tmp_path / "rows.parquet"), cache_dir=cache)["answer"] == [
        "72",
        "1200",
        "-3",
    ]
    folder = tmp_path / "copy" / "main"
    folder.mkdir(parents=True)
    Dataset.from_list(GSM8K_ROWS[:1]).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    Dataset.from_list(GSM8K_ROWS[1:]).to_parquet(str(folder / "test-00000-of-00001.parquet"))
    assert load_gsm8k(split="test", source=str(tmp_path / "copy"), cache_dir=cache)["answer"] == ["1200", "-3"]
    assert load_gsm8k(split="train", source=str(tmp_path / "copy"), cache_dir=cache)["answer"] == ["72"]
    with pytest.raises(ValueError, match=r"unknown split 'validation'.*\['test', 'train'\]"):
        load_gsm8k(split="validation", source=str(tmp_path / "copy"))
    mapping = {"dev": write_jsonl(tmp_path / "dev.jsonl", GSM8K_ROWS[2:])}
    assert load_gsm8k(split="dev", source=mapping, cache_dir=cache)["answer"] == ["-3"]
    with pytest.raises(ValueError, match=r"unknown split 'test'.*\['dev'\]"):
        load_gsm8k(split="test", source=mapping)


def test_gsm8k_bare_number_answers(tmp_path, cache):
    rows = [{"question": "q1", "answer": 18}, {"question": "q2", "answer": 5}]
    path = write_jsonl(tmp_path / "bare.jsonl", rows)
    assert load_gsm8k(split="test", source=path, cache_dir=cache)["answer"] == ["18", "5"]
    assert gsm8k_reference_answer("1,200") == "1200"
    assert gsm8k_reference_answer("He pays 4 * 2 = 8 dollars.\n#### 8") == "8"
    with pytest.raises(ValueError, match="no final answer"):
        gsm8k_reference_answer("He pays 4 * 2 = 8 dollars.")


def test_gsm8k_clear_errors(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_gsm8k(split="test", source=str(tmp_path / "missing.jsonl"))
    spreadsheet = tmp_path / "data.xlsx"
    spreadsheet.write_text("question,answer\nq,#### 1\n")
    with pytest.raises(ValueError, match="unsupported local data file"):
        load_gsm8k(split="test", source=str(spreadsheet))
    csv = tmp_path / "data.csv"  # csv loads like json and parquet
    csv.write_text("question,answer\nq,#### 1\n")
    assert load_gsm8k(split="test", source=str(csv), cache_dir=cache)["answer"] == ["1"]
    no_marker = write_jsonl(tmp_path / "bad.jsonl", GSM8K_ROWS[:1] + [{"question": "q", "answer": "eight apples"}])
    with pytest.raises(ValueError, match="row 1"):
        load_gsm8k(split="test", source=no_marker, cache_dir=cache)
    wrong_schema = write_jsonl(tmp_path / "schema.jsonl", [{"problem": "q", "answer": "#### 1"}])
    with pytest.raises(ValueError, match=r"missing column\(s\) \['question'\]"):
        load_gsm8k(split="test", source=wrong_schema, cache_dir=cache)


def test_unreachable_hub_dataset_says_what_to_do():
    with pytest.raises(FileNotFoundError, match="local .json/.jsonl/.csv/.parquet file .* or a save_to_disk folder"):
        load_gsm8k(split="test", source="topr-trl-tests/no-such-dataset")


def test_math_boxed_answers_instruction_and_dropped_rows(tmp_path, cache, caplog):
    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    with caplog.at_level(logging.WARNING, logger="topr_trl.evaluation.benchmarks"):
        data = load_math(split="test", source=path, cache_dir=cache)
    assert "dropped 1 of 3" in caplog.text
    assert data.column_names[:2] == ["prompt", "answer"]
    assert {"problem", "solution", "level", "type"} <= set(data.column_names)
    assert data["answer"] == ["\\frac{1}{2}", "8"]  # nested braces kept, the last box wins
    assert data["prompt"][0] == [{"role": "user", "content": f"{MATH_ROWS[0]['problem']}\n{MATH_INSTRUCTION}"}]
    bare = load_math(split="test", source=path, instruction=None, chat=False, cache_dir=cache)
    assert bare["prompt"][1] == f"Problem: {MATH_ROWS[1]['problem']}\nSolution:"
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"q": "What is 1+1?", "sol": "$\\boxed{2}$"}])
    custom = load_math(split="test", source=renamed, problem_column="q", solution_column="sol", cache_dir=cache)
    assert custom["answer"] == ["2"]


def test_math_few_shot(tmp_path, cache):
    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS[:2])
    messages = load_math(split="test", source=path, few_shot=2, cache_dir=cache)["prompt"][0]
    assert len(messages) == 5 and messages[1]["content"] == MATH_FEW_SHOT[0][1]
    for _, solution in MATH_FEW_SHOT:
        answer = extract_boxed(solution)
        assert answer and classify_math(solution, answer) == CORRECT
    with pytest.raises(ValueError, match="few_shot"):
        load_math(split="test", source=path, few_shot=len(MATH_FEW_SHOT) + 1)


def test_math500_answer_column(tmp_path, cache):
    rows = [
        {
            "problem": "What is 1+2?",
            "solution": "$1+2=\\boxed{3}$",
            "answer": "3",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "a/1.json",
        },
        {
            "problem": "Half of 1?",
            "solution": "$\\boxed{\\frac12}$",
            "answer": "",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "a/2.json",
        },
    ]
    data = load_math500(source=write_jsonl(tmp_path / "test.jsonl", rows), cache_dir=cache)
    assert data["answer"] == ["3", "\\frac12"]  # an empty answer falls back to the solution's box
    assert data["unique_id"] == ["a/1.json", "a/2.json"]
    assert data["prompt"][0][-1]["content"].startswith("What is 1+2?")
