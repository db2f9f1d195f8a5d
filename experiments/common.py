"""What the evidence scripts (figure1, baseline_sweep, figure7, iterations, sample_efficiency, staleness) share:
the testbed (warm-started base model, training prompts, reward, held-out measurement), a fixed dataset sampled once
from mu per seed, one offline TOPRTrainer run with a held-out curve, online runs with a held-out curve at
checkpoints (sample_efficiency, staleness), and means with 95 % confidence intervals over seeds.

Two testbeds (`--task`):
- reasoning (default): `topr_trl.tasks.reasoning`, 3-digit addition written out with carries (~32-token
  completions), a warm start that drops each carry with probability 0.25, about two thirds of samples correct (the
  paper's regime). Measured by sampled pass@1 at temperature 1 (4 samples x 1,000 held-out problems, a split
  disjoint from every training and warm-start problem), with greedy accuracy and pass@1 on problems with >= 2
  carries beside it.
- arithmetic: the built-in 2-digit task with 3-token answers and a base near 0.2 (about 10 % positives), greedy
  accuracy: the low-p stress test.

Every run uses the paper's signal R - c with +1/-1 rewards (`topr_signal="reward"`), a constant learning rate
and gradient clipping; methods differ only in their TOPRConfig overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# two-sided 95 % Student t quantiles by sample size n (n - 1 degrees of freedom)
_T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}


def mean_and_ci95(values: list[float]) -> dict:
    """Mean and the half-width of its 95 % t-interval (NaN for a single value)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return {"mean": mean, "ci95": float("nan"), "values": values}
    half = _T95.get(len(values), 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return {"mean": mean, "ci95": half, "values": values}


def late_mean(curve: list[dict], key: str = "pass@1", share: float = 0.25) -> float:
    """The robust end point of one run's curve: the mean of `key` over the checkpoints in the last `share` of its
    steps (step > (1 - share) x the last step; at least the last checkpoint). A single final checkpoint of a noisy
    curve can land on a dip or a spike; the mean over the run's late checkpoints cannot hinge on one of them."""
    # the start (step 0, and an offline run's generation) lies outside the last share of any run with a step
    steps = [point.get("step", index) for index, point in enumerate(curve)]
    last = steps[-1]
    late = [point[key] for point, step in zip(curve, steps, strict=True) if step > (1 - share) * last]
    return statistics.mean(late or [curve[-1][key]])


def paired_difference(first: dict[int, float], second: dict[int, float]) -> dict:
    """Mean and 95 % t-interval of first - second over the seeds both have (`first` and `second` map a seed to a
    value): the interval of a paired comparison, which removes what the two runs of one seed share (its prompts,
    its data, its evaluation draws)."""
    seeds = sorted(set(first) & set(second))
    if not seeds:
        raise ValueError("no seed in common: a paired difference needs runs of the same seeds")
    return {**mean_and_ci95([first[seed] - second[seed] for seed in seeds]), "seeds": seeds}


def first_checkpoint_reaching(runs: list[dict], target: float) -> dict | None:
    """The first step at which every run of `runs` has a checkpoint and their mean pass@1 is at least `target`, with
    the runs' mean training seconds there; None when no step does."""
    by_step: dict[int, list[dict]] = {}
    for run in runs:
        for point in run["curve"]:
            by_step.setdefault(point["step"], []).append(point)
    for step, points in sorted(by_step.items()):
        if len(points) == len(runs) and statistics.mean(point["pass@1"] for point in points) >= target:
            return {"step": step, "training_seconds": statistics.mean(point["seconds"] for point in points)}
    return None


def paired_by_lag(runs: dict, methods, lags, reference: int) -> dict:
    """The paired late pass@1 comparisons of a lag experiment (runs with "method", "lag", "seed" and a "curve"): each
    lag against the `reference` lag within a method ("topr/k4-k1") and the first method that ran against each other
    one at every lag ("topr-grpo_clip/k4")."""
    late: dict[tuple, dict[int, float]] = {}
    for run in runs.values():
        late.setdefault((run["method"], run["lag"]), {})[run["seed"]] = late_mean(run["curve"])
    ran = [method for method in methods if any(key[0] == method for key in late)]
    outcome = {}
    for method in ran:
        for lag in lags:
            if lag != reference and (method, lag) in late and (method, reference) in late:
                outcome[f"{method}/k{lag}-k{reference}"] = paired_difference(late[method, lag], late[method, reference])
    for other in ran[1:]:
        for lag in lags:
            if (ran[0], lag) in late and (other, lag) in late:
                outcome[f"{ran[0]}-{other}/k{lag}"] = paired_difference(late[ran[0], lag], late[other, lag])
    return outcome


def baseline_for(p: float, target: float) -> float:
    """The baseline c that gives Eq. 12's effective proportion `target` for a proportion p of +1 rewards; p~ = 1 is
    the limit c = -1 (negatives weigh nothing)."""
    from topr_trl.loss import baseline_for_effective_proportion

    return -1.0 if target >= 1.0 else baseline_for_effective_proportion(p, target)


# the reasoning testbed's splits a script may measure on (topr_trl.tasks.reasoning.SPLITS): choices are made on
# "validation", results are reported on "heldout"
EVAL_SPLITS = ("heldout", "validation")

# The held-out sampling draw. "per_seed" (the default): the runs of training seed s sample the held-out completions
# with seed EVAL_SEED + 1 + s, every method of that seed alike, so a paired difference compares two models on one
# draw and the interval over seeds carries the draw's variance along with training's; the base model is measured on
# each seed's draw. "fixed": every run and the base model on the one draw EVAL_SEED, as the results committed before
# the option were measured (they say so).
EVAL_SEED = 1234
EVAL_DRAWS = ("per_seed", "fixed")


def evaluation_seed(eval_draw: str, seed: int) -> int:
    """The seed of the held-out samples of the runs of training seed `seed` under `eval_draw` (EVAL_DRAWS)."""
    if eval_draw not in EVAL_DRAWS:
        raise ValueError(f"eval_draw {eval_draw!r}: expected one of {EVAL_DRAWS}")
    return EVAL_SEED if eval_draw == "fixed" else EVAL_SEED + 1 + seed


def experiment_parser(
    doc: str,
    *,
    output: str,
    epochs: float | None,
    prompts: int = 128,
    eval_prompts: int = 1000,
    methods: dict | None = None,
) -> argparse.ArgumentParser:
    """The options every evidence script takes (`--methods` chooses among `methods` when given); each script adds
    its own."""
    from topr_trl.tasks.reasoning import WarmStartSettings

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if methods is not None:
        parser.add_argument("--methods", nargs="+", default=list(methods), choices=list(methods))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--prompts", type=int, default=prompts, help="prompts sampled from mu (x8 completions)")
    if epochs is not None:
        parser.add_argument("--epochs", type=float, default=epochs, help="passes over the fixed dataset")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--eval_prompts", type=int, default=eval_prompts, help="held-out problems for accuracy")
    parser.add_argument(
        "--task",
        default="reasoning",
        choices=TASKS,
        help="reasoning: the written-addition testbed in the paper's regime (about two thirds of "
        "samples correct; accuracy is sampled pass@1 at temperature 1); arithmetic: the "
        "built-in 2-digit task with 3-token answers, the low-p stress test (greedy accuracy); "
        "word_problems: the real model (SmolLM2-135M-Instruct) on the built-in word problems "
        "(sampled pass@1; --eval_prompts, --eval_samples, --eval_split, --eval_draw, --threads)",
    )
    testbed = parser.add_argument_group("reasoning testbed (--task reasoning)")
    testbed.add_argument("--digits", type=int, default=3)
    testbed.add_argument("--error_rate", type=float, default=0.25, help="planted carry-drop rate of the warm start")
    testbed.add_argument(
        "--spurious_carry_rate",
        type=float,
        default=0.0,
        help="the second planted error: rate of a carry written where none arrives (0: off)",
    )
    # the shipped model's recipe (3,000 steps): at the default digits and error rate every machine starts from the
    # same shipped weights; a locally built warm start differs with the CPU's kernels (README, "The two commands")
    testbed.add_argument(
        "--warm_steps", type=int, default=WarmStartSettings().steps, help="SFT steps of the warm start"
    )
    testbed.add_argument("--eval_samples", type=int, default=4, help="samples per held-out problem (temperature 1)")
    testbed.add_argument(
        "--eval_draw",
        default="per_seed",
        choices=EVAL_DRAWS,
        help="per_seed (default): each training seed's runs, and the base model for them, are "
        "evaluated on a sampling draw of that seed's own, shared by every method, so that the "
        "intervals over seeds carry the evaluation draw; fixed: one draw for every run (the "
        "results committed before this option)",
    )
    testbed.add_argument(
        "--eval_split",
        default="heldout",
        choices=EVAL_SPLITS,
        help="where accuracy is measured: 'validation' to choose settings (learning rate, error "
        "rate, p~), 'heldout' (default) to report them; the two are disjoint",
    )
    testbed.add_argument("--threads", type=int, default=1, help="torch threads")
    arithmetic = parser.add_argument_group("built-in task (--task arithmetic)")
    arithmetic.add_argument("--base_accuracy", type=float, default=0.3, help="warm-start target of the base model")
    parser.add_argument(
        "--work_dir", default="outputs/experiments", help="base model, sampled datasets and runs (reused by a rerun)"
    )
    parser.add_argument("--output", default=output, help="writes OUTPUT.json and OUTPUT.png")
    return parser


@dataclass
class Testbed:
    """What a script trains and measures on: the base model (mu of the fixed datasets and pi's start), training
    prompts, the reward, completion length and the held-out measurement. `evaluate(model, tokenizer)` returns
    "accuracy" (the headline measure named by `measure`) and the other `metrics`."""

    task: str
    base_dir: Path
    held_out: object
    reward: Callable
    max_new_tokens: int
    measure: str
    metrics: tuple[str, ...]
    prompts: Callable[[int, int], object]
    evaluate: Callable[[object, object, int], dict]  # (model, tokenizer, evaluation seed)
    eval_draw: str = "fixed"  # EVAL_DRAWS: which evaluation seed the runs of a training seed get
    starts: dict[int, dict] = field(default_factory=dict)  # the base model's evaluation per evaluation seed

    def evaluation_seed(self, seed: int) -> int:
        return evaluation_seed(self.eval_draw, seed)

    def start(self, model, tokenizer, seed: int) -> dict:
        """The base model's evaluation on the draw of training seed `seed`, measured once per draw: every run of that
        seed starts from it."""
        eval_seed = self.evaluation_seed(seed)
        if eval_seed not in self.starts:
            self.starts[eval_seed] = self.evaluate(model, tokenizer, eval_seed)
        return self.starts[eval_seed]


def prepare(options) -> tuple[Path, Testbed]:
    """(work dir, testbed) of a script's run. The reasoning testbed's warm model is built once under
    WORK_DIR/cache (shared with experiments/sample_efficiency.py when both use the same work dir)."""
    work = Path(options.work_dir)
    return work, TESTBEDS[options.task](work, options)


def arithmetic_testbed(work: Path, options) -> Testbed:
    from topr_trl.tasks.arithmetic import accuracy, arithmetic_reward, make_arithmetic_dataset

    held_out = make_arithmetic_dataset(options.eval_prompts, 2, seed=2)
    return Testbed(
        task="arithmetic",
        base_dir=prepare_base(work, options.base_accuracy),
        held_out=held_out,
        reward=arithmetic_reward,
        max_new_tokens=6,
        measure=f"greedy accuracy, {len(held_out)} held-out problems",
        metrics=("accuracy", "invalid_rate", "malformed_rate"),
        prompts=lambda count, seed: make_arithmetic_dataset(count, 2, seed=100 + seed),
        evaluate=lambda model, tokenizer, eval_seed: accuracy(model, tokenizer, held_out),  # greedy: no draw
    )


def reasoning_testbed(work: Path, options):
    """(testbed, warm model, tokenizer, warm-start settings) of the reasoning testbed."""
    import torch

    from topr_trl.tasks.reasoning import (
        WarmStartSettings,
        build_reasoning_warm_model,
        make_reasoning_dataset,
        max_completion_tokens,
        reasoning_reward,
    )

    torch.set_num_threads(options.threads)
    settings = WarmStartSettings(
        digits=options.digits,
        error_rate=options.error_rate,
        steps=options.warm_steps,
        spurious_carry_rate=options.spurious_carry_rate,
    )
    model, tokenizer, base_path = build_reasoning_warm_model(work / "cache", settings)
    split = options.eval_split
    held_out = make_reasoning_dataset(options.eval_prompts, options.digits, split, seed=0)
    testbed = Testbed(
        task="reasoning",
        base_dir=base_path,
        held_out=held_out,
        reward=reasoning_reward,
        max_new_tokens=max_completion_tokens(options.digits),
        measure=f"sampled pass@1 (T=1, {options.eval_samples} samples x {len(held_out)} {split} problems)",
        metrics=("accuracy", "greedy_accuracy", "invalid_rate", "pass@1_carries>=2"),
        prompts=lambda count, seed: make_reasoning_dataset(count, options.digits, "train", seed=seed),
        evaluate=lambda model, tokenizer, eval_seed: held_out_pass_at_1(
            model, tokenizer, held_out, options, greedy=True, eval_seed=eval_seed
        ),
        eval_draw=options.eval_draw,
    )
    return testbed, model, tokenizer, settings


def held_out_pass_at_1(model, tokenizer, held_out, options, greedy: bool = False, eval_seed: int = EVAL_SEED) -> dict:
    """Sampled pass@1 at temperature 1 on the reasoning testbed's `held_out` problems ("pass@1" and "accuracy"),
    its standard error across problems (std of per-problem pass@1 / sqrt(problems)), the invalid rate, pass@1 on
    the problems with at least 2 carries (where the planted error strikes most) and, with `greedy`, greedy accuracy.
    Sampled with `eval_seed` (`evaluation_seed`): an unchanged model gets the same samples on the same draw."""
    from topr_trl.evaluation.runner import evaluate_model
    from topr_trl.tasks.reasoning import count_carries, max_completion_tokens, parse_problem, reasoning_classify

    common = dict(
        max_new_tokens=max_completion_tokens(options.digits), batch_size=64, seed=eval_seed, show_progress=False
    )
    result = evaluate_model(
        model, tokenizer, held_out, reasoning_classify, k=1, num_samples=options.eval_samples, temperature=1.0, **common
    )
    per_problem = [record["num_correct"] / options.eval_samples for record in result.records]
    se = statistics.stdev(per_problem) / len(per_problem) ** 0.5 if len(per_problem) > 1 else float("nan")
    carried = [
        score
        for score, record in zip(per_problem, result.records, strict=True)
        if count_carries(*parse_problem(record["prompt"])) >= 2
    ]
    point = {
        "pass@1": result.pass_at_1,
        "accuracy": result.pass_at_1,
        "pass@1_problem_se": se,
        "invalid_rate": result.invalid_rate,
        "pass@1_carries>=2": statistics.mean(carried) if carried else float("nan"),
    }
    if greedy:
        point["greedy_accuracy"] = evaluate_model(
            model, tokenizer, held_out, reasoning_classify, k=1, temperature=0.0, **common
        ).pass_at_1
    return point


def results_header(options, testbed: Testbed) -> dict:
    """What every script's JSON starts with: its options, the thread counts, the task and how it is measured."""
    import torch

    from topr_trl.runtime.machine import machine_info

    return {
        "options": vars(options),
        "task": testbed.task,
        "base_model": str(testbed.base_dir),
        "measure": testbed.measure,
        "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads()},
        "machine": machine_info(),
        "runs": {},
    }


def save(results: dict, options, plot) -> None:
    """OUTPUT.json (options, every run, the summary) and OUTPUT.png drawn by `plot(results, path)`."""
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output + ".json").write_text(json.dumps(results, indent=2))
    plot(results, Path(options.output + ".png"))


