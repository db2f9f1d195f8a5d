"""evaluate_model, save_results, the ready-made classifiers and the command line, on the tiny random model."""

import itertools
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from topr_trl.commands.evaluate import main
from topr_trl.evaluation.metrics import mean_pass_at_k
from topr_trl.evaluation.rewards import ANSWER_CLASSES, CORRECT, INCORRECT, INVALID, gsm8k_numbers_equal
from topr_trl.evaluation.runner import evaluate_model, gsm8k_classify, math_classify, save_results
from topr_trl.tasks.arithmetic import arithmetic_classify


FAST = dict(k=4, max_new_tokens=6, show_progress=False)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def arithmetic_result(model_and_tokenizer, arithmetic_dataset):
    model, tokenizer = model_and_tokenizer
    return evaluate_model(model, tokenizer, arithmetic_dataset, arithmetic_classify, **FAST)


def test_result_structure(arithmetic_result, arithmetic_dataset):
    result = arithmetic_result
    assert result.num_prompts == len(arithmetic_dataset) == len(result.records) == 16
    assert result.k == result.num_samples == 4
    assert set(result.metrics) == {"pass@1", "pass@2", "pass@4", "maj@4", "invalid_rate", "incorrect_rate"}
    assert all(0.0 <= value <= 1.0 for value in result.metrics.values())
    classes = [c for record in result.records for c in record["classes"]]
    assert len(classes) == 64 and set(classes) <= set(ANSWER_CLASSES)
    # pass@1 is the mean correctness; the three rates add up to one.
    assert result.pass_at_1 == pytest.approx(classes.count(CORRECT) / 64)
    assert result.invalid_rate == pytest.approx(classes.count(INVALID) / 64)
    assert result.pass_at_1 + result.invalid_rate + result.metrics["incorrect_rate"] == pytest.approx(1.0)
    # The random tiny model writes garbage: some invalid answers, some numbers.
    assert 0 < result.invalid_rate < 1
    counts = [record["num_correct"] for record in result.records]
    assert result.pass_at_k == {
        1: result.pass_at_1,
        2: pytest.approx(mean_pass_at_k(4, counts, 2)),
        4: pytest.approx(sum(c > 0 for c in counts) / 16),
    }
    assert result.pass_at_k[4] >= result.pass_at_k[2] >= result.pass_at_k[1]
    assert len(result.histogram) == 5 and sum(result.histogram) == 16
    assert result.histogram == [counts.count(c) for c in range(5)]
    # Standard errors need K < n: defined at K=1, 2, not at K = n = 4.
    assert result.standard_errors["pass@1"] is not None and result.standard_errors["pass@1"] >= 0
    assert result.standard_errors["pass@4"] is None and result.standard_errors["maj@4"] is None
    record = result.records[0]
    assert record["prompt"] == arithmetic_dataset[0]["prompt"]
    assert record["reference"] == arithmetic_dataset[0]["answer"]
    assert len(record["completions"]) == len(record["answers"]) == len(record["num_tokens"]) == 4
    assert all(1 <= tokens <= 6 for tokens in record["num_tokens"])
    for text, answer_class, answer in zip(record["completions"], record["classes"], record["answers"], strict=False):
        assert arithmetic_classify(text, record["reference"]) == answer_class
        assert (answer is None) == (answer_class == INVALID)


def test_reproducible_under_seed_and_leaves_rng_alone(model_and_tokenizer, arithmetic_dataset, arithmetic_result):
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    again = evaluate_model(model, tokenizer, arithmetic_dataset, arithmetic_classify, **FAST)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state is untouched
    assert [r["completions"] for r in again.records] == [r["completions"] for r in arithmetic_result.records]
    assert again.metrics == arithmetic_result.metrics and again.standard_errors == arithmetic_result.standard_errors
    other = evaluate_model(model, tokenizer, arithmetic_dataset, arithmetic_classify, seed=1, **FAST)
    assert [r["completions"] for r in other.records] != [r["completions"] for r in arithmetic_result.records]


