"""Evaluate a model the way the TOPR paper measures (Le Roux et al., 2025, arXiv:2503.14286): sample n
completions per question, class each one correct / incorrect / invalid, and report pass@1 (mean correctness),
unbiased pass@k, maj@k, the invalid rate, the paper's bootstrap standard errors, and the histogram of correct
answers per question.

    topr-trl evaluate --model_name_or_path outputs/topr-tiny-arithmetic --task arithmetic --k 8 --output_dir outputs/eval

Generation uses transformers' `generate`, or vLLM when the model is given by path, vLLM is installed and a GPU
is present (`backend="auto"`); vLLM is only imported then, never when this module is imported.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .metrics import (
    bootstrap_maj_at_k,
    bootstrap_pass_at_k,
    bootstrap_standard_error,
    correct_count_histogram,
    expected_maj_at_k,
    mean_pass_at_k,
)
from .rewards import (
    ANSWER_CLASSES,
    CORRECT,
    INCORRECT,
    INVALID,
    classify_gsm8k,
    classify_math,
    extract_boxed,
    extract_gsm8k_answer,
    gsm8k_numbers_equal,
    math_answers_equal,
)
from ..offline.generation import BACKENDS
from ..prompts import tokenize_prompts
from ..sampling import generate_completions
from .arithmetic import completion_text, parse_answer
from .reasoning import reasoning_classify

logger = logging.getLogger(__name__)

__all__ = [
    "CLASSIFIERS",
    "EvaluationResult",
    "arithmetic_classify",
    "evaluate_model",
    "gsm8k_classify",
    "main",
    "math_classify",
    "save_results",
]


# ---------------------------------------------------------------------------------------------------------
# Classifiers: classify(text, reference) -> "correct" | "incorrect" | "invalid", with `extract` (the answer
# that votes in maj@k) and `equivalent` (when two extracted answers are the same vote) as attributes.
# ---------------------------------------------------------------------------------------------------------


def _classifier(function: Callable[[str, Any], str], extract: Callable[[str], Any],
                equivalent: Callable[[Any, Any], bool] | None) -> Callable[[str, Any], str]:
    function.extract = extract
    function.equivalent = equivalent
    return function


def _arithmetic_classify(text: str, reference) -> str:
    answer = parse_answer(completion_text(text))
    if answer is None:
        return INVALID
    return CORRECT if answer == str(reference).strip() else INCORRECT


def _gsm8k_classify(text: str, reference) -> str:
    return classify_gsm8k(text, reference)


def _math_classify(text: str, reference) -> str:
    return classify_math(text, reference)


arithmetic_classify = _classifier(_arithmetic_classify, lambda text: parse_answer(completion_text(text)), None)
"""The built-in arithmetic task: the completion's first integer against the reference (as its reward does)."""

gsm8k_classify = _classifier(_gsm8k_classify, extract_gsm8k_answer, gsm8k_numbers_equal)
"""GSM8K: `topr_trl.evaluation.rewards.classify_gsm8k`; votes are numbers, equal when numerically equal."""

math_classify = _classifier(_math_classify, lambda text: extract_boxed(completion_text(text)) or None,
                            math_answers_equal)
"""MATH: `topr_trl.evaluation.rewards.classify_math` (last `\\boxed{}`, math-verify); votes equal when equivalent."""

CLASSIFIERS = {"arithmetic": arithmetic_classify, "gsm8k": gsm8k_classify, "math": math_classify,
               "math500": math_classify, "reasoning": reasoning_classify}


# ---------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------