def resummarise(paths: list[str], update: Callable[[dict], None], plot) -> dict:
    """Finished runs' JSON files with their summaries recomputed by `update(results)` (which rewrites the summary
    keys in place from `results["runs"]`), written back with their plots; nothing is trained. Returns them by path."""
    outcome = {}
    for path in map(Path, paths):
        results = json.loads(path.read_text())
        update(results)
        path.write_text(json.dumps(results, indent=2))
        plot(results, path.with_suffix(".png"))
        outcome[str(path)] = results
    return outcome


def merge_results(paths: list[str]) -> dict:
    """One results dict from the JSON files of runs of one command split by seeds (e.g. one per core): the first
    file's header and options, every file's runs (refused when two files hold the same run), the seeds of all."""
    parts = [json.loads(Path(path).read_text()) for path in paths]
    results = parts[0]
    for part in parts[1:]:
        shared = set(results["runs"]) & set(part["runs"])
        if shared:
            raise SystemExit(f"--merge: {sorted(shared)[:3]} are in more than one file; merge files of disjoint runs")
        results["runs"].update(part["runs"])
        if "by_seed" in results.get("base", {}):  # each lane measured the base model on its own seeds' draws
            results["base"] = base_summary({**results["base"]["by_seed"], **part["base"]["by_seed"]})
    results["options"]["seeds"] = sorted({run["seed"] for run in results["runs"].values()})
    results["merged_from"] = list(paths)
    return results