def test_more_samples_than_k_gives_standard_errors_at_k(model_and_tokenizer, arithmetic_dataset):
    model, tokenizer = model_and_tokenizer
    result = evaluate_model(
        model, tokenizer, arithmetic_dataset.select(range(6)), arithmetic_classify, num_samples=8, **FAST
    )
    assert result.num_samples == 8 and all(len(r["completions"]) == 8 for r in result.records)
    assert set(result.pass_at_k) == {1, 2, 4}
    assert result.standard_errors["pass@4"] is not None and result.standard_errors["maj@4"] is not None
    assert result.histogram and len(result.histogram) == 9


def test_stub_classifiers_give_exact_metrics(model_and_tokenizer, arithmetic_dataset):
    model, tokenizer = model_and_tokenizer
    data = arithmetic_dataset.select(range(5))
    right = evaluate_model(model, tokenizer, data, lambda text, reference: CORRECT, **FAST)
    assert right.pass_at_1 == 1.0 and right.maj_at_k == 1.0 and right.invalid_rate == 0.0
    assert right.pass_at_k[4] == 1.0 and right.histogram == [0, 0, 0, 0, 5]
    wrong = evaluate_model(model, tokenizer, data, lambda text, reference: INVALID, **FAST)
    assert wrong.pass_at_1 == 0.0 and wrong.maj_at_k == 0.0 and wrong.invalid_rate == 1.0
    assert wrong.histogram == [5, 0, 0, 0, 0]
    boolean = evaluate_model(model, tokenizer, data, lambda text, reference: False, **FAST)
    assert boolean.metrics["incorrect_rate"] == 1.0 and boolean.invalid_rate == 0.0


def scripted(classes, answers, equivalent=None):
    """A classifier that classes the samples of every question as `classes` (in sample order) and whose valid
    samples vote `answers` in order: the model's text is ignored, so the metrics are known exactly."""
    class_cycle, answer_cycle = itertools.cycle(classes), itertools.cycle(answers)

    def classify(text, reference):
        return next(class_cycle)

    classify.extract = lambda text: next(answer_cycle)
    classify.equivalent = equivalent
    return classify


@pytest.mark.parametrize(
    "classes,answers,equivalent,expected",
    [
        # The wrong answer B has the majority: maj@4 = 0, although a sample is right.
        ([CORRECT, INCORRECT, INCORRECT, INVALID], ["A", "B", "B"], None, 0.0),
        # The right answer has the majority.
        ([CORRECT, CORRECT, INCORRECT, INVALID], ["A", "A", "B"], None, 1.0),
        # A one-to-one tie counts one half; invalid samples do not vote.
        ([CORRECT, INCORRECT, INVALID, INVALID], ["A", "B"], None, 0.5),
        # "18" and "18.00" vote together only when numerically equivalent answers are grouped.
        ([CORRECT, CORRECT, INCORRECT, INCORRECT], ["18", "18.00", "7", "7"], None, 0.0),
        ([CORRECT, CORRECT, INCORRECT, INCORRECT], ["18", "18.00", "7", "7"], gsm8k_numbers_equal, 0.5),
        ([CORRECT, CORRECT, CORRECT, INCORRECT], ["18", "18.00", "18.0", "7"], gsm8k_numbers_equal, 1.0),
    ],
)
def test_majority_vote(model_and_tokenizer, arithmetic_dataset, classes, answers, equivalent, expected):
    model, tokenizer = model_and_tokenizer
    result = evaluate_model(
        model, tokenizer, arithmetic_dataset.select(range(3)), scripted(classes, answers, equivalent), **FAST
    )
    assert result.maj_at_k == pytest.approx(expected)
    assert result.pass_at_1 == pytest.approx(classes.count(CORRECT) / 4)
    assert result.invalid_rate == pytest.approx(classes.count(INVALID) / 4)
    assert result.pass_at_k[4] == 1.0


def test_input_errors(model_and_tokenizer, arithmetic_dataset):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="num_samples"):
        evaluate_model(model, tokenizer, arithmetic_dataset, arithmetic_classify, k=4, num_samples=2)
    with pytest.raises(ValueError, match="'answer' column"):
        evaluate_model(model, tokenizer, arithmetic_dataset.remove_columns("answer"), arithmetic_classify, **FAST)
    with pytest.raises(ValueError, match="classify must return"):
        evaluate_model(model, tokenizer, arithmetic_dataset.select(range(1)), lambda t, r: "maybe", **FAST)