@dataclass
class EvaluationResult:
    """What `evaluate_model` measured.

    `metrics`: `pass@1` (the mean correctness of all samples), the unbiased `pass@j` for j = 1, 2, 4, ... and
    k, `maj@k` (the expected correctness of the majority vote of k samples; ties split evenly), and the
    `invalid_rate` / `incorrect_rate` shares of all samples. `standard_errors`: the paper's
    bootstrap SE of each metric (None where it needs more samples than K: sample `num_samples` > k to get
    them at k). `histogram[c]`: questions with exactly c correct answers of n. `records`: one per question."""

    k: int
    num_samples: int
    num_prompts: int
    metrics: dict[str, float]
    standard_errors: dict[str, float | None]
    histogram: list[int]
    records: list[dict] = field(repr=False)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def pass_at_1(self) -> float:
        return self.metrics["pass@1"]

    @property
    def pass_at_k(self) -> dict[int, float]:
        return {int(key[5:]): value for key, value in self.metrics.items() if key.startswith("pass@")}

    @property
    def maj_at_k(self) -> float:
        return self.metrics[f"maj@{self.k}"]

    @property
    def invalid_rate(self) -> float:
        return self.metrics["invalid_rate"]

    def summary(self) -> dict[str, Any]:
        """The metrics, their standard errors (`<metric>_se`) and the sample counts, without the records."""
        summary: dict[str, Any] = {"num_prompts": self.num_prompts, "num_samples": self.num_samples, "k": self.k}
        summary.update(self.metrics)
        summary.update({f"{name}_se": value for name, value in self.standard_errors.items()})
        return summary

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _json_safe(value):
    """Prompts, references and answers as JSON: containers kept, numbers kept, everything else as text."""
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if not (isinstance(value, float) and not math.isfinite(value)) else None
    return str(value)


# ---------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------


def _prompt_ids(tokenizer, prompts: Sequence) -> list[list[int]]:
    """The prompts as token ids, exactly as GRPOTrainer tokenizes them for training (`topr_trl.prompts`)."""
    conversational = [isinstance(prompt, list) for prompt in prompts]
    if any(conversational) and not all(conversational):
        raise ValueError("the prompts mix conversational (lists of messages) and plain (strings) ones")
    return tokenize_prompts(tokenizer, [prompt if isinstance(prompt, list) else str(prompt) for prompt in prompts])


def _use_vllm(model, backend: str) -> bool:
    if backend == "transformers":
        return False
    if backend == "vllm":
        if not isinstance(model, (str, Path)):
            raise ValueError("backend='vllm' needs the model as a path or Hub id, not a loaded model")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'transformers' or 'vllm', got {backend!r}")
    from ..offline.rollout import vllm_available

    return isinstance(model, (str, Path)) and vllm_available()


def _generate_transformers(model, tokenizer, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                           top_k: int, max_new_tokens: int, batch_size: int, seed: int, show_progress: bool,
                           stop_strings, generate_kwargs: dict) -> list[list[dict]]:
    """n samples for each prompt, as {"text", "num_tokens", "truncated"} dicts (`topr_trl.sampling`), in a forked RNG
    (the caller's random state, e.g. a trainer's, is left untouched) seeded with `seed`."""
    from tqdm.auto import tqdm

    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos_ids = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else []
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    options = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature, top_p=top_p,
                   top_k=top_k, stop_token_ids=sorted(eos_ids) or None, **generate_kwargs)
    if stop_strings:
        options.update(stop_strings=list(stop_strings), tokenizer=tokenizer)
    jobs = [index for index in range(len(prompt_ids)) for _ in range(n)]
    samples: list[list[dict]] = [[] for _ in prompt_ids]
    was_training = model.training
    model.eval()
    devices = [model.device.index or 0] if model.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            with tqdm(total=len(jobs), desc="evaluate", unit="sample", disable=not show_progress) as progress:
                for start in range(0, len(jobs), batch_size):
                    batch = jobs[start : start + batch_size]
                    completions = generate_completions(model, tokenizer, [prompt_ids[i] for i in batch], **options)
                    for index, completion in zip(batch, completions, strict=True):
                        tokens, stopped = completion["completion_ids"], completion["stopped"]
                        kept = tokens[:-1] if stopped else tokens
                        samples[index].append({
                            "text": tokenizer.decode(kept, skip_special_tokens=True),
                            "num_tokens": len(tokens),
                            "truncated": not stopped and len(kept) >= max_new_tokens,
                        })
                    progress.update(len(batch))
    finally:
        model.train(was_training)
    return samples


