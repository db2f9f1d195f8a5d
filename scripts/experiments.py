"""What the evidence scripts (figure1, baseline_sweep, figure7, iterations) share: the warm-started tiny model,
a fixed dataset sampled once from mu per seed, one offline TOPRTrainer run with a held-out accuracy curve, and
means with 95 % confidence intervals over seeds.

Every run uses the paper's signal R - c with +1/-1 rewards (`topr_signal="reward"`), a constant learning rate
and gradient clipping; methods differ only in their TOPRConfig overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
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


def baseline_for(p: float, target: float) -> float:
    """The baseline c that gives Eq. 12's effective proportion `target` for a proportion p of +1 rewards; p~ = 1 is
    the limit c = -1 (negatives weigh nothing)."""
    from topr_trl.loss import baseline_for_effective_proportion

    return -1.0 if target >= 1.0 else baseline_for_effective_proportion(p, target)


def experiment_parser(doc: str, *, output: str, epochs: float | None, prompts: int = 128,
                      eval_prompts: int = 100, methods: dict | None = None) -> argparse.ArgumentParser:
    """The options every evidence script takes (`--methods` chooses among `methods` when given); each script adds
    its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if methods is not None:
        parser.add_argument("--methods", nargs="+", default=list(methods), choices=list(methods))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--prompts", type=int, default=prompts, help="prompts sampled from mu (x8 completions)")
    if epochs is not None:
        parser.add_argument("--epochs", type=float, default=epochs, help="passes over the fixed dataset")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--eval-prompts", type=int, default=eval_prompts, help="held-out problems for accuracy")
    parser.add_argument("--base-accuracy", type=float, default=0.3, help="warm-start target of the base model")
    parser.add_argument("--work-dir", default="outputs/experiments",
                        help="base model, sampled datasets and runs (reused by a rerun)")
    parser.add_argument("--output", default=output, help="writes OUTPUT.json and OUTPUT.png")
    return parser


def prepare(options):
    """(work dir, base model dir, held-out problems) of a script's run."""
    from topr_trl.evaluation.arithmetic import make_arithmetic_dataset

    work = Path(options.work_dir)
    return work, prepare_base(work, options.base_accuracy), make_arithmetic_dataset(options.eval_prompts, 2, seed=2)


def save(results: dict, options, plot) -> None:
    """OUTPUT.json (options, every run, the summary) and OUTPUT.png drawn by `plot(results, path)`."""
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output + ".json").write_text(json.dumps(results, indent=2))
    plot(results, Path(options.output + ".png"))


def prepare_base(work_dir: Path, base_accuracy: float) -> Path:
    """The warm-started tiny model, built once under `work_dir` (cached between scripts sharing a work dir)."""
    from topr_trl.evaluation.arithmetic import build_warm_model

    base_dir = Path(work_dir) / f"base-{base_accuracy:g}"
    build_warm_model(base_dir, digits=2, target_accuracy=base_accuracy, seed=0)
    return base_dir


def sample_fixed_dataset(base_dir: Path, num_prompts: int, seed: int, work_dir: Path):
    """`num_prompts` x 8 completions sampled once from mu = the base model (seeded; reused when on disk)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.offline import generate_offline_dataset
    from topr_trl.evaluation.arithmetic import arithmetic_reward, make_arithmetic_dataset

    torch.manual_seed(seed)
    mu = AutoModelForCausalLM.from_pretrained(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    return generate_offline_dataset(mu, tokenizer, make_arithmetic_dataset(num_prompts, 2, seed=100 + seed),
                                    arithmetic_reward, Path(work_dir) / f"data-{num_prompts}-seed{seed}",
                                    num_completions=8, max_new_tokens=6, show_progress=False)


def train_offline(base_dir: Path, data, output_dir: Path, held_out, *, seed: int, epochs: float, batch_size: int,
                  learning_rate: float, max_grad_norm: float = 1.0, eval_every: int = 0, **overrides) -> dict:
    """One offline run: train `base_dir` on `data` with TOPRConfig `overrides`; returns the held-out accuracy
    curve (start, every `eval_every` steps when > 0, end), the logged gradient norms and the run time."""
    import warnings

    from transformers import PrinterCallback, TrainerCallback

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.offline import stored_reward
    from topr_trl.evaluation.arithmetic import accuracy

    warnings.filterwarnings("ignore", message=".*unbounded.*")
    started = time.time()
    curve: list[dict] = []
    trainer_ref: list = []

    class Evaluate(TrainerCallback):
        def _evaluate(self, step: int) -> None:
            trainer = trainer_ref[0]
            curve.append({"step": step, **accuracy(trainer.model, trainer.processing_class, held_out)})

        def on_train_begin(self, args, state, control, **kwargs):
            self._evaluate(0)

        def on_step_end(self, args, state, control, **kwargs):
            if eval_every and state.global_step % eval_every == 0:
                self._evaluate(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            if curve[-1]["step"] != state.global_step:
                self._evaluate(state.global_step)

    config = dict(
        output_dir=str(output_dir), per_device_train_batch_size=batch_size, num_generations=8,
        max_completion_length=6, topr_offline_epochs=epochs, learning_rate=learning_rate,
        lr_scheduler_type="constant", max_grad_norm=max_grad_norm, topr_signal="reward", topr_baseline=0.0,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        gradient_checkpointing=False, seed=seed, disable_tqdm=True,
    )
    config.update(overrides)
    trainer = TOPRTrainer(model=str(base_dir), reward_funcs=stored_reward, args=TOPRConfig(**config),
                          train_dataset=data, callbacks=[Evaluate()])
    trainer.remove_callback(PrinterCallback)  # one line per step would drown the script's own summary lines
    trainer_ref.append(trainer)
    trainer.train()
    grad_norms = [{"step": entry["step"], "grad_norm": entry["grad_norm"]}
                  for entry in trainer.state.log_history if "grad_norm" in entry]
    return {"curve": curve, "grad_norms": grad_norms, "seconds": time.time() - started}