def base_points(model, tokenizer, held_out, options) -> dict[int, dict]:
    """The base model's held-out point on each training seed's evaluation draw ({seed: point}; one evaluation per
    distinct draw, so under --eval_draw fixed every seed shares one)."""
    by_draw: dict[int, dict] = {}
    for seed in options.seeds:
        eval_seed = evaluation_seed(options.eval_draw, seed)
        if eval_seed not in by_draw:
            by_draw[eval_seed] = held_out_pass_at_1(model, tokenizer, held_out, options, eval_seed=eval_seed)
    return {seed: by_draw[evaluation_seed(options.eval_draw, seed)] for seed in options.seeds}


def base_summary(by_seed: dict) -> dict:
    """`results["base"]`: the mean pass@1 of the base model over the seeds' draws (a plot's base line) and each
    seed's point (JSON keys are strings once written)."""
    return {
        "pass@1": statistics.mean(point["pass@1"] for point in by_seed.values()),
        "by_seed": {str(seed): point for seed, point in by_seed.items()},
    }


def resummarise_if_asked(parser, argv: list[str] | None, update: Callable[[dict], None], plot) -> dict | None:
    """Adds the --resummarise option to a script's `parser`; when `argv` (None: the command line) asks for it, runs
    `resummarise` on the files it names and returns their results, else None (the script then trains as usual)."""
    parser.add_argument(
        "--resummarise",
        nargs="+",
        metavar="JSON",
        default=None,
        help="recompute the summaries of finished runs' JSON files (rewritten in place, with their "
        "plots) by this script's current rules, training nothing",
    )
    argv = sys.argv[1:] if argv is None else argv
    if "--resummarise" not in argv:
        return None
    return resummarise(parser.parse_args(argv).resummarise, update, plot)