def _generate_vllm(model_path: str, tokenizer, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                   top_k: int, max_new_tokens: int, seed: int, stop_strings) -> list[list[dict]]:
    """n samples for each text with vLLM (imported here, only when chosen)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_path), tokenizer=getattr(tokenizer, "name_or_path", None) or str(model_path), seed=seed)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                            max_tokens=max_new_tokens, seed=seed, stop=list(stop_strings) if stop_strings else None)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    return [
        [{"text": sample.text, "num_tokens": len(sample.token_ids), "truncated": sample.finish_reason == "length"}
         for sample in output.outputs]
        for output in outputs
    ]


# ---------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------


def _vote_ids(answers: list, classes: list[str], equivalent) -> tuple[list[int | None], dict[int, bool]]:
    """Each valid answer replaced by the id of its group of equal (or `equivalent`) answers, invalid ones by
    None, and whether each group is correct (the class of its first member). Grouping once here keeps the
    bootstrap's thousands of majority votes cheap even when `equivalent` is slow (math-verify)."""
    heads: list[int] = []
    ids: list[int | None] = []
    for index, (answer, answer_class) in enumerate(zip(answers, classes, strict=True)):
        if answer is None or answer_class == INVALID:
            ids.append(None)
            continue
        for group, head in enumerate(heads):
            same = answers[head] == answer if equivalent is None else equivalent(answers[head], answer)
            if same:
                ids.append(group)
                break
        else:
            ids.append(len(heads))
            heads.append(index)
    return ids, {group: classes[head] == CORRECT for group, head in enumerate(heads)}


def _reported_ks(k: int) -> list[int]:
    ks, power = {1, k}, 2
    while power < k:
        ks.add(power)
        power *= 2
    return sorted(ks)


def _compute_metrics(classes: list[list[str]], votes: list[list[int | None]], group_correct: list[dict[int, bool]],
                     k: int, num_bootstrap: int, seed: int) -> tuple[dict, dict, list[int]]:
    n = len(classes[0])
    correct = np.array([[answer_class == CORRECT for answer_class in row] for row in classes], dtype=bool)
    invalid = np.array([[answer_class == INVALID for answer_class in row] for row in classes], dtype=bool)
    counts = correct.sum(axis=1)
    metrics: dict[str, float] = {"pass@1": float(correct.mean())}
    errors: dict[str, float | None] = {}
    for j in _reported_ks(k):
        metrics[f"pass@{j}"] = mean_pass_at_k(n, counts, j)
        errors[f"pass@{j}"] = bootstrap_pass_at_k(correct, j, num_bootstrap, seed).standard_error if j < n else None

    def is_correct(group, question):
        return group_correct[question][group]

    metrics[f"maj@{k}"] = float(np.mean([
        expected_maj_at_k(row, question, k, is_correct) for question, row in enumerate(votes)
    ]))
    errors[f"maj@{k}"] = (
        bootstrap_maj_at_k(votes, list(range(len(votes))), k, is_correct, None, num_bootstrap, seed).standard_error
        if k < n else None
    )
    metrics["invalid_rate"] = float(invalid.mean())
    metrics["incorrect_rate"] = float((~correct & ~invalid).mean())
    rate_se = {}
    for name, flags in (("invalid_rate", invalid), ("incorrect_rate", ~correct & ~invalid)):
        rate_se[name] = (
            bootstrap_standard_error(flags.tolist(), 1, lambda draws: float(np.mean(draws)), num_bootstrap,
                                     seed).standard_error
            if n > 1 else None
        )
    errors.update(rate_se)
    return metrics, errors, correct_count_histogram(correct).tolist()


