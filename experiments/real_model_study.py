"""The pre-registered real-model study (experiments/evidence/real-model-study/preregistration.md): off-policy TOPR
against TOPR scored on the whole vocabulary, TIS, PPO-clip and SFT on positives, on SmolLM2-135M-Instruct (the
packaged copy) and the built-in word problems.

Every seed has one fixed dataset, sampled once from the frozen base model mu at temperature 1 with top_p 0.95 and
shared by every method of the seed; every method trains on it from the base model (full fine-tuning, the paper's
signal R with c = 0) and is evaluated once, at the end (the end point): sampled pass@1 at temperature 1 on
EVAL_PROBLEMS problems x EVAL_SAMPLES samples of its split, each problem's outcome stored. A method's rate is chosen
on the validation seeds (`choose_rate`); the held-out seeds run at that rate only, and only once the choice is final.

    OMP_NUM_THREADS=1 python -m experiments.real_model_study --split validation &   # one lane per core
    OMP_NUM_THREADS=1 python -m experiments.real_model_study --split validation &
    python -m experiments.real_model_study --status       # what is done, what is next, each method's choice
    OMP_NUM_THREADS=1 python -m experiments.real_model_study --split test &   # (twice)
    python -m experiments.real_model_study --summarise    # summary.json: the four comparisons, Holm, the verdicts

Each run is written to RUNS/<split>-<method>-seed<s>-lr<L>.json when it ends and a rerun skips the runs on disk, so
that lanes can stop and start over sessions; every lane reads the same queue (`planned_runs`) and takes the first run
no other live lane has claimed. The statistics (`sign_flip_p`, `holm`, `compare`) are pure functions, tested in experiments/tests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STUDY = Path(__file__).resolve().parent / "evidence" / "real-model-study"
RUNS = STUDY / "runs"

METHODS: dict[str, dict] = {
    # method: TOPRConfig overrides, on the paper's signal R - c with c = 0 and +1/-1 rewards
    "topr": {"loss_type": "topr"},  # pi scored on mu's support (the rows carry how mu sampled): the exact ratio
    "topr_whole_vocabulary": {"loss_type": "topr"},  # the same rows without `behaviour_sampling`: what TRL scores
    "tis": {"loss_type": "tis"},
    "ppo": {"loss_type": "ppo", "topr_ratio_level": "token"},
    "sft_positives": {"loss_type": "sft"},
}
WHOLE_VOCABULARY = {"topr_whole_vocabulary"}
"""Methods trained on the dataset with its `behaviour_sampling` column dropped."""
REFERENCE = "topr"
COMPARED = ("topr_whole_vocabulary", "tis", "ppo", "sft_positives")
"""The four pre-registered comparisons: REFERENCE - each."""

GRID = (3e-6, 1e-5, 3e-5)
"""The rates every method tries on the validation seeds."""
LADDER = (3e-7, 1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4)
"""The rates an edge choice extends to, one step at a time (GRID is its middle)."""
VALIDATION_SEEDS = (100,)
"""Pre-registered 100 and 101; 101 dropped by the pre-registered resize (preregistration.md, Deviations)."""
TEST_SEEDS = tuple(range(10))
SPLITS = {"validation": VALIDATION_SEEDS, "test": TEST_SEEDS}

PROMPTS = 12  # training problems per seed, 8 completions each from mu
COMPLETIONS = 8
EPOCHS = 3.0
BATCH_SIZE = 8
TOP_P = 0.95
EVAL_PROBLEMS = 96
EVAL_SAMPLES = 2
ALPHA = 0.05


# ---------------------------------------------------------------------------------------------------------
# The statistics (pure)
# ---------------------------------------------------------------------------------------------------------

_T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262, 11: 2.228}


def sign_flip_p(differences: list[float]) -> float:
    """The exact two-sided sign-flip permutation p-value of the mean of paired `differences`: the share of the 2^n
    sign assignments whose |mean| is at least the observed |mean| (under the null each difference is as likely
    negative as positive). A tolerance of 1e-12 keeps ties ties under float rounding."""
    observed = abs(sum(differences))
    count = sum(
        abs(sum(sign * value for sign, value in zip(signs, differences, strict=True))) >= observed - 1e-12
        for signs in itertools.product((1, -1), repeat=len(differences))
    )
    return count / 2 ** len(differences)


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (each at most 1, never below a smaller raw p's adjusted value)."""
    order = sorted(p_values, key=p_values.__getitem__)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p_values[name]))
        adjusted[name] = running
    return adjusted