def finished_runs_if_asked(
    parser, argv: list[str], update: Callable[[dict], None], plot, merge: Callable[[argparse.Namespace], dict]
) -> dict | None:
    """Adds --resummarise and --merge to a script's `parser` (--merge: `merge(options)` builds one results dict from
    the files of disjoint runs); when `argv` asks for either, does it, saves the results with their plot and returns
    them, training nothing; else None (the script then trains as usual)."""
    rewritten = resummarise_if_asked(parser, argv, update, plot)
    if rewritten is not None:
        return rewritten
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="merge these result files (of disjoint runs: other seeds, methods, lags) and summarise",
    )
    if "--merge" not in argv:
        return None
    options = parser.parse_args(argv)
    results = merge(options)
    save(results, options, plot)
    return results


def prepare_base(work_dir: Path, base_accuracy: float) -> Path:
    """The built-in task's warm-started tiny model, built once under `work_dir` (cached between scripts sharing a
    work dir)."""
    from topr_trl.tasks.arithmetic import build_warm_model

    base_dir = Path(work_dir) / f"base-{base_accuracy:g}"
    build_warm_model(base_dir, digits=2, target_accuracy=base_accuracy, seed=0)
    return base_dir


def sample_fixed_dataset(
    testbed: Testbed,
    num_prompts: int,
    seed: int,
    work_dir: Path,
    behaviour: Path | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """`num_prompts` x 8 completions sampled once from mu (the testbed's base model, or `behaviour`; at temperature 1,
    truncated by `top_k` / `top_p` when given), seeded and reused when on disk. The folder is named after mu and the
    truncation, so data sampled from another model or another way is never picked up."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.offline import generate_offline_dataset

    mu_dir = Path(behaviour or testbed.base_dir)
    torch.manual_seed(seed)
    mu = AutoModelForCausalLM.from_pretrained(mu_dir)
    tokenizer = AutoTokenizer.from_pretrained(mu_dir)
    truncation = (f"-topk{top_k}" if top_k else "") + (f"-topp{top_p:g}" if top_p < 1 else "")
    return generate_offline_dataset(
        mu,
        tokenizer,
        testbed.prompts(num_prompts, seed),
        testbed.reward,
        Path(work_dir) / "data" / f"{mu_dir.name}-{num_prompts}x8-seed{seed}{truncation}",
        num_completions=8,
        max_new_tokens=testbed.max_new_tokens,
        show_progress=False,
        backend="transformers",
        seed=seed,
        top_k=top_k,
        top_p=top_p,
    )


def clipped_token_shares(model, data, epsilon: float = 0.2, batch_size: int = 64) -> dict[str, float]:
    """Where PPO's clip stops the gradient on a fixed dataset (prompt_ids, completion_ids, behaviour_logps and a
    +1/-1 reward, as `sample_fixed_dataset` makes it), for the policy `model` as it stands: the share of the
    completion tokens whose ratio pi/mu lies in the clipped region of the signal's sign (r > 1 + epsilon where
    R > 0, r < 1 - epsilon where R < 0; the paper's signal R - c with c = 0), overall and per sign. Computed here
    from the model's own forward pass, independently of the trainer's loss and metrics."""
    import torch
    from trl.trainer.utils import selective_log_softmax

    counts = {"positive": [0, 0], "negative": [0, 0]}  # per sign of R: clipped tokens, tokens
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            rows = data[start : start + batch_size]
            sequences = [list(p) + list(c) for p, c in zip(rows["prompt_ids"], rows["completion_ids"], strict=True)]
            width = max(map(len, sequences))
            ids = torch.tensor([sequence + [0] * (width - len(sequence)) for sequence in sequences], device=device)
            attention = torch.tensor(
                [[1] * len(sequence) + [0] * (width - len(sequence)) for sequence in sequences], device=device
            )
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            logps = selective_log_softmax(logits, ids[:, 1:])  # position t: log pi of token t + 1
            for row, (prompt, completion, mu, reward) in enumerate(
                zip(rows["prompt_ids"], rows["completion_ids"], rows["behaviour_logps"], rows["reward"], strict=True)
            ):
                if not completion or reward == 0:
                    continue
                pi = logps[row, len(prompt) - 1 : len(prompt) + len(completion) - 1]
                ratio = (pi - torch.tensor(mu, device=device, dtype=pi.dtype)).exp()
                clipped = ratio > 1 + epsilon if reward > 0 else ratio < 1 - epsilon
                tally = counts["positive" if reward > 0 else "negative"]
                tally[0] += int(clipped.sum())
                tally[1] += len(completion)
    model.train(was_training)

    def share(clipped: int, tokens: int) -> float:
        return clipped / tokens if tokens else float("nan")

    return {
        "clipped_share": share(*map(sum, zip(*counts.values(), strict=False))),
        "clipped_share_positive": share(*counts["positive"]),
        "clipped_share_negative": share(*counts["negative"]),
    }


# TOPRTrainer's per-step metrics kept by `train_offline` beside the gradient norms
RATIO_MAXIMA = ("topr/ratio_negative/max", "topr/ratio_positive/max")


def held_out_curve(
    testbed: Testbed,
    seed: int,
    eval_every: int,
    curve: list[dict],
    probe: Callable | None = None,
    fractions: tuple[float, ...] = (),
):
    """A callback appending the held-out curve to `curve`: `testbed.evaluate` at the start (the base model, measured
    once per evaluation draw: `testbed.start`), every `eval_every` steps when > 0, at the steps these `fractions` of
    the run's steps round to, and at the end; with `probe`, each point also holds `probe(model)`'s values. It
    evaluates the model and tokenizer the trainer hands every callback."""
    from transformers import TrainerCallback

    class Evaluate(TrainerCallback):
        at: set[int] = set()

        def _evaluate(self, step: int, model, processing_class) -> None:
            if step == 0:
                point = testbed.start(model, processing_class, seed)
            else:
                point = testbed.evaluate(model, processing_class, testbed.evaluation_seed(seed))
            curve.append({"step": step, **point, **(probe(model) if probe else {})})

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
            self.at = {max(1, round(fraction * state.max_steps)) for fraction in fractions}
            self._evaluate(0, model, processing_class)

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            if (eval_every and state.global_step % eval_every == 0) or state.global_step in self.at:
                self._evaluate(state.global_step, model, processing_class)

        def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            if curve[-1]["step"] != state.global_step:
                self._evaluate(state.global_step, model, processing_class)

    return Evaluate()


def negative_weight_log(log_history: list[dict]) -> list[dict]:
    """Per logged step, the negatives' mean truncated weight and the share of negatives whose ratio the truncation
    capped at b- (`topr/negative_truncated_fraction`), where the step logged them: how hard negatives pushed, and what
    scoring pi off mu's support, or a policy far from mu, silences."""
    return [
        {
            "step": entry["step"],
            "weight_negative": entry["topr/weight_negative/mean"],
            **(
                {"negative_truncated_fraction": entry["topr/negative_truncated_fraction"]}
                if entry.get("topr/negative_truncated_fraction") is not None
                else {}
            ),
        }
        for entry in log_history
        if entry.get("topr/weight_negative/mean") is not None
    ]