def _as_class(value) -> str:
    if isinstance(value, (bool, np.bool_)):
        return CORRECT if value else INCORRECT
    if value not in ANSWER_CLASSES:
        raise ValueError(f"classify must return one of {ANSWER_CLASSES} (or a bool), got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------


def evaluate_model(
    model,
    tokenizer,
    dataset,
    classify: Callable[[str, Any], str],
    k: int = 8,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 512,
    batch_size: int = 64,
    seed: int = 0,
    show_progress: bool = True,
    extract: Callable[[str], Any] | None = None,
    *,
    num_samples: int | None = None,
    equivalent: Callable[[Any, Any], bool] | None = None,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    num_bootstrap: int = 100,
    backend: str = "auto",
    stop_strings: Sequence[str] | None = None,
    generate_kwargs: dict | None = None,
) -> EvaluationResult:
    """Sample `num_samples` (default `k`) completions for every prompt of `dataset` and measure them.

    `model`: a loaded causal LM, or a path / Hub id (loaded here; with `backend="auto"` vLLM generates when it
    is installed and a GPU is present). `tokenizer`: its tokenizer (None: loaded from the path). `dataset`: rows
    with `prompt` (conversational, templated with the tokenizer's chat template, or plain text) and `answer`.
    Sampling: `temperature` (0: greedy), `top_p`, `top_k` (0: none; the paper uses 500), `max_new_tokens`;
    `batch_size` completions per `generate` call; `stop_strings` end a completion early (for few-shot base
    models). Sampling is reproducible under `seed` for a given `batch_size` and device, and leaves the caller's
    random state untouched.

    `classify(text, reference)` classes each completion `"correct"`, `"incorrect"` or `"invalid"` (a bool is
    read as correct / incorrect). maj@k votes with `extract(text)` (default: `classify.extract`, else the
    stripped completion text) grouped by `equivalent(a, b)` (default: `classify.equivalent`, else equality);
    invalid completions do not vote, and a vote is correct when its group's first completion was classed
    correct. The ready-made `arithmetic_classify`, `gsm8k_classify` and `math_classify` carry both.

    Returns an `EvaluationResult` (metrics, bootstrap standard errors with `num_bootstrap` rounds, histogram,
    one record per question with its completions, classes and answers)."""
    n = int(num_samples if num_samples is not None else k)
    if k < 1 or n < k:
        raise ValueError(f"need 1 <= k <= num_samples, got k={k}, num_samples={n}")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be positive")
    for column in (prompt_column, answer_column):
        if column not in dataset.column_names:
            raise ValueError(f"the dataset has no {column!r} column (columns: {dataset.column_names})")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty")
    extract = extract if extract is not None else getattr(classify, "extract", None)
    equivalent = equivalent if equivalent is not None else getattr(classify, "equivalent", None)
    prompts, references = list(dataset[prompt_column]), list(dataset[answer_column])

    vllm = _use_vllm(model, backend)
    model_name = str(model) if isinstance(model, (str, Path)) else getattr(model, "name_or_path", type(model).__name__)
    if tokenizer is None:
        if not isinstance(model, (str, Path)):
            raise ValueError("a tokenizer is needed with a loaded model")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompt_ids = _prompt_ids(tokenizer, prompts)
    if vllm:
        samples = _generate_vllm(str(model), tokenizer, prompt_ids, n, temperature, top_p, top_k, max_new_tokens, seed,
                                 stop_strings)
    else:
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype="auto")
            if torch.cuda.is_available():
                model = model.to("cuda")
        samples = _generate_transformers(model, tokenizer, prompt_ids, n, temperature, top_p, top_k, max_new_tokens,
                                         batch_size, seed, show_progress, stop_strings, dict(generate_kwargs or {}))

    classes, votes, group_correct, records = [], [], [], []
    for index, (prompt, reference, question_samples) in enumerate(zip(prompts, references, samples, strict=True)):
        question_texts = [sample["text"] for sample in question_samples]
        question_classes = [_as_class(classify(text, reference)) for text in question_texts]
        if extract is not None:
            answers = [extract(text) if c != INVALID else None for text, c in zip(question_texts, question_classes)]
        else:
            answers = [text.strip() if c != INVALID else None for text, c in zip(question_texts, question_classes)]
        ids, correct_groups = _vote_ids(answers, question_classes, equivalent)
        classes.append(question_classes)
        votes.append(ids)
        group_correct.append(correct_groups)
        records.append({
            "index": index,
            "prompt": _json_safe(prompt),
            "reference": _json_safe(reference),
            "num_correct": question_classes.count(CORRECT),
            "num_invalid": question_classes.count(INVALID),
            "completions": question_texts,
            "classes": question_classes,
            "answers": _json_safe(answers),
            "num_tokens": [sample["num_tokens"] for sample in question_samples],
            "truncated": [sample["truncated"] for sample in question_samples],
        })
    metrics, errors, histogram = _compute_metrics(classes, votes, group_correct, k, num_bootstrap, seed)
    settings = dict(
        model=model_name, backend="vllm" if vllm else "transformers", k=k, num_samples=n, temperature=temperature,
        top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
        num_bootstrap=num_bootstrap, stop_strings=list(stop_strings) if stop_strings else None,
        classify=getattr(classify, "__name__", type(classify).__name__),
    )
    return EvaluationResult(k=k, num_samples=n, num_prompts=len(records), metrics=metrics, standard_errors=errors,
                            histogram=histogram, records=records, settings=settings)