def compare(a: dict[int, float], b: dict[int, float]) -> dict:
    """A - B paired by seed: the mean difference, the half-width of its 95 % t-interval, the exact sign-flip p."""
    seeds = sorted(set(a) & set(b))
    differences = [a[seed] - b[seed] for seed in seeds]
    mean = statistics.mean(differences)
    half = _T95[len(seeds)] * statistics.stdev(differences) / math.sqrt(len(seeds)) if len(seeds) > 1 else math.nan
    return {
        "seeds": seeds,
        "differences": differences,
        "difference": mean,
        "ci95": [mean - half, mean + half],
        "p": sign_flip_p(differences),
    }


def verdict(difference: float, p_holm: float) -> str:
    if p_holm < ALPHA:
        return "above" if difference > 0 else "below"
    return "undecided"


def choose_rate(scores: dict[float, float]) -> tuple[float, float | None]:
    """(the chosen rate, the rate to try next or None). The choice is the rate of the highest mean validation end
    point (an exact tie goes to the smaller rate); at the edge of the rates tried it extends the grid one LADDER step
    outward, and the choice is final only when it is interior (or LADDER ends)."""
    best = max(sorted(scores), key=lambda rate: scores[rate])
    tried = sorted(scores)
    step = LADDER.index(best)
    if best == tried[0] and step > 0:
        return best, LADDER[step - 1]
    if best == tried[-1] and step < len(LADDER) - 1:
        return best, LADDER[step + 1]
    return best, None


# ---------------------------------------------------------------------------------------------------------
# The runs on disk
# ---------------------------------------------------------------------------------------------------------


def run_path(split: str, method: str, seed: int, rate: float, runs: Path = RUNS) -> Path:
    return runs / f"{split}-{method}-seed{seed}-lr{rate:g}.json"


def load_runs(runs: Path = RUNS) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(runs.glob("*.json"))]


def validation_scores(records: list[dict]) -> dict[str, dict[float, list[float]]]:
    """method -> rate -> the end points of its validation runs."""
    scores: dict[str, dict[float, list[float]]] = {}
    for record in records:
        if record["split"] == "validation":
            scores.setdefault(record["method"], {}).setdefault(record["learning_rate"], []).append(record["pass@1"])
    return scores


def rate_state(method: str, records: list[dict]) -> dict:
    """Where `method`'s choice stands: the rates whose validation seeds are all on disk, their mean end points, the
    choice and whether it is final, and the rates still to run on the validation seeds."""
    by_rate = validation_scores(records).get(method, {})
    complete = {rate: statistics.mean(v) for rate, v in by_rate.items() if len(v) == len(VALIDATION_SEEDS)}
    partial = {rate: (statistics.mean(v), len(v)) for rate, v in by_rate.items()}
    pending = [rate for rate in GRID if rate not in complete]
    if pending:
        return {"means": complete, "partial": partial, "chosen": None, "final": False, "to_run": pending}
    chosen, extension = choose_rate(complete)
    return {
        "means": complete,
        "partial": partial,
        "chosen": chosen,
        "final": extension is None,
        "to_run": [] if extension is None else [extension],
    }


def planned_runs(split: str, records: list[dict], methods=tuple(METHODS)) -> list[tuple[str, int, float]]:
    """The runs of `split` that are not on disk yet, in the order lanes take them: validation, every method's
    pending rates on every validation seed; test, every method whose choice is final at its chosen rate on every
    held-out seed (seeds outermost, so that an interrupted study is balanced over methods)."""
    done = {(r["split"], r["method"], r["seed"], r["learning_rate"]) for r in records}
    planned = []
    for seed in SPLITS[split]:
        for method in methods:
            state = rate_state(method, records)
            rates = state["to_run"] if split == "validation" else ([state["chosen"]] if state["final"] else [])
            planned += [(method, seed, rate) for rate in rates if (split, method, seed, rate) not in done]
    return planned


def claim(name: str, claims: Path) -> bool:
    """Take run `name` for this process: a claim file made atomically, so that two lanes never train one run. A claim
    whose process has ended (a lane stopped or killed) is taken over."""
    claims.mkdir(parents=True, exist_ok=True)
    path = claims / f"{name}.claim"
    for _ in range(2):
        try:
            with open(path, "x") as file:
                file.write(str(os.getpid()))
            return True
        except FileExistsError:
            try:
                owner = int(path.read_text() or 0)
                os.kill(owner, 0)
                return owner == os.getpid()
            except (ProcessLookupError, ValueError):
                path.unlink(missing_ok=True)  # its lane is gone: the run is free again
            except FileNotFoundError:
                pass
    return False


# ---------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------


def evaluation_problems(split: str):
    from topr_trl.tasks.word_problems import make_word_problems

    return make_word_problems(EVAL_PROBLEMS, split)


def evaluation_seed(seed: int) -> int:
    """The evaluation draw of training seed `seed`, shared by every method of the seed (the comparison is paired)."""
    return 7_000 + seed