def train_offline(
    testbed: Testbed,
    data,
    output_dir: Path,
    *,
    seed: int,
    epochs: float,
    batch_size: int,
    learning_rate: float,
    max_grad_norm: float = 1.0,
    eval_every: int = 0,
    probe: Callable | None = None,
    fractions: tuple[float, ...] = (),
    **overrides,
) -> dict:
    """One offline run: train the testbed's base model on `data` with TOPRConfig `overrides`; returns the held-out
    curve (`held_out_curve`: at the start, every `eval_every` steps, at `fractions` of the steps, and at the end), the
    logged gradient norms and the run time (evaluation included)."""
    import warnings

    from transformers import PrinterCallback

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.offline import stored_reward

    warnings.filterwarnings("ignore", message=".*unbounded.*")
    started = time.time()
    curve: list[dict] = []
    config = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        num_generations=8,
        max_completion_length=testbed.max_new_tokens,
        topr_offline_epochs=epochs,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=max_grad_norm,
        topr_signal="reward",
        topr_baseline=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=seed,
        disable_tqdm=True,
    )
    config.update(overrides)
    trainer = TOPRTrainer(
        model=str(testbed.base_dir),
        reward_funcs=stored_reward,
        args=TOPRConfig(**config),
        train_dataset=data,
        callbacks=[held_out_curve(testbed, seed, eval_every, curve, probe, fractions)],
    )
    trainer.remove_callback(PrinterCallback)  # one line per step would drown the script's own summary lines
    trainer.train()
    grad_norms = [
        {"step": entry["step"], "grad_norm": entry["grad_norm"]}
        for entry in trainer.state.log_history
        if "grad_norm" in entry
    ]
    # the largest sequence ratio pi/mu of the step's negatives and positives (before truncation), where logged
    ratio_maxima = [
        {"step": entry["step"], **{key: entry[key] for key in RATIO_MAXIMA if key in entry}}
        for entry in trainer.state.log_history
        if any(key in entry for key in RATIO_MAXIMA)
    ]
    # the truncated weight applied to negatives, per step: what scoring pi off mu's support silences
    negative_weights = negative_weight_log(trainer.state.log_history)
    return {
        "curve": curve,
        "grad_norms": grad_norms,
        "ratio_maxima": ratio_maxima,
        "negative_weights": negative_weights,
        "seconds": time.time() - started,
    }


