"""Evaluate a model the way the TOPR paper measures (Le Roux et al., 2025, arXiv:2503.14286): sample n
completions per question, class each one correct / incorrect / invalid, and report pass@1 (mean correctness),
unbiased pass@k, maj@k, the invalid rate, the paper's bootstrap standard errors, and the histogram of correct
answers per question.

`evaluate_model` is the measurement; `topr-trl evaluate` (`topr_trl.commands.evaluate`) runs it from the command line:

    topr-trl evaluate --model_name_or_path outputs/topr-tiny-arithmetic --task arithmetic --k 8 \\
        --output_dir outputs/eval

Generation uses transformers' `generate`, or vLLM when the model is given by path, vLLM is installed and a GPU
is present (`backend="auto"`); vLLM is only imported then (`topr_trl.generation.completions.make_vllm_engine`), never
when this module is imported.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..generation.completions import (
    generate_completions,
    make_vllm_engine,
    seeded_eval_sampling,
    vllm_available,
    vllm_sampling_params,
)
from ..inputs.prompts import tokenize_prompts
from ..runtime.noise import progress_bar_class
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
    completion_text,
    extract_boxed,
    extract_gsm8k_answer,
    gsm8k_numbers_equal,
    math_answers_equal,
)


tqdm = progress_bar_class()  # the notebook bar only where it can draw


logger = logging.getLogger(__name__)

__all__ = [
    "EvaluationResult",
    "evaluate_model",
    "gsm8k_classify",
    "math_classify",
    "save_results",
]


# ---------------------------------------------------------------------------------------------------------
# Classifiers: classify(text, reference) -> "correct" | "incorrect" | "invalid", with `extract` (the answer
# that votes in maj@k) and `equivalent` (when two extracted answers are the same vote) as attributes.
# ---------------------------------------------------------------------------------------------------------


def _classifier(
    function: Callable[[str, Any], str], extract: Callable[[str], Any], equivalent: Callable[[Any, Any], bool] | None
) -> Callable[[str, Any], str]:
    function.extract = extract
    function.equivalent = equivalent
    return function


def _gsm8k_classify(text: str, reference) -> str:
    return classify_gsm8k(text, reference)


def _math_classify(text: str, reference) -> str:
    return classify_math(text, reference)


gsm8k_classify = _classifier(_gsm8k_classify, extract_gsm8k_answer, gsm8k_numbers_equal)
"""GSM8K: `topr_trl.evaluation.rewards.classify_gsm8k`; votes are numbers, equal when numerically equal."""

math_classify = _classifier(
    _math_classify, lambda text: extract_boxed(completion_text(text)) or None, math_answers_equal
)
"""MATH: `topr_trl.evaluation.rewards.classify_math` (last `\\boxed{}`, math-verify); votes equal when equivalent."""


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


def json_safe(value):
    """Prompts, references and answers as JSON: containers kept, numbers kept, everything else as text."""
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if not (isinstance(value, float) and not math.isfinite(value)) else None
    return str(value)


# ---------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------


def _prompt_ids(tokenizer, prompts: Sequence) -> list[list[int]]:
    """The prompts as token ids, exactly as GRPOTrainer tokenizes them for training (`topr_trl.inputs.prompts`)."""
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
    return isinstance(model, (str, Path)) and vllm_available()


def _generate_transformers(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    n: int,
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    show_progress: bool,
    stop_strings,
    generate_kwargs: dict,
) -> list[list[dict]]:
    """n samples for each prompt, as {"text", "num_tokens", "truncated"} dicts (`topr_trl.generation.completions`), in a
    forked RNG (the caller's random state, e.g. a trainer's, is left untouched) seeded with `seed`."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos_ids = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else []
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    options = dict(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=sorted(eos_ids) or None,
        **generate_kwargs,
    )
    if stop_strings:
        options.update(stop_strings=list(stop_strings), tokenizer=tokenizer)
    jobs = [index for index in range(len(prompt_ids)) for _ in range(n)]
    samples: list[list[dict]] = [[] for _ in prompt_ids]
    with seeded_eval_sampling(model, seed):
        with tqdm(total=len(jobs), desc="evaluate", unit="sample", disable=not show_progress) as progress:
            for start in range(0, len(jobs), batch_size):
                batch = jobs[start : start + batch_size]
                completions = generate_completions(model, tokenizer, [prompt_ids[i] for i in batch], **options)
                for index, completion in zip(batch, completions, strict=True):
                    tokens, stopped = completion["completion_ids"], completion["stopped"]
                    kept = tokens[:-1] if stopped else tokens
                    samples[index].append(
                        {
                            "text": tokenizer.decode(kept, skip_special_tokens=True),
                            "num_tokens": len(tokens),
                            "truncated": not stopped and len(kept) >= max_new_tokens,
                        }
                    )
                progress.update(len(batch))
    return samples