def base_model() -> Path:
    from topr_trl.inputs.sources import resolve_model_source
    from topr_trl.tasks.word_problems import WORD_PROBLEM_MODEL

    return Path(resolve_model_source(WORD_PROBLEM_MODEL))


def fixed_dataset(seed: int, work: Path):
    """The seed's dataset from mu, sampled once and read back by every method and lane (the other lanes wait on the
    seed's lock while one samples it)."""
    import fcntl

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.offline import generate_offline_dataset
    from topr_trl.tasks.word_problems import WORD_PROBLEM_TOKENS, make_word_problems, word_problem_reward

    mu_dir = base_model()
    folder = work / "data" / f"{mu_dir.name}-{PROMPTS}x{COMPLETIONS}-seed{seed}-topp{TOP_P:g}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        torch.manual_seed(seed)
        return generate_offline_dataset(
            AutoModelForCausalLM.from_pretrained(mu_dir),
            AutoTokenizer.from_pretrained(mu_dir),
            make_word_problems(PROMPTS, "train", seed=1_000 + seed),
            word_problem_reward,
            folder,
            num_completions=COMPLETIONS,
            max_new_tokens=WORD_PROBLEM_TOKENS,
            show_progress=False,
            backend="transformers",
            seed=seed,
            top_p=TOP_P,
        )


def end_point(model, tokenizer, split: str, seed: int) -> dict:
    """Sampled pass@1 at temperature 1 over the whole vocabulary, each problem's number of correct samples kept."""
    from topr_trl.evaluation.runner import evaluate_model, gsm8k_classify
    from topr_trl.tasks.word_problems import WORD_PROBLEM_TOKENS

    problems = evaluation_problems(split)
    result = evaluate_model(
        model,
        tokenizer,
        problems,
        gsm8k_classify,
        k=1,
        num_samples=EVAL_SAMPLES,
        temperature=1.0,
        max_new_tokens=WORD_PROBLEM_TOKENS,
        seed=evaluation_seed(seed),
        show_progress=False,
        backend="transformers",
    )
    per_problem = [
        {"question": row["question"], "correct": record["num_correct"], "samples": EVAL_SAMPLES}
        for row, record in zip(problems, result.records, strict=True)
    ]
    lengths = [tokens for record in result.records for tokens in record["num_tokens"]]
    return {
        "pass@1": sum(entry["correct"] for entry in per_problem) / (EVAL_SAMPLES * len(per_problem)),
        "per_problem": per_problem,
        "mean_completion_tokens": statistics.mean(lengths),
    }


STEP_LOG = ("loss", "grad_norm", "topr/weight_negative/mean", "topr/negative_truncated_fraction")


def train_one(method: str, seed: int, rate: float, split: str, work: Path) -> dict:
    import torch
    from transformers import PrinterCallback

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.offline import stored_reward

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    data = fixed_dataset(seed, work)
    if method in WHOLE_VOCABULARY:
        data = data.remove_columns("behaviour_sampling")
    started, cpu_started = time.time(), time.process_time()
    config = TOPRConfig(
        output_dir=str(work / "runs" / f"{split}-{method}-seed{seed}-lr{rate:g}"),
        per_device_train_batch_size=BATCH_SIZE,
        num_generations=COMPLETIONS,
        topr_offline_epochs=EPOCHS,
        learning_rate=rate,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
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
        **METHODS[method],
    )
    trainer = TOPRTrainer(model=str(base_model()), reward_funcs=stored_reward, args=config, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    trained = time.time()
    trainer.model.eval()
    point = end_point(trainer.model, trainer.processing_class, split, seed)
    return {
        **point,
        "dataset": {
            "rows": len(data),
            "positive_fraction": sum(r > 0 for r in data["reward"]) / len(data),
            "mean_completion_tokens": statistics.mean(map(len, data["completion_ids"])),
        },
        "steps": trainer.state.global_step,
        "log": [
            {"step": e["step"], **{k: e[k] for k in STEP_LOG if k in e}}
            for e in trainer.state.log_history
            if any(k in e for k in STEP_LOG)
        ],
        "train_seconds": trained - started,
        "eval_seconds": time.time() - trained,
        "seconds": time.time() - started,
        "cpu_seconds": time.process_time() - cpu_started,
    }


def record_run(method: str, seed: int, rate: float, split: str, work: Path) -> Path:
    from topr_trl.runtime.machine import machine_info

    result = train_one(method, seed, rate, split, work)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    record = {
        "study": "real-model-study",
        "method": method,
        "seed": seed,
        "split": split,
        "learning_rate": rate,
        "end_point": "pass@1",
        **result,
        "evaluation": {"problems": EVAL_PROBLEMS, "samples": EVAL_SAMPLES, "seed": evaluation_seed(seed)},
        "overrides": METHODS[method],
        "threads": os.environ["OMP_NUM_THREADS"],
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "machine": {**machine_info(), "python": platform.python_version()},
        "commit": commit,
    }
    path = run_path(split, method, seed, rate)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1))
    partial.rename(path)  # whole or absent: a lane killed mid-write leaves no run that looks finished
    return path