# ---------------------------------------------------------------------------------------------------------
# Online runs on the reasoning testbed (sample_efficiency, staleness): a counting reward, a clock without
# evaluation time, held-out checkpoints
# ---------------------------------------------------------------------------------------------------------


def parse_testbed_options(parser, argv, smoke: dict):
    """The options of an online run on the reasoning testbed (sample_efficiency.py, staleness.py): refuses another
    task, applies the `smoke` overrides with --smoke, and checks that a batch holds whole prompt groups."""
    options = parser.parse_args(argv)
    if options.task != "reasoning":
        parser.error("this script runs on the reasoning testbed only (--task reasoning)")
    if options.smoke:
        for name, value in smoke.items():
            setattr(options, name, value)
    if options.batch_size % options.num_generations:
        parser.error("--batch_size must be a multiple of --num_generations (whole prompt groups per batch)")
    return options


def prepare_testbed(options) -> tuple:
    """(warm model, tokenizer, its path, held-out problems, the results' header) of an online run on the reasoning
    testbed. The warm model is built once under --work_dir/cache."""
    testbed, model, tokenizer, settings = reasoning_testbed(Path(options.work_dir), options)
    results = {**results_header(options, testbed), "warm_start": settings.to_dict()}
    return model, tokenizer, testbed.base_dir, testbed.held_out, results