def _generate_vllm(
    model_path: str,
    tokenizer,
    prompt_ids: list[list[int]],
    n: int,
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    seed: int,
    stop_strings,
) -> list[list[dict]]:
    """n samples for each text with vLLM (imported here, only when chosen)."""
    # The engine is built here, seeded with `seed`, so its samples are reproducible without a per-request seed,
    # which vLLM 0.31's CPU runner cannot honour ("CPU Generator does not use offset" once a request's sampled token
    # is discarded, as chunked prefill does).
    llm = make_vllm_engine(model_path, seed=seed, tokenizer=getattr(tokenizer, "name_or_path", None) or None)
    params = vllm_sampling_params(
        n, temperature, top_p, top_k, max_new_tokens, stop=list(stop_strings) if stop_strings else None
    )
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    return [
        [
            {"text": sample.text, "num_tokens": len(sample.token_ids), "truncated": sample.finish_reason == "length"}
            for sample in output.outputs
        ]
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


def _compute_metrics(
    classes: list[list[str]],
    votes: list[list[int | None]],
    group_correct: list[dict[int, bool]],
    k: int,
    num_bootstrap: int,
    seed: int,
) -> tuple[dict, dict, list[int]]:
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

    metrics[f"maj@{k}"] = float(
        np.mean([expected_maj_at_k(row, question, k, is_correct) for question, row in enumerate(votes)])
    )
    errors[f"maj@{k}"] = (
        bootstrap_maj_at_k(votes, list(range(len(votes))), k, is_correct, None, num_bootstrap, seed).standard_error
        if k < n
        else None
    )
    metrics["invalid_rate"] = float(invalid.mean())
    metrics["incorrect_rate"] = float((~correct & ~invalid).mean())
    rate_se = {}
    for name, flags in (("invalid_rate", invalid), ("incorrect_rate", ~correct & ~invalid)):
        rate_se[name] = (
            bootstrap_standard_error(
                flags.tolist(), 1, lambda draws: float(np.mean(draws)), num_bootstrap, seed
            ).standard_error
            if n > 1
            else None
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
    correct. The ready-made `gsm8k_classify` and `math_classify`, and the built-in tasks' `arithmetic_classify` and
    `reasoning_classify` (`topr_trl.tasks`), carry both.

    Returns an `EvaluationResult` (metrics, bootstrap standard errors with `num_bootstrap` rounds, histogram,
    one record per question with its completions, classes and answers)."""
    n = int(num_samples if num_samples is not None else k)
    _check_evaluation_inputs(dataset, k, n, batch_size, max_new_tokens, (prompt_column, answer_column))
    extract = extract if extract is not None else getattr(classify, "extract", None)
    equivalent = equivalent if equivalent is not None else getattr(classify, "equivalent", None)
    prompts, references = list(dataset[prompt_column]), list(dataset[answer_column])

    vllm = _use_vllm(model, backend)
    model_name = str(model) if isinstance(model, (str, Path)) else getattr(model, "name_or_path", type(model).__name__)
    if tokenizer is None:
        if not isinstance(model, (str, Path)):
            raise ValueError("a tokenizer is needed with a loaded model")
        tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompt_ids = _prompt_ids(tokenizer, prompts)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, seed=seed)
    samples = _sampled(
        model, tokenizer, prompt_ids, n, vllm, batch_size, show_progress, stop_strings, generate_kwargs, sampling
    )
    classes, votes, group_correct, records = _classified(prompts, references, samples, classify, extract, equivalent)
    metrics, errors, histogram = _compute_metrics(classes, votes, group_correct, k, num_bootstrap, seed)
    settings = dict(
        model=model_name,
        backend="vllm" if vllm else "transformers",
        k=k,
        num_samples=n,
        **sampling,
        batch_size=batch_size,
        num_bootstrap=num_bootstrap,
        stop_strings=list(stop_strings) if stop_strings else None,
        classify=getattr(classify, "__name__", type(classify).__name__),
    )
    return EvaluationResult(k, n, len(records), metrics, errors, histogram, records, settings)


def _check_evaluation_inputs(dataset, k: int, n: int, batch_size: int, max_new_tokens: int, columns) -> None:
    """One clear error for each input `evaluate_model` cannot measure."""
    if k < 1 or n < k:
        raise ValueError(f"need 1 <= k <= num_samples, got k={k}, num_samples={n}")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be positive")
    for column in columns:
        if column not in dataset.column_names:
            raise ValueError(f"the dataset has no {column!r} column (columns: {dataset.column_names})")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty")


def _sampled(model, tokenizer, prompt_ids, n, vllm, batch_size, show_progress, stop_strings, generate_kwargs, sampling):
    """n samples for each prompt, from vLLM or transformers (`_generate_vllm`, `_generate_transformers`)."""
    if vllm:
        return _generate_vllm(str(model), tokenizer, prompt_ids, n, stop_strings=stop_strings, **sampling)
    return _generate_transformers(
        _loaded(model),
        tokenizer,
        prompt_ids,
        n,
        batch_size=batch_size,
        show_progress=show_progress,
        stop_strings=stop_strings,
        generate_kwargs=dict(generate_kwargs or {}),
        **sampling,
    )


def _loaded(model):
    """`model` itself when loaded, else the model at that path or Hub id, in its stored dtype (on the GPU if any)."""
    if not isinstance(model, (str, Path)):
        return model
    model = AutoModelForCausalLM.from_pretrained(str(model), dtype="auto")
    return model.to("cuda") if torch.cuda.is_available() else model


def _classified(prompts, references, samples, classify, extract, equivalent):
    """Each question's classes, vote ids (`_vote_ids`) and correct vote groups, and its record (prompt, reference,
    completions, classes, answers, lengths): what the metrics and results.json are computed from."""
    classes, votes, group_correct, records = [], [], [], []
    for index, (prompt, reference, question_samples) in enumerate(zip(prompts, references, samples, strict=True)):
        texts = [sample["text"] for sample in question_samples]
        question_classes = [_as_class(classify(text, reference)) for text in texts]
        answers = [
            None if c == INVALID else (extract(text) if extract is not None else text.strip())
            for text, c in zip(texts, question_classes, strict=True)
        ]
        ids, correct_groups = _vote_ids(answers, question_classes, equivalent)
        classes.append(question_classes)
        votes.append(ids)
        group_correct.append(correct_groups)
        records.append(
            {
                "index": index,
                "prompt": json_safe(prompt),
                "reference": json_safe(reference),
                "num_correct": question_classes.count(CORRECT),
                "num_invalid": question_classes.count(INVALID),
                "completions": texts,
                "classes": question_classes,
                "answers": json_safe(answers),
                "num_tokens": [sample["num_tokens"] for sample in question_samples],
                "truncated": [sample["truncated"] for sample in question_samples],
            }
        )
    return classes, votes, group_correct, records


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
    paths["json"].write_text(json.dumps(json_safe(document), indent=2, ensure_ascii=False))
    if plot:
        import matplotlib  # noqa: PLC0415 - matplotlib: 0.5 s to import, only to draw

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib: 0.5 s to import, only to draw

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