# ---------------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------------


def _format_metric(result: EvaluationResult, name: str) -> str:
    error = result.standard_errors.get(name)
    return f"{name} = {result.metrics[name]:.3f}" + (f" ± {error:.3f}" if error is not None else "")


def save_results(results: EvaluationResult | dict, output_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    """Write `results.json` (summary, metrics, standard errors, histogram, settings and per-question records)
    and, with `plot`, `results.png` (the histogram of correct answers per question, pass@1 / maj@k / invalid
    rate in the title) under `output_dir`. Returns the paths written."""
    if isinstance(results, dict):
        results = EvaluationResult(**results)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": output_dir / "results.json"}
    document = {"summary": results.summary(), **results.to_dict()}
    paths["json"].write_text(json.dumps(_json_safe(document), indent=2, ensure_ascii=False))
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4.2))
        counts = np.arange(len(results.histogram))
        axis.bar(counts, results.histogram, color="#4c72b0")
        axis.set_xticks(counts)
        axis.set_xlabel(f"correct answers out of {results.num_samples} samples")
        axis.set_ylabel("questions")
        axis.set_title(
            f"{results.settings.get('model', '')}\n"
            + ", ".join(_format_metric(results, name) for name in ("pass@1", f"maj@{results.k}", "invalid_rate")),
            fontsize=9,
        )
        figure.tight_layout()
        paths["plot"] = output_dir / "results.png"
        figure.savefig(paths["plot"], dpi=120)
        plt.close(figure)
    return paths


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

TASKS = ("arithmetic", "gsm8k", "math500", "math", "reasoning", "custom")
_TASK_MAX_NEW_TOKENS = {"arithmetic": 8, "gsm8k": 512, "math500": 1024, "math": 1024, "custom": 256}
ROW_COLUMN = "__row__"  # a custom dataset's "reference": the row the reward functions read their columns from


def _default_max_new_tokens(options) -> int:
    if options.task == "reasoning":  # a written solution of its digits, plus room to go wrong
        from .reasoning import max_completion_tokens

        return max_completion_tokens(options.arithmetic_digits or 3)
    return _TASK_MAX_NEW_TOKENS[options.task]


def _task_dataset(options):
    from . import benchmarks as loaders

    source = {"source": options.dataset_source} if options.dataset_source else {}
    common = dict(chat=not options.plain_prompts, few_shot=options.few_shot, system_prompt=options.system_prompt)
    if options.task == "arithmetic":
        from .arithmetic import make_arithmetic_dataset

        return make_arithmetic_dataset(options.arithmetic_prompts, options.arithmetic_digits or 2, seed=2)
    if options.task == "reasoning":  # held-out problems: disjoint from its train and warm-start splits
        from .reasoning import make_reasoning_dataset

        return make_reasoning_dataset(options.arithmetic_prompts, options.arithmetic_digits or 3, split="heldout")
    if options.task == "custom":  # the user's prompts, scored by the user's reward functions
        dataset = loaders.load_source(options.dataset_source, options.split or "test", config=options.dataset_config)
        if "prompt" not in dataset.column_names:
            raise ValueError(f"dataset {options.dataset_source!r} has no `prompt` column (it has "
                             f"{dataset.column_names}); rename the column that holds the prompts to `prompt`")
        return dataset.add_column(ROW_COLUMN, list(range(len(dataset))))
    if options.task == "gsm8k":
        return loaders.load_gsm8k(split=options.split or "test", **source, **common)
    if options.task == "math500":
        return loaders.load_math500(split=options.split or "test", **source, **common)
    return loaders.load_math(split=options.split or "test", config=options.dataset_config, **source, **common)