class Tracker:
    """One run's curve: counts the completions the reward scores (when given a `reward` to wrap: use `tracker.reward`
    in the trainer), keeps a clock from which evaluation time is taken out, and evaluates held-out pass@1 at each
    `checkpoint` (printed under `label`). With an `evaluator` (a model of the policy's architecture), the policy's
    weights are loaded into it and it is evaluated instead: for trainers whose model's attention serves training only
    (the asynchronous trainers' packed attention on a CPU)."""

    def __init__(self, held_out, options, reward, label: str, seed: int, evaluator=None):
        self.held_out, self.options, self.curve, self.evaluator = held_out, options, [], evaluator
        self.completions = 0 if reward is not None else None
        self.label = label
        self.eval_seed = evaluation_seed(options.eval_draw, seed)  # the draw of this training seed
        self.started, self.evaluating = time.time(), 0.0
        if reward is None:
            return

        def counted(completions, **kwargs):
            self.completions += len(completions)
            return reward(completions, **kwargs)

        counted.__name__ = reward.__name__
        self.reward = counted

    def seconds(self) -> float:
        return time.time() - self.started - self.evaluating

    def checkpoint(self, model, tokenizer, **where) -> dict:
        seconds = self.seconds()
        started = time.time()
        if self.evaluator is not None:
            self.evaluator.load_state_dict(model.state_dict(), strict=False)
            model = self.evaluator
        counted = {} if self.completions is None else {"completions": self.completions}
        point = {
            **where,
            **counted,
            "seconds": seconds,
            **held_out_pass_at_1(model, tokenizer, self.held_out, self.options, eval_seed=self.eval_seed),
        }
        self.evaluating += time.time() - started
        self.curve.append(point)
        completions = "" if self.completions is None else f" completions {self.completions:>6}"
        print(
            f"[{self.label}]   {where}{completions} {seconds:7.1f}s "
            f"pass@1 {point['pass@1']:.3f} ± {point['pass@1_problem_se']:.3f}",
            flush=True,
        )
        return point