def test_save_results_writes_json_and_png(arithmetic_result, tmp_path):
    paths = save_results(arithmetic_result, tmp_path / "eval")
    assert paths["json"] == tmp_path / "eval" / "results.json"
    document = json.loads(paths["json"].read_text())
    assert document["summary"]["pass@1"] == pytest.approx(arithmetic_result.pass_at_1)
    assert document["summary"]["maj@4"] == pytest.approx(arithmetic_result.maj_at_k)
    assert "pass@1_se" in document["summary"] and document["histogram"] == arithmetic_result.histogram
    assert len(document["records"]) == 16
    assert document["records"][3]["classes"] == arithmetic_result.records[3]["classes"]
    png = paths["plot"].read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


def test_ready_made_classifiers():
    assert arithmetic_classify("12 apples", "12") == CORRECT
    assert arithmetic_classify("13", "12") == INCORRECT
    assert arithmetic_classify("twelve", "12") == INVALID
    assert arithmetic_classify.extract("x -4 y") == "-4"
    assert gsm8k_classify("She pays $1,200 in total. The answer is 1,200.", "1200") == CORRECT
    assert gsm8k_classify("No idea.", "1200") == INVALID
    assert gsm8k_classify.extract("The answer is 18.00") == "18.00"
    assert gsm8k_classify.equivalent("18.00", "18")
    assert math_classify("so $x = \\boxed{\\dfrac{1}{2}}$", "\\frac12") == CORRECT
    assert math_classify("so x = 1/2", "\\frac12") == INVALID
    assert math_classify.extract("$\\boxed{3}$ then $\\boxed{4}$") == "4"
    from topr_trl.tasks.registry import TASKS

    classifiers = {name: task.classifier() for name, task in TASKS.items() if task.classifier is not None}
    assert set(classifiers) == {"arithmetic", "gsm8k", "math", "math500", "reasoning", "word_problems"}
    assert classifiers["gsm8k"] is gsm8k_classify and classifiers["math500"] is math_classify
    assert classifiers["word_problems"] is gsm8k_classify  # the final number, as GSM8K's is read


def test_command_line_on_the_tiny_model(tiny_model_path, tmp_path, capsys):
    summary = main(
        [
            "--model",
            tiny_model_path,
            "--k",
            "2",
            "--limit",
            "5",
            "--max_new_tokens",
            "4",
            "--output_dir",
            str(tmp_path / "cli"),
            "--no_progress",
        ]
    )
    assert summary["num_prompts"] == 5 and summary["k"] == 2 and 0 <= summary["pass@1"] <= summary["pass@2"] <= 1
    document = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert document["settings"]["task"] == "arithmetic" and len(document["records"]) == 5
    # The built-in held-out set: make_arithmetic_dataset(200, 2, seed=2), first 5 problems.
    from topr_trl.tasks.arithmetic import make_arithmetic_dataset

    assert [r["prompt"] for r in document["records"]] == make_arithmetic_dataset(200, 2, seed=2)["prompt"][:5]
    assert (tmp_path / "cli" / "results.png").is_file()
    assert '"pass@1"' in capsys.readouterr().out


def test_command_line_gsm8k_from_a_local_file(tiny_model_path, tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(3)]
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = main(
        [
            "--model",
            tiny_model_path,
            "--task",
            "gsm8k",
            "--dataset_source",
            str(source),
            "--few_shot",
            "1",
            "--plain_prompts",
            "--k",
            "2",
            "--max_new_tokens",
            "3",
            "--no_plot",
            "--output_dir",
            str(tmp_path / "cli"),
            "--no_progress",
        ]
    )
    assert summary["num_prompts"] == 3
    document = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert [r["reference"] for r in document["records"]] == ["0", "2", "4"]
    assert document["records"][0]["prompt"].count("Question:") == 2
    assert not (tmp_path / "cli" / "results.png").exists()
    with pytest.raises(SystemExit, match=r"^topr-trl: `task`='nope' is not supported; choose one of"):
        main(["--model", tiny_model_path, "--task", "nope"])