# ---------------------------------------------------------------------------------------------------------
# The summary
# ---------------------------------------------------------------------------------------------------------


def summarise(records: list[dict]) -> dict:
    """Each method's choice, its held-out end points by seed, and the four comparisons with Holm's adjustment and
    their verdicts (over the held-out seeds every method of the pair has)."""
    states = {method: rate_state(method, records) for method in METHODS}
    held_out: dict[str, dict[int, float]] = {method: {} for method in METHODS}
    for record in records:
        state = states[record["method"]]
        if record["split"] == "test" and state["final"] and record["learning_rate"] == state["chosen"]:
            held_out[record["method"]][record["seed"]] = record["pass@1"]
    comparisons = {
        other: compare(held_out[REFERENCE], held_out[other])
        for other in COMPARED
        if len(set(held_out[REFERENCE]) & set(held_out[other])) >= 2
    }
    adjusted = holm({other: row["p"] for other, row in comparisons.items()})
    complete = all(len(held_out[m]) == len(TEST_SEEDS) for m in METHODS)
    return {
        "study": "real-model-study",
        "complete": complete,
        "alpha": ALPHA,
        "choices": {
            method: {
                "chosen": s["chosen"],
                "final": s["final"],
                "validation_means": {f"{r:g}": v for r, v in s["means"].items()},
                "validation_so_far": {f"{r:g}": {"mean": m, "seeds": n} for r, (m, n) in sorted(s["partial"].items())},
            }
            for method, s in states.items()
        },
        "held_out": {
            method: {"seeds": sorted(v), "mean": statistics.mean(v.values()) if v else None, "by_seed": v}
            for method, v in held_out.items()
        },
        "comparisons": [
            {
                "a": REFERENCE,
                "b": other,
                **row,
                "p_holm": adjusted[other],
                "verdict": verdict(row["difference"], adjusted[other]) if complete else "incomplete",
            }
            for other, row in comparisons.items()
        ],
    }


def status(records: list[dict]) -> str:
    lines = [f"{len(records)} runs on disk under {RUNS}"]
    for method in METHODS:
        state = rate_state(method, records)
        means = ", ".join(f"{rate:g}: {mean:.3f}" for rate, mean in sorted(state["means"].items()))
        lines.append(
            f"{method:<22} validation means {{{means}}}  chosen {state['chosen']}  final {state['final']}  "
            f"to run {state['to_run']}"
        )
    for split in SPLITS:
        lines.append(f"next {split} runs: {len(planned_runs(split, records))}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.real_model_study", description=__doc__.split("\n\n")[0]
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--split", choices=list(SPLITS), help="run this split's planned runs")
    action.add_argument("--status", action="store_true", help="what is on disk and what comes next")
    action.add_argument("--summarise", action="store_true", help=f"write {STUDY.name}/summary.json")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--work_dir", default="runs/real-model-study", help="datasets and trainer folders")
    parser.add_argument("--max_runs", type=int, default=0, help="stop after this many runs (0: the whole share)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    if options.status:
        print(status(load_runs()))
        return 0
    if options.summarise:
        summary = summarise(load_runs())
        (STUDY / "summary.json").write_text(json.dumps(summary, indent=2))
        for row in summary["comparisons"]:
            low, high = row["ci95"]
            print(
                f"{row['a']} - {row['b']:<22} {row['difference']:+.3f} [{low:+.3f}, {high:+.3f}]  p {row['p']:.4f}  "
                f"Holm {row['p_holm']:.4f}  {row['verdict']}"
            )
        return 0
    done, claims = 0, Path(options.work_dir) / "claims"
    while options.max_runs == 0 or done < options.max_runs:
        # the queue is read again after every run: another lane's runs, and a choice made final, change it
        planned = planned_runs(options.split, load_runs(), tuple(options.methods))
        taken = next((run for run in planned if claim(run_path(options.split, *run).stem, claims)), None)
        if taken is None:
            print(f"[study] nothing left to run on {options.split} (or every run left is another lane's)", flush=True)
            return 0
        method, seed, rate = taken
        print(f"[study] {options.split} {method} seed {seed} lr {rate:g} ...", flush=True)
        path = record_run(method, seed, rate, options.split, Path(options.work_dir))
        (claims / f"{path.stem}.claim").unlink(missing_ok=True)
        record = json.loads(path.read_text())
        print(
            f"[study] {path.name}: pass@1 {record['pass@1']:.3f}, {record['seconds']:.0f} s "
            f"(train {record['train_seconds']:.0f}, eval {record['eval_seconds']:.0f})",
            flush=True,
        )
        done += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