def checkpoint_callback(tracker: Tracker, checkpoints: int):
    """Evaluates after `checkpoints` evenly spaced optimizer steps, the last one included, on the model and tokenizer
    the trainer hands every callback."""
    from transformers import TrainerCallback

    class Checkpoints(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            total = state.max_steps
            self.at = {max(1, round(total * i / checkpoints)) for i in range(1, checkpoints + 1)}

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            if state.global_step in self.at:
                tracker.checkpoint(model, processing_class, step=state.global_step)

    return Checkpoints()


def train_config(options, seed: int, output_dir: Path) -> dict:
    """What every trainer shares (the loss and its signal are each trainer's default)."""
    from topr_trl.tasks.reasoning import max_completion_tokens

    return dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=options.batch_size,
        num_generations=options.num_generations,
        max_completion_length=max_completion_tokens(options.digits),
        temperature=1.0,
        learning_rate=options.learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=10**6,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=seed,
        disable_tqdm=True,
    )


def run_trainer(trainer_class, config, base_path, reward, dataset, tracker: Tracker, checkpoints: int, **extra):
    from transformers import PrinterCallback

    trainer = trainer_class(
        model=str(base_path),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        callbacks=[checkpoint_callback(tracker, checkpoints)],
        **extra,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer.state.global_step


def word_problems_testbed(work: Path, options) -> Testbed:
    """The real model's testbed: SmolLM2-135M-Instruct (the packaged copy without the Hub) on the built-in word
    problems (`topr_trl.tasks.word_problems`), sampled pass@1 at temperature 1 over the whole vocabulary on
    --eval_prompts problems of the test split ("heldout") or the validation split, greedy accuracy beside it."""
    import torch

    from topr_trl.inputs.sources import resolve_model_source
    from topr_trl.tasks.word_problems import (
        WORD_PROBLEM_MODEL,
        WORD_PROBLEM_TOKENS,
        make_word_problems,
        measure_word_problems,
        word_problem_reward,
    )

    torch.set_num_threads(options.threads)
    split = "test" if options.eval_split == "heldout" else "validation"
    held_out = make_word_problems(options.eval_prompts, split)

    def evaluate(model, tokenizer, eval_seed: int) -> dict:
        point = measure_word_problems(model, tokenizer, held_out, num_samples=options.eval_samples, seed=eval_seed)
        return {"accuracy": point["pass@1"], **point}

    return Testbed(
        task="word_problems",
        base_dir=Path(resolve_model_source(WORD_PROBLEM_MODEL)),
        held_out=held_out,
        reward=word_problem_reward,
        max_new_tokens=WORD_PROBLEM_TOKENS,
        measure=f"sampled pass@1 (T=1, {options.eval_samples} samples x {len(held_out)} {split} problems)",
        metrics=("accuracy", "greedy_accuracy", "mean_completion_tokens", "truncated_rate"),
        # training problems of another draw per seed than the README run's (seed 1), all from the train split
        prompts=lambda count, seed: make_word_problems(count, "train", seed=100 + seed),
        evaluate=evaluate,
        eval_draw=options.eval_draw,
    )


# Each --task's testbed, the package's built-in tasks: (work dir, options) -> Testbed.
TESTBEDS = {
    "reasoning": lambda work, options: reasoning_testbed(work, options)[0],
    "arithmetic": arithmetic_testbed,
    "word_problems": word_problems_testbed,
}
TASKS = tuple(TESTBEDS)