def _resolve_task(options) -> str:
    """The task: as given, or `custom` for a dataset with reward functions; one line refuses what cannot be meant."""
    task = options.task or ("custom" if options.dataset_source or options.reward_funcs else "arithmetic")
    if task == "custom" and not (options.dataset_source and options.reward_funcs):
        raise SystemExit("topr-trl: evaluating your own prompts needs --dataset_name (a file or Hub id with a `prompt` "
                         "column) and --reward_funcs (module:function, scoring each completion: > 0 counts as "
                         "correct); or give --task gsm8k|math|math500 to use that benchmark's answer checker")
    if task in ("arithmetic", "reasoning") and options.dataset_source:
        raise SystemExit(f"topr-trl: --task {task} makes its own held-out problems: drop --dataset_name, or evaluate "
                         "your prompts with --reward_funcs (and no --task)")
    if task != "custom" and options.reward_funcs:
        raise SystemExit(f"topr-trl: --task {task} scores with its own answer checker: drop --reward_funcs, or "
                         "evaluate your prompts with --dataset_name and no --task")
    return task


class _OneLineParser(argparse.ArgumentParser):
    """A wrong flag or value fails in one line (the usage is in --help), as in the other commands."""

    def error(self, message: str):
        raise SystemExit(f"topr-trl: {message}")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=prog or "python -m topr_trl.evaluation.runner",
        description="Sample k completions per question and report pass@1, pass@k, maj@k, the invalid rate and "
                    "bootstrap standard errors (results.json and results.png in --output_dir).",
    )
    # The same flag names as `topr-trl train`/`generate`/`iterate`; the earlier names still work.
    parser.add_argument("--model_name_or_path", "--model", dest="model", required=True,
                        help="Model path or Hub id.")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer path or Hub id (default: the model's).")
    parser.add_argument("--task", choices=TASKS, default=None,
                        help="arithmetic (the default without --dataset_name): the built-in held-out set "
                             "(make_arithmetic_dataset(200, 2, seed=2)); reasoning: held-out written-addition "
                             "problems (topr_trl.evaluation.reasoning); gsm8k/math/math500: the benchmark with its "
                             "answer checker; custom (the default with --dataset_name): your prompts, scored by "
                             "--reward_funcs.")
    parser.add_argument("--dataset_name", "--dataset_source", dest="dataset_source", default=None,
                        help="Your prompts (a `prompt` column; other columns go to --reward_funcs), or where to load "
                             "gsm8k/math/math500 from: a Hub id, a local .json/.jsonl/.csv/.parquet file or a folder.")
    parser.add_argument("--reward_funcs", nargs="+", default=None,
                        help="With --dataset_name: reward functions as `topr-trl train` takes them "
                             "(module:function, path/to/file.py:function); a completion whose summed reward is > 0 "
                             "counts as correct, one no function could score (None) as invalid.")
    parser.add_argument("--dataset_config", default=None, help="math: dataset configuration (e.g. a subject).")
    parser.add_argument("--dataset_test_split", "--split", dest="split", default=None,
                        help="Split to evaluate (default: test).")
    parser.add_argument("--few_shot", type=int, default=0, help="Worked examples before each question.")
    parser.add_argument("--system_prompt", default=None, help="System message (or text) before the prompt.")
    parser.add_argument("--plain_prompts", action="store_true", help="Plain-text prompts instead of chat.")
    parser.add_argument("--task_eval_prompts", "--arithmetic_prompts", dest="arithmetic_prompts", type=int,
                        default=200, help="arithmetic: held-out problems (the ones `train` measures).")
    parser.add_argument("--task_digits", "--arithmetic_digits", dest="arithmetic_digits", type=int, default=None,
                        help="Built-in tasks: operand digits (default 2 for arithmetic, 3 for reasoning).")
    parser.add_argument("--limit", type=int, default=None, help="Evaluate only the first N questions.")
    parser.add_argument("--k", type=int, default=8, help="k of pass@k and maj@k.")
    parser.add_argument("--num_samples", type=int, default=None,
                        help="Samples per question, n >= k (default k); n > k gives standard errors at k.")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (0: greedy).")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=0, help="Top-k truncation (0: none).")
    parser.add_argument("--max_completion_length", "--max_new_tokens", dest="max_new_tokens", type=int, default=None,
                        help=f"Completion length cap (default per task: {_TASK_MAX_NEW_TOKENS}).")
    parser.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    parser.add_argument("--batch_size", type=int, default=64, help="Completions per generate call.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_bootstrap", type=int, default=100, help="Bootstrap rounds of the standard errors.")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: vLLM when installed and a GPU is present, else transformers.")
    parser.add_argument("--output_dir", default=None, help="Where to write results (default outputs/eval-<task>).")
    parser.add_argument("--no_plot", action="store_true", help="Skip results.png.")
    parser.add_argument("--no_progress", action="store_true", help="No progress bar.")
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    """`topr-trl evaluate --model_name_or_path PATH [--task arithmetic|gsm8k|math500|math] [--k 8] ...`: evaluate,
    print the summary as JSON, write `results.json` and `results.png` to `--output_dir`; returns the summary."""
    options = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    if options.limit is not None and options.limit < 1:
        raise SystemExit("topr-trl: --limit must be positive")
    options.task = _resolve_task(options)
    from ..sources import check_data_source, check_model_source

    check_model_source(options.model)
    check_data_source(options.dataset_source, "--dataset_name")
    dataset = _task_dataset(options)
    if options.limit is not None:
        dataset = dataset.select(range(min(options.limit, len(dataset))))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(options.tokenizer or options.model)
    classify, answer_column = CLASSIFIERS.get(options.task), "answer"
    if options.task == "custom":
        from ..user_rewards import reporting_reward, resolve_reward, reward_classifier

        functions = [reporting_reward(resolve_reward(name)) for name in options.reward_funcs]
        classify, answer_column = reward_classifier(functions, dataset), ROW_COLUMN
    result = evaluate_model(
        options.model, tokenizer, dataset, classify, k=options.k, answer_column=answer_column,
        num_samples=options.num_samples, temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
        max_new_tokens=options.max_new_tokens or _default_max_new_tokens(options), batch_size=options.batch_size,
        seed=options.seed, show_progress=not options.no_progress, num_bootstrap=options.num_bootstrap,
        backend=options.backend, stop_strings=options.stop,
    )
    from ..machine import describe_machine, machine_info

    result.settings.update(task=options.task, machine=machine_info())
    if options.task == "custom":
        result.settings.update(dataset=options.dataset_source, reward_funcs=options.reward_funcs)
    output_dir = Path(options.output_dir or f"outputs/eval-{options.task}")
    paths = save_results(result, output_dir, plot=not options.no_plot)
    summary = _json_safe(result.summary())
    print(json.dumps(summary, indent=2), flush=True)
    how = "greedy" if options.temperature == 0 else f"sampled at temperature {options.temperature:g}"
    correct = "reward > 0" if options.task == "custom" else "correct answer"
    print(f"[topr-trl] pass@1 {result.pass_at_1:.3f} ({how}, {result.num_samples} samples per problem, "
          f"{correct}) on {result.num_prompts} problems; maj@{result.k} {result.maj_at_k:.3f}; on "
          f"{describe_machine(result.settings['machine'])}", flush=True)
    print(f"[topr-trl] evaluation written to {paths['json']}" + (f" and {paths['plot']}" if "plot" in paths else ""),
          flush=True)
    return summary


if __name__ == "__main__":
    main()