def test_vllm_backend_samples_from_the_trainers_prompt_ids(tiny_model_path, arithmetic_dataset, monkeypatch):
    """Through the vLLM stand-in (tests/fake_vllm.py): the engine receives the prompts as GRPOTrainer's token ids,
    draws k samples of each, and its texts are scored as the transformers path scores them."""
    from topr_trl.inputs.prompts import tokenize_prompts

    from . import fake_vllm

    fake_vllm.install(monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    data = arithmetic_dataset.select(range(3))
    result = evaluate_model(
        tiny_model_path,
        tokenizer,
        data,
        arithmetic_classify,
        k=2,
        max_new_tokens=4,
        backend="vllm",
        show_progress=False,
    )
    engine = fake_vllm.LLM.instances[-1]
    assert engine.requests == tokenize_prompts(tokenizer, data["prompt"])
    assert result.settings["backend"] == "vllm" and result.num_samples == 2
    for record in result.records:
        assert len(record["completions"]) == 2
        assert record["classes"] == [arithmetic_classify(text, record["reference"]) for text in record["completions"]]


def test_command_line_evaluates_the_reasoning_task_on_its_held_out_split(tiny_model_path, tmp_path):
    """`--task reasoning`: held-out written-addition problems (3 digits by default), each completion classed by the
    written-solution checker; the default length is the written solution's."""
    from topr_trl.tasks.reasoning import max_completion_tokens, parse_problem, split_of

    main(
        [
            "--model_name_or_path",
            tiny_model_path,
            "--task",
            "reasoning",
            "--task_eval_prompts",
            "3",
            "--k",
            "1",
            "--output_dir",
            str(tmp_path),
            "--no_plot",
            "--no_progress",
        ]
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["max_new_tokens"] == max_completion_tokens(3)
    problems = [parse_problem(record["prompt"]) for record in results["records"]]
    assert len(problems) == 3 and all(split_of(a, b) == "heldout" and a >= 100 for a, b in problems)


def test_a_registered_task_reaches_evaluate_and_the_training_commands(tiny_model_path, tmp_path, monkeypatch):
    """One `register_task` is the whole of a new task: `evaluate --task` loads its problems and scores them with its
    checker and budget, the training commands' `--task` choice accepts it and loads its prompts and rewards, and a
    name not registered is refused by both in one line listing the registered ones."""
    from types import SimpleNamespace

    from datasets import Dataset

    from topr_trl.tasks import registry
    from topr_trl.tasks.loading import load_task, resolve_task

    problems = Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3="], "answer": ["2", "4", "6"]})
    checked = []

    def classify(text, reference):
        checked.append(reference)
        return CORRECT

    classify.extract = lambda text: text
    monkeypatch.setitem(
        registry.TASKS,
        "doubles",
        registry.Task(
            "doubles",
            trains=True,
            evaluation_data=lambda options: problems,
            max_new_tokens=lambda digits: 3,
            training_data=lambda options, eval_split: registry.TrainingData(train=problems),
            reward_funcs=("arithmetic",),
            classifier=lambda: classify,
        ),
    )
    summary = main(
        [
            "--model",
            tiny_model_path,
            "--task",
            "doubles",
            "--k",
            "1",
            "--no_plot",
            "--no_progress",
            "--output_dir",
            str(tmp_path / "eval"),
        ]
    )
    document = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert summary["num_prompts"] == 3 and sorted(checked) == ["2", "4", "6"]
    assert document["settings"]["max_new_tokens"] == 3 and document["settings"]["task"] == "doubles"
    options = SimpleNamespace(task="doubles", dataset_name=None, reward_funcs=None, dry_run=False)
    assert resolve_task(options, tiny_model_path) == "doubles"
    _, task, train, held_out, _, rewards = load_task(options, tiny_model_path, seed=0)
    assert (task, train, held_out, len(rewards)) == ("doubles", problems, None, 1)
    for refuse in (
        lambda: main(["--model", tiny_model_path, "--task", "triples"]),
        lambda: resolve_task(SimpleNamespace(**{**vars(options), "task": "triples"}), tiny_model_path),
    ):
        with pytest.raises((SystemExit, ValueError), match=r"'triples' is not supported; choose one of .*doubles"):
            refuse()
