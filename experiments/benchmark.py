"""What TOPR costs against GRPOTrainer: the same model, data, batch shapes and seeds, interleaved in one run.

Each (trainer, setting) is run in its own subprocess so that peak memory is measured per setting; the settings
are interleaved round by round so that machine noise hits all of them alike. Completions are forced to the full
`max_completion_length` (min_new_tokens), so every setting does the same generation work.

    python -m experiments.benchmark --smoke                 # seconds; what CI runs (no assertion on times)
    python -m experiments.benchmark --repeats 5 --steps 20  # the CPU figures in the note
    python -m experiments.benchmark --interleaved --repeats 5 --steps 20   # whole steps alternated in one process
    python -m experiments.benchmark --model qwen2.5-0.5b --device cuda --bf16 --prompt_length 512 --completion_length 512
    python -m experiments.benchmark --model smollm2 --loss_only    # the packaged real model (trained weights)
    python -m experiments.benchmark --model smollm2 --shared_prompt --batch_size 8 --completion_length 64 \
        --repeats 5 --steps 4 --output experiments/evidence/benchmarks/cpu-smollm2-shared-prompt.json
    python -m experiments.benchmark --model smollm2 --shared_prompt --memory_only --batch_size 8 \
        --completion_length 64 --output experiments/evidence/benchmarks/cpu-smollm2-shared-prompt-memory.json

Prints a table (median and spread of seconds per step, tokens per second, peak memory) and the ratios
TOPR/GRPO, and writes them as JSON with `--output`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


SETTINGS = {
    # name: (trainer, config overrides)
    "grpo-dapo": ("grpo", {}),
    "grpo-grpo": ("grpo", {"loss_type": "grpo"}),
    "grpo-grpo-kl": ("grpo", {"loss_type": "grpo", "beta": 0.04}),
    "topr-online": ("topr", {}),
    # sampling truncated: pi scored on mu's support (topr_trl.support), an extra head projection per scored token
    "topr-online-top-k": ("topr", {"top_k": 50}),
    "topr-online-top-p": ("topr", {"top_p": 0.95}),
    "topr-offline": ("topr", {"__behaviour__": True}),
    # Offline datasets (no generation): mu's log-probs stored, or recomputed by a frozen copy of mu (extra work)
    "topr-replay": ("topr", {"__replay__": "stored"}),
    "topr-replay-recompute": ("topr", {"__replay__": "recompute"}),
}
# The pairs compared for the targets: the same work in both trainers.
RATIOS = {
    "topr-online / grpo-grpo": ("topr-online", "grpo-grpo"),
    "topr-online / grpo-dapo": ("topr-online", "grpo-dapo"),
    "topr-online / grpo-grpo-kl": ("topr-online", "grpo-grpo-kl"),
    # what scoring pi on mu's support costs when the sampler truncates (the extra work against the same trainer)
    "topr-online-top-k / topr-online": ("topr-online-top-k", "topr-online"),
    "topr-online-top-p / topr-online": ("topr-online-top-p", "topr-online"),
    # what recomputing mu's log-probs costs when an offline dataset has none stored
    "topr-replay-recompute / topr-replay": ("topr-replay-recompute", "topr-replay"),
}
# The figures the shared-prompt benchmark writes at the top of its JSON (the task's recipe: 8 completions a prompt).
SHARED_PROMPT_KEYS = (
    "loss_backward_vs_grpo",
    "loss_backward_vs_grpo_4",
    "peak_added_memory_vs_grpo",
    "peak_added_memory_vs_grpo_4",
    "step_vs_grpo",
    "flops_bound",
    "flops_bound_4",
)
MODEL_SHAPES = {
    "tiny": dict(hidden_size=64, num_layers=2),
    "small": dict(hidden_size=256, num_layers=4),
}
# Qwen2.5-0.5B / 1.5B as published (their config.json), random weights: weights do not change speed. The full
# 151,936-entry vocabulary is kept so that the LM head and the logits, the largest activations of an RL step, are
# the real ones; the project's character tokenizer covers only the first ids, and sampled ids past it decode to "".
QWEN_SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2
    ),
}
# The packaged pretrained model (`topr_trl.inputs.packaged_models`): trained weights, so peaked distributions, its own
# tokenizer and its 49,152-token vocabulary with tied embeddings. Resolved to its cached trainable folder, not built.
REAL_MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
QWEN_COMMON = dict(
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    hidden_act="silu",
)


def build_trainer(setting: str, options: dict, model_path: str):
    """The trainer of one setting with the shared model, data, batch shapes and seeds, and its step timer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.offline.rollout import make_behaviour_rollout
    from topr_trl.tasks.arithmetic import make_arithmetic_dataset

    trainer_name, overrides = SETTINGS[setting]
    overrides = dict(overrides)
    behaviour = overrides.pop("__behaviour__", False)
    replay = overrides.pop("__replay__", None)
    cuda = options["device"] == "cuda"
    prompt_text = "1+1=" + "0" * max(options["prompt_length"] - 40, 0)  # pads prompts to the requested length
    dataset = make_arithmetic_dataset(256, digits=2, seed=0).map(
        lambda row: {"prompt": [{"role": "user", "content": row["prompt"][0]["content"] + prompt_text[4:]}]}
    )

    def length_reward(completions, **kwargs):  # any reward with variance: the loss must do real work
        return [float(hash(c[0]["content"]) % 3) for c in completions]

    if replay:  # an offline dataset of full-length completions (random digit tokens), as generation would give
        import math

        from topr_trl.offline import stored_reward

        generator = torch.Generator().manual_seed(0)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
        # log mu of a random-weight model is close to uniform over the vocabulary: stored log-probs far from pi's
        # would drive the sequence weights to ~1e-30 and the CPU into slow denormal arithmetic, timing an artefact
        uniform_logp = -math.log(AutoConfig.from_pretrained(model_path).vocab_size)
        rows = []
        for index, prompt in enumerate(dataset["prompt"]):
            for sample in range(options["num_generations"]):
                tokens = torch.randint(len(digits), (options["completion_length"],), generator=generator).tolist()
                rows.append(
                    {
                        "prompt": prompt,
                        "prompt_index": index,
                        "sample_index": sample,
                        "completion_ids": [digits[t] for t in tokens],
                        "behaviour_logps": [uniform_logp] * options["completion_length"],
                        "reward": float((index + sample) % 3),
                    }
                )
        from datasets import Dataset

        dataset = Dataset.from_list(rows)
        if replay == "recompute":
            dataset = dataset.remove_columns("behaviour_logps")
            overrides["topr_behaviour_model"] = model_path
        length_reward = stored_reward

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=options["batch_size"],
        num_generations=options["num_generations"],
        max_completion_length=options["completion_length"],
        max_prompt_length=None,
        generation_kwargs={"min_new_tokens": options["completion_length"]},
        max_steps=options["steps"] + options["warmup"],
        learning_rate=1e-6,
        logging_steps=10**6,
        report_to="none",
        save_strategy="no",
        use_cpu=not cuda,
        bf16=options["bf16"],
        gradient_checkpointing=False,
        seed=0,
    )
    config_class, trainer_class = (TOPRConfig, TOPRTrainer) if trainer_name == "topr" else (GRPOConfig, GRPOTrainer)
    try:
        args = config_class(**common, **overrides)
    except TypeError:  # max_prompt_length is gone in some TRL versions
        common.pop("max_prompt_length")
        args = config_class(**common, **overrides)
    extra = {}
    if behaviour:
        mu = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if options["bf16"] else None)
        mu.to("cuda" if cuda else "cpu")
        extra["rollout_func"] = make_behaviour_rollout(mu, AutoTokenizer.from_pretrained(model_path))
    timer = StepTimer()
    trainer = trainer_class(
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=dataset, callbacks=[timer], **extra
    )
    return trainer, timer


def worker(options: dict) -> dict:
    """Run one setting and return its measurements (executed in a subprocess)."""
    import torch

    cuda = options["device"] == "cuda"
    trainer, timer = build_trainer(options["setting"], options, options["model_path"])
    generation_seconds: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a, **k):  # generation is the same work in every setting; time it apart
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        output = generate_and_score(*a, **k)
        if cuda:
            torch.cuda.synchronize()
        generation_seconds.append(time.perf_counter() - start)
        return output

    trainer._generate_and_score_completions = timed_generate_and_score
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    times = timer.times[options["warmup"] :]
    # One generation per optimizer step here (steps_per_generation == gradient_accumulation_steps == 1).
    update_times = [t - g for t, g in zip(timer.times, generation_seconds, strict=True)][options["warmup"] :]
    tokens_per_step = options["batch_size"] * (options["prompt_length"] + options["completion_length"])
    peak = (
        torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {
        "setting": options["setting"],
        "step_seconds": times,
        "update_seconds": update_times,
        "tokens_per_step": tokens_per_step,
        "peak_memory_mib": peak,
        "flops": step_flops(trainer.model.config, options, options["setting"]),
    }


class AddedMemory:
    """The most memory one call adds above what is resident when it starts. On a GPU, the allocator's peak. On a
    Linux CPU, the process's resident peak (`VmHWM`, reset through /proc/self/clear_refs) with glibc's mmap threshold
    fixed at 1 MiB (`mallopt`), so that every tensor of a MiB or more is mapped when allocated and unmapped when freed:
    the resident size then follows the live tensors, not what malloc keeps. Not `available` elsewhere."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda
        self.available, self.measured_as = cuda, "torch.cuda.max_memory_allocated" if cuda else None
        self._resident = 0.0
        if not cuda and os.path.exists("/proc/self/clear_refs"):
            import ctypes

            try:
                fixed = ctypes.CDLL("libc.so.6").mallopt(-3, 2**20) == 1  # M_MMAP_THRESHOLD
            except OSError:
                fixed = False
            self.available = fixed
            self.measured_as = "VmHWM - VmRSS, mmap threshold 1 MiB" if fixed else None

    @staticmethod
    def _status_mib(key: str) -> float:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(key)) / 1024

    def start(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self._resident = self.torch.cuda.memory_allocated() / 2**20
            self.torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # the resident peak starts again from the resident size
            self._resident = self._status_mib("VmRSS:")

    def peak_mib(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() / 2**20 - self._resident
        return self._status_mib("VmHWM:") - self._resident


@contextlib.contextmanager
def every_sequence_scored():
    """pi scored on mu's support for every sequence, as before only those whose weight reads pi/mu were
    (`topr_trl.loss.reads_the_ratio`; canonical TOPR's negatives): what leaving the positives unscored saves, timed in
    the same run."""
    import topr_trl.trainer as trainer_module

    if not hasattr(trainer_module, "reads_the_ratio"):  # a library that scores every sequence already (timed as is)
        yield
        return
    reads = trainer_module.reads_the_ratio
    trainer_module.reads_the_ratio = lambda signal, spec: reads(signal, spec) | True
    try:
        yield
    finally:
        trainer_module.reads_the_ratio = reads


def loss_only(options, model_path: str) -> dict:
    """Loss + backward of each trainer on the *same* generated batch, interleaved call by call in one process:
    the part of a step where TOPR and GRPO differ, free of generation noise."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.tasks.arithmetic import make_arithmetic_dataset

    cuda = options.device == "cuda"
    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=options.batch_size,
        num_generations=options.num_generations,
        max_completion_length=options.completion_length,
        generation_kwargs={"min_new_tokens": options.completion_length},
        report_to="none",
        use_cpu=not cuda,
        bf16=options.bf16,
        gradient_checkpointing=False,
        seed=0,
    )

    def reward(completions, **kwargs):
        return [float(hash(c[0]["content"]) % 3) for c in completions]

    dataset = make_arithmetic_dataset(64, digits=2)
    trainers = {
        "grpo-grpo": GRPOTrainer(
            model=model_path, reward_funcs=reward, train_dataset=dataset, args=GRPOConfig(loss_type="grpo", **common)
        ),
        "grpo-dapo": GRPOTrainer(
            model=model_path, reward_funcs=reward, train_dataset=dataset, args=GRPOConfig(loss_type="dapo", **common)
        ),
        "topr-online": TOPRTrainer(
            model=model_path, reward_funcs=reward, train_dataset=dataset, args=TOPRConfig(**common)
        ),
    }
    truncations = {"topr-online-top-k": {"top_k": options.top_k}, "topr-online-top-p": {"top_p": options.top_p}}
    for name, truncation in truncations.items():  # the same batch, pi scored on mu's support
        trainers[name] = TOPRTrainer(
            model=model_path, reward_funcs=reward, train_dataset=dataset, args=TOPRConfig(**common, **truncation)
        )
    first = next(iter(trainers.values()))
    on_policy = first._prepare_inputs(next(iter(first.get_train_dataloader())))
    for trainer in trainers.values():  # as training does: with --bf16 the forward runs under the accelerator's autocast
        trainer.model = trainer.accelerator.prepare_model(trainer.model)
    # The batch as off-policy data brings it: mu's log-probs kept from generation time (GRPO computes them when it
    # reuses a batch, a sampler returns them, stored rows hold them). On-policy without KL, TOPR has no support to
    # score (pi/mu is 1 by construction: `TOPRTrainer._rows_reading_the_ratio`); that case is timed apart.
    untruncated = trainers["topr-online"]  # GRPO's forward (the mirror), no support to score
    with torch.no_grad():
        old_logps = untruncated._policy_logps_and_entropies(untruncated.model, on_policy)[0]
    inputs = {**on_policy, "old_per_token_logps": old_logps}
    calls = {name: (trainer, inputs, contextlib.nullcontext) for name, trainer in trainers.items()}
    calls["topr-online-top-k, on-policy batch"] = (trainers["topr-online-top-k"], on_policy, contextlib.nullcontext)
    # The same top-k call with every sequence scored, positives too (whose weight canonical TOPR pins at 1)
    calls["topr-online-top-k, every sequence scored"] = (trainers["topr-online-top-k"], inputs, every_sequence_scored)
    times: dict[str, list[float]] = {name: [] for name in calls}

    def call(name: str) -> None:
        trainer, batch, context = calls[name]
        with context(), torch.no_grad() if options.forward_only else contextlib.nullcontext():
            loss = trainer.compute_loss(trainer.model, batch)
            if not options.forward_only:
                loss.backward()
        trainer.model.zero_grad(set_to_none=True)

    for repeat in range(options.repeats * options.steps + 3):
        for name in calls:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            call(name)
            if cuda:
                torch.cuda.synchronize()
            if repeat >= 3:  # warm-up calls
                times[name].append(time.perf_counter() - start)
    # The memory one call adds above what is resident before it (every trainer's weights; gradients are freed
    # between calls): activations, logits, gradients and, with truncation, the support's extra logits. Measured after
    # the timed calls, since on a CPU it changes how tensors are allocated.
    watch = AddedMemory(torch, cuda)
    added_memory: dict[str, list[float]] = {name: [] for name in calls}
    if watch.available:
        for _ in range(2):
            for name in calls:
                watch.start()
                call(name)
                added_memory[name].append(watch.peak_mib())
    medians = {name: statistics.median(values) for name, values in times.items()}
    quartiles = {name: statistics.quantiles(values, n=4) for name, values in times.items()}
    ratios = {f"topr-online / {name}": medians["topr-online"] / medians[name] for name in ("grpo-grpo", "grpo-dapo")}
    ratios.update(
        {
            f"{name} / {base}": medians[name] / medians[base]
            for name in (
                "topr-online-top-k",
                "topr-online-top-p",
                "topr-online-top-k, on-policy batch",
                "topr-online-top-k, every sequence scored",
            )
            for base in ("topr-online", "grpo-dapo")
        }
    )
    ratios["topr-online-top-k / topr-online-top-k, every sequence scored"] = (
        medians["topr-online-top-k"] / medians["topr-online-top-k, every sequence scored"]
    )
    import topr_trl
    from topr_trl.runtime.machine import machine_info

    library = Path(topr_trl.__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "-C", str(library), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "library": {"path": str(library), "commit": commit},
        "machine": machine_info(),
        "median_loss_backward_s": medians,
        "quartiles_s": quartiles,
        "ratios": ratios,
        "timed": "the loss's forward alone, without gradient" if options.forward_only else "loss + backward",
    }
    if watch.available:
        peaks = {name: max(values) for name, values in added_memory.items()}
        result["peak_added_memory_mib"] = peaks
        result["peak_added_memory_measured_as"] = watch.measured_as
        # None where either call added nothing measurable: a tiny model's call (the smoke) can hold under the
        # 1 MiB mmap threshold, in pages malloc already has, and a ratio to or from nothing says nothing
        result["peak_added_memory_ratios"] = {
            f"{name} / {base}": peaks[name] / peaks[base] if peaks[base] > 0 and peaks[name] > 0 else None
            for name in ("topr-online", "topr-online-top-k", "topr-online-top-p")
            for base in ("grpo-grpo", "grpo-dapo", "topr-online")
            if name != base
        }
        # what one trainer holds besides a call's memory: its weights (loss-only builds no optimizer state)
        result["weights_mib_per_trainer"] = sum(p.numel() * p.element_size() for p in first.model.parameters()) / 2**20
    return result


def shared_prompt_flops_bound(config, batch: dict) -> float:
    """The model FLOPs of the shared-prompt loss + backward over the padded one's on `batch` (`model_flops_per_token`'s
    convention): the backbone runs each distinct prompt but its last token once, and every row's last prompt token and
    completion against the whole context, where the padded forward runs every row whole; the head projects the same
    completion tokens in both (TRL's fused head scores only them)."""
    prompts, completions = batch["prompt_ids"], batch["completion_ids"]
    rows, prompt_length, completion_length = prompts.size(0), prompts.size(1), completions.size(1)
    distinct = len({tuple(row) for row in torch_rows(prompts, batch["prompt_mask"])})
    head = config.hidden_size * config.vocab_size
    backbone = model_flops_per_token(config, 0)["parameters"] - head
    attention = 4 * config.num_hidden_layers * config.hidden_size

    def forward(tokens: int, context: int) -> float:
        return tokens * (2 * backbone + attention * context)

    scored_head = 2 * head * float(batch["completion_mask"].sum())
    full = prompt_length + completion_length
    padded = forward(rows * full, full) + scored_head
    shared = forward(distinct * (prompt_length - 1), prompt_length) + forward(rows * (completion_length + 1), full)
    return (shared + scored_head) / padded


def torch_rows(ids, mask) -> list[tuple]:
    """Each row's (ids, mask) as a tuple of ints: what makes two prompts the same one."""
    return [tuple(row) for row in zip(ids.tolist(), mask.tolist(), strict=True) for row in [row[0] + row[1]]]


def loss_backward(trainer, batch: dict, cuda: bool = False) -> None:
    """One loss + backward of `trainer` on `batch`, its gradients then freed."""
    import torch

    trainer.compute_loss(trainer.model, batch).backward()
    trainer.model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()


def interleaved_loss_backward(trainers: dict, batch: dict, repeats: int, warmup: int, cuda: bool = False) -> dict:
    """Each trainer's loss + backward on `batch`, call by call in turn (`warmup` rounds untimed): the seconds of each
    call. (Memory is measured apart, one process per trainer: `peak_added_memory`.)"""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for repeat in range(repeats + warmup):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            loss_backward(trainer, batch, cuda)
            if repeat >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


SHARED_PROMPT_TRAINERS = ("grpo-dapo", "topr-shared-prompt", "topr-padded")


def shared_prompt_trainer(name: str, generations: int, spec: dict, model_path: str, **more):
    """One of `SHARED_PROMPT_TRAINERS` on the word problems: `trl.GRPOTrainer` (`dapo`), or TOPRTrainer with or
    without the shared-prompt forward; `spec` holds the batch size, completion length, device and bf16."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.tasks.word_problems import make_word_problems, word_problem_reward

    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=spec["batch_size"],
        num_generations=generations,
        max_completion_length=spec["completion_length"],
        temperature=1.0,
        report_to="none",
        use_cpu=spec["device"] != "cuda",
        bf16=spec["bf16"],
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        **more,
    )
    dataset = make_word_problems(64, "train", few_shot=spec["few_shot"])
    if name == "grpo-dapo":
        return GRPOTrainer(
            model_path, word_problem_reward, GRPOConfig(loss_type="dapo", **common), train_dataset=dataset
        )
    args = TOPRConfig(topr_shared_prompt_forward=name == "topr-shared-prompt", **common)
    return TOPRTrainer(model_path, word_problem_reward, args=args, train_dataset=dataset)


def memory_probe(probe: dict) -> float | None:
    """In a process of its own: the memory one loss + backward of one trainer adds on the stored batch (after one
    warm-up call), or None where `AddedMemory` cannot measure. The watch is set up before any tensor exists, so that
    the mmap threshold it fixes holds for every allocation."""
    import torch

    cuda = probe["spec"]["device"] == "cuda"
    watch = AddedMemory(torch, cuda)
    trainer = shared_prompt_trainer(probe["name"], probe["generations"], probe["spec"], probe["model_path"])
    batch = torch.load(probe["batch"], map_location="cuda" if cuda else "cpu", weights_only=False)
    loss_backward(trainer, batch, cuda)
    if not watch.available:
        return None
    watch.start()
    loss_backward(trainer, batch, cuda)
    return watch.peak_mib()


def peak_added_memory(generations: int, batch: dict, spec: dict, model_path: str) -> dict[str, float | None]:
    """Per trainer of `SHARED_PROMPT_TRAINERS`, the memory one loss + backward on `batch` adds (`memory_probe`), each
    in its own process: a process's resident peak never comes down, so one trainer's cannot hide another's."""
    import torch

    stored = Path(tempfile.mkdtemp(prefix="topr-bench-batch-")) / "batch.pt"
    torch.save({key: value.cpu() if torch.is_tensor(value) else value for key, value in batch.items()}, stored)
    peaks = {}
    for name in SHARED_PROMPT_TRAINERS:
        probe = dict(name=name, generations=generations, spec=spec, model_path=model_path, batch=str(stored))
        completed = subprocess.run(
            [sys.executable, __file__, "--memory_probe", json.dumps(probe)],
            capture_output=True,
            text=True,
        )
        lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
        if completed.returncode != 0 or not lines:
            sys.exit(f"the memory probe of {name} failed:\n{completed.stderr[-3000:]}")
        peaks[name] = json.loads(lines[-1][len("RESULT ") :])
        print(f"[benchmark] {generations} per prompt, {name}: one call adds {peaks[name]} MiB", flush=True)
    return peaks


def shared_prompt_batch(generations: int, spec: dict, model_path: str) -> dict:
    """The off-policy batch every trainer of the shared-prompt benchmark is measured on: TOPRTrainer's first batch of
    sampled completions, mu's log-probs kept from generation time as reused data has them."""
    import torch

    trainer = shared_prompt_trainer("topr-padded", generations, spec, model_path)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with torch.no_grad():
        return {**batch, "old_per_token_logps": trainer._policy_logps_and_entropies(trainer.model, batch)[0]}


def shared_prompt(options, model_path: str) -> dict:
    """TOPRTrainer with the shared-prompt forward (`topr_shared_prompt_forward`) against `trl.GRPOTrainer` (`dapo`)
    on the real model's two-shot word problems and the completions it samples: loss + backward on the same off-policy
    batch at each number of completions per prompt (interleaved call by call, with TOPRTrainer's padded forward
    beside them), the memory one call adds (one process per trainer) and the FLOPs bound; then, unless
    `--memory_only`, whole online steps (`shared_prompt_steps`)."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    spec = {key: getattr(options, key) for key in ("batch_size", "completion_length", "device", "bf16", "few_shot")}
    cuda = options.device == "cuda"
    result: dict = {"per_prompt": {}}
    for generations in options.shared_prompt_generations:
        batch = shared_prompt_batch(generations, spec, model_path)
        row: dict = {
            "prompt_tokens": int(batch["prompt_mask"].sum()) // options.batch_size,
            "padded_prompt_length": batch["prompt_ids"].size(1),
            "completion_tokens_mean": float(batch["completion_mask"].sum()) / options.batch_size,
            "padded_completion_length": batch["completion_ids"].size(1),
            "flops_bound": shared_prompt_flops_bound(config, batch),
        }
        if not options.memory_only:
            trainers = {
                name: shared_prompt_trainer(name, generations, spec, model_path) for name in SHARED_PROMPT_TRAINERS
            }
            times = interleaved_loss_backward(trainers, batch, options.repeats, options.warmup, cuda)
            medians = {name: statistics.median(values) for name, values in times.items()}
            row.update(
                median_loss_backward_s=medians,
                loss_backward_s=times,
                loss_backward_vs_grpo=medians["topr-shared-prompt"] / medians["grpo-dapo"],
                padded_vs_grpo=medians["topr-padded"] / medians["grpo-dapo"],
            )
            del trainers
        memory = peak_added_memory(generations, batch, spec, model_path)
        row["peak_added_memory_mib"] = memory
        if memory["grpo-dapo"] and memory["topr-shared-prompt"] is not None:
            row["peak_added_memory_vs_grpo"] = memory["topr-shared-prompt"] / memory["grpo-dapo"]
        row["peak_added_memory_measured_as"] = AddedMemory(torch, cuda).measured_as
        result["per_prompt"][str(generations)] = row
        print(f"[benchmark] {generations} per prompt: " + json.dumps(row), flush=True)
    eight = result["per_prompt"].get("8", next(iter(result["per_prompt"].values())))
    four = result["per_prompt"].get("4")
    headline = dict(
        loss_backward_vs_grpo=eight.get("loss_backward_vs_grpo"),
        loss_backward_vs_grpo_4=four.get("loss_backward_vs_grpo") if four else None,
        peak_added_memory_vs_grpo=eight.get("peak_added_memory_vs_grpo"),
        peak_added_memory_vs_grpo_4=four.get("peak_added_memory_vs_grpo") if four else None,
        flops_bound=eight["flops_bound"],
        flops_bound_4=four["flops_bound"] if four else None,
    )
    result.update({key: value for key, value in headline.items() if value is not None})  # --memory_only: no times
    if not options.memory_only and options.step_rounds > 0:
        result.update(shared_prompt_steps(options.shared_prompt_generations[0], spec, model_path, options))
    return result


def shared_prompt_steps(generations: int, spec: dict, model_path: str, options) -> dict:
    """Whole online steps (generation, loss, backward, optimizer) of GRPOTrainer and TOPRTrainer with the shared
    prompt, the trainers alternated round by round from the same seed; each run's first step warms up."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.start)

    steps: dict[str, list[float]] = {"grpo-dapo": [], "topr-shared-prompt": []}
    for _ in range(options.step_rounds):
        for name in steps:
            timer = StepTimes()
            trainer = shared_prompt_trainer(name, generations, spec, model_path, max_steps=options.steps)
            trainer.add_callback(timer)
            trainer.train()
            steps[name] += timer.seconds[1:]
    medians = {name: statistics.median(values) for name, values in steps.items()}
    return dict(
        step_s=steps,
        median_step_s=medians,
        step_vs_grpo=medians["topr-shared-prompt"] / medians["grpo-dapo"],
        step_completions_per_prompt=generations,
    )


def support_only(options) -> dict:
    """What the rule costs per completion token, apart from the head projection: `processed_log_probs` (top-k on the
    k largest logits, top-p on the sorted row) against the log-softmax over the whole vocabulary (what scoring without
    truncation does), on (tokens, vocabulary) logits at the Qwen2.5 vocabulary, flat (a random-weight model's) and
    peaked (Zipf-like, as a trained model's next token)."""
    import torch

    from topr_trl.support import SamplerProcessing, processed_log_probs

    vocabulary, tokens = 151_936, options.batch_size * options.completion_length
    generator = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, vocabulary + 1, dtype=torch.float32)
    shapes = {
        "flat": torch.randn(tokens, vocabulary, generator=generator) * 0.05,
        "peaked": (-1.2 * ranks.log()).expand(tokens, -1)[:, torch.randperm(vocabulary, generator=generator)]
        + torch.randn(tokens, vocabulary, generator=generator) * 0.3,
    }
    sampled = torch.randint(0, vocabulary, (tokens,), generator=generator).to(options.device)
    shapes = {shape: logits.to(options.device) for shape, logits in shapes.items()}
    synchronize = torch.cuda.synchronize if options.device == "cuda" else (lambda: None)

    def timed(function) -> float:
        function()
        times = []
        for _ in range(options.repeats):
            synchronize()
            start = time.perf_counter()
            function()
            synchronize()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times) / tokens * 1000

    result = {}
    for shape, logits in shapes.items():
        whole = timed(lambda logits=logits: logits.log_softmax(-1).gather(-1, sampled.unsqueeze(-1)))
        for name, processing in {
            "top_k 50": SamplerProcessing(top_k=50),
            "top_p 0.95": SamplerProcessing(top_p=0.95),
        }.items():
            rule = timed(lambda logits=logits, processing=processing: processed_log_probs(logits, sampled, processing))
            result[f"{shape} {name}"] = {"ms_per_1k_tokens": {"rule": rule, "whole vocabulary": whole}}
    return {"tokens": tokens, "vocabulary": vocabulary, "device": options.device, "timings": result}


def model_flops_per_token(config, sequence_length: int) -> dict[str, float]:
    """Model FLOPs per token (the PaLM appendix B convention): a forward pass costs 2 N + 4 L d s per token, with
    N the non-embedding parameters plus the LM head, L layers, d the hidden size and s the sequence length (the
    attention score and value products); forward + backward cost three times that."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    mlp = 3 * hidden * config.intermediate_size
    parameters = layers * (attention + mlp) + hidden * config.vocab_size  # LM head counted, input embedding not
    forward = 2 * parameters + 4 * layers * hidden * sequence_length
    return {"forward": forward, "forward_backward": 3 * forward, "parameters": parameters}


def step_flops(config, options: dict, setting: str) -> dict[str, float]:
    """Model FLOPs of one step: generation (prefill + decoding, one forward per token; for replayed offline data
    none, or mu's forward when its log-probs are recomputed), the policy's forward and backward over prompt +
    completion, and the reference model's forward with beta > 0."""
    sequence = options["prompt_length"] + options["completion_length"]
    per_token = model_flops_per_token(config, sequence)
    sequences = options["batch_size"]
    # replayed offline data is not generated; recomputing mu's log-probs is one forward of mu instead
    replay = SETTINGS[setting][1].get("__replay__")
    generation = 0.0 if replay == "stored" else per_token["forward"] * sequences * sequence
    update = per_token["forward_backward"] * sequences * sequence
    if SETTINGS[setting][1].get("beta", 0) > 0:
        update += per_token["forward"] * sequences * sequence
    return {"generation": generation, "update": update, "step": generation + update}


def measured_matmul_rate(device: str, bf16: bool, size: int | None = None, repeats: int = 10) -> float:
    """FLOP/s of a large square matrix product on this device and dtype: the peak that MFU is measured against
    (a measured rate, not the datasheet's)."""
    import torch

    size = size or (8192 if device == "cuda" else 1024)
    dtype = torch.bfloat16 if bf16 else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def interleaved_steps(options, model_path: str) -> dict:
    """Whole optimizer steps (generation, scoring, loss, backward, optimizer) of every setting in one process,
    alternated step by step in a shuffled order, so that machine noise falls on all of them alike; wall time and
    process CPU time per step. Peak memory needs one process per setting: the default mode measures it."""
    import torch

    trainers = {setting: build_trainer(setting, vars(options), model_path)[0] for setting in options.settings}
    iterators = {}
    for trainer in trainers.values():
        trainer.model.train()
        trainer.create_optimizer()
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
        iterators[trainer] = iter(trainer.get_train_dataloader())
    wall: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    order = random.Random(0)
    for round_index in range(options.warmup + options.repeats * options.steps):
        names = list(trainers)
        order.shuffle(names)  # no setting always follows the same one (allocator and cache state)
        for name in names:
            trainer = trainers[name]
            batch = next(iterators[trainer])
            if options.device == "cuda":
                torch.cuda.synchronize()
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            trainer.training_step(trainer.model, batch, None)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            if options.device == "cuda":
                torch.cuda.synchronize()
            if round_index >= options.warmup:
                wall[name].append(time.perf_counter() - wall_start)
                cpu[name].append(time.process_time() - cpu_start)
    table = {
        name: {
            "median_step_s": statistics.median(wall[name]),
            "quartiles_step_s": statistics.quantiles(wall[name], n=4),
            "median_cpu_s": statistics.median(cpu[name]),
        }
        for name in trainers
    }
    ratios = {
        label: {
            "step_time": table[a]["median_step_s"] / table[b]["median_step_s"],
            "cpu_time": table[a]["median_cpu_s"] / table[b]["median_cpu_s"],
        }
        for label, (a, b) in RATIOS.items()
        if a in table and b in table
    }
    return {"table": table, "ratios": ratios}


def qwen_config(shape: str, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        **QWEN_SHAPES[shape],
        **QWEN_COMMON,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_model(shape: str, path: str, logit_scale: float = 1.0) -> None:
    """A random-weight model of `shape` saved at `path`; `logit_scale` multiplies its output embedding (tied at the
    Qwen2.5 shapes: the input embedding too), so that its logits spread as a trained model's: 1 gives rows of
    logits about 0.6 apart (flat), 8 about 5 (peaked, a nucleus of a few tokens)."""
    from topr_trl.tasks.tiny import build_model as build
    from topr_trl.tasks.tiny import build_tokenizer, save_pretrained

    tokenizer = build_tokenizer()
    if shape in QWEN_SHAPES:
        import torch
        from transformers import Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(qwen_config(shape, tokenizer))
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        if logit_scale != 1:
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(logit_scale)
    else:
        kwargs = dict(MODEL_SHAPES[shape])
        model = build(tokenizer, hidden_size=kwargs.pop("hidden_size"), num_layers=kwargs.pop("num_layers"), **kwargs)
    save_pretrained(model, tokenizer, path)


def summarise(results: dict[str, list[dict]], matmul_rate: float) -> dict:
    """Per setting: medians over all steps, spread of per-run medians, tokens/s, peak memory, and model FLOPs
    utilisation of the whole step and of the update alone against the measured `matmul_rate`."""
    table = {}
    for setting, runs in results.items():
        per_run = [statistics.median(r["step_seconds"]) for r in runs if r["step_seconds"]]
        median = statistics.median(t for r in runs for t in r["step_seconds"])
        median_update = statistics.median(t for r in runs for t in r["update_seconds"])
        flops = runs[0]["flops"]
        table[setting] = {
            "median_step_s": median,
            "median_update_s": median_update,
            "spread_step_s": [min(per_run), max(per_run)],
            "tokens_per_s": runs[0]["tokens_per_step"] / median,
            "peak_memory_mib": statistics.median(r["peak_memory_mib"] for r in runs),
            "spread_peak_memory_mib": [
                min(r["peak_memory_mib"] for r in runs),
                max(r["peak_memory_mib"] for r in runs),
            ],
            "mfu_step": flops["step"] / median / matmul_rate,
            "mfu_update": flops["update"] / median_update / matmul_rate,
        }
    ratios = {}
    for name, (numerator, denominator) in RATIOS.items():
        if numerator in table and denominator in table:
            ratios[name] = {
                "step_time": table[numerator]["median_step_s"] / table[denominator]["median_step_s"],
                "update_time": table[numerator]["median_update_s"] / table[denominator]["median_update_s"],
                "peak_memory": table[numerator]["peak_memory_mib"] / table[denominator]["peak_memory_mib"],
            }
    return {"table": table, "ratios": ratios}


def write_output(options, result: dict) -> None:
    """The results and the options that produced them, as JSON at `--output` (when given)."""
    if options.output:
        with open(options.output, "w") as handle:
            json.dump({**result, "options": vars(options)}, handle, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny and short: checks the script runs")
    parser.add_argument(
        "--model", default="tiny", choices=sorted(MODEL_SHAPES) + sorted(QWEN_SHAPES) + sorted(REAL_MODELS)
    )
    parser.add_argument(
        "--logit_scale",
        type=float,
        default=1.0,
        help="multiply a Qwen2.5-shaped model's output embedding: 1 flat rows, 8 peaked (build_model)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--completion_length", type=int, default=32)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument(
        "--loss_only",
        action="store_true",
        help="time only loss+backward on one shared batch, all trainers in one process",
    )
    parser.add_argument(
        "--forward_only",
        action="store_true",
        help="with --loss_only: time the loss's forward alone, without gradient (where the support's "
        "cost is a larger share of the call)",
    )
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="whole steps of every setting alternated in one process (wall and CPU time; no memory)",
    )
    parser.add_argument("--top_k", type=int, default=50, help="--loss_only: mu's top-k (the paper samples with 500)")
    parser.add_argument("--top_p", type=float, default=0.95, help="--loss_only: mu's top-p")
    parser.add_argument(
        "--support_only",
        action="store_true",
        help="time the rule alone against the whole-vocabulary log-softmax (flat and peaked logits)",
    )
    parser.add_argument(
        "--shared_prompt",
        action="store_true",
        help="the shared-prompt forward against GRPOTrainer on the real model's word problems (--model smollm2)",
    )
    parser.add_argument(
        "--shared_prompt_generations", type=int, nargs="+", default=[8, 4], help="--shared_prompt: completions a prompt"
    )
    parser.add_argument(
        "--step_rounds", type=int, default=2, help="--shared_prompt: rounds of whole online steps (0: none)"
    )
    parser.add_argument(
        "--few_shot",
        type=int,
        default=2,
        help="--shared_prompt: worked examples in each prompt (0: the question alone)",
    )
    parser.add_argument(
        "--memory_only",
        action="store_true",
        help="--shared_prompt: the batches and the memory one loss + backward adds, no timing",
    )
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--memory_probe", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.logit_scale != 1 and options.model not in QWEN_SHAPES:
        parser.error(
            f"--logit_scale applies to the Qwen2.5 shapes ({', '.join(sorted(QWEN_SHAPES))}), not {options.model}"
        )
    if options.worker:
        print("RESULT " + json.dumps(worker(json.loads(options.worker))), flush=True)
        return
    if options.memory_probe:
        print("RESULT " + json.dumps(memory_probe(json.loads(options.memory_probe))), flush=True)
        return
    if options.support_only:
        result = support_only(options)
        for name, row in result["timings"].items():
            print(
                f"{name:<20} "
                + "  ".join(f"{path} {value:.1f} ms/1k tokens" for path, value in row["ms_per_1k_tokens"].items())
            )
        write_output(options, {"support_only": result})
        return
    if options.smoke:
        options.repeats, options.steps, options.warmup, options.batch_size, options.num_generations = 1, 2, 1, 4, 4
        options.completion_length, options.prompt_length = 8, 16
    if options.model in REAL_MODELS:
        from topr_trl.inputs.sources import resolve_model_source

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model_path = resolve_model_source(REAL_MODELS[options.model], "--model")
    else:
        model_path = tempfile.mkdtemp(prefix="topr-bench-model-")
        build_model(options.model, model_path, options.logit_scale)
    if options.shared_prompt:
        result = shared_prompt(options, model_path)
        print(", ".join(f"{key} {result[key]}" for key in SHARED_PROMPT_KEYS if key in result))
        write_output(
            options, {"shared_prompt": result, **{key: result[key] for key in SHARED_PROMPT_KEYS if key in result}}
        )
        return
    if options.loss_only:
        result = loss_only(options, model_path)
        timed = "forward" if options.forward_only else "loss+backward"
        for name, median in result["median_loss_backward_s"].items():
            print(
                f"{name:<14} {timed} median {median * 1000:.2f} ms  quartiles "
                f"{[round(q * 1000, 2) for q in result['quartiles_s'][name]]}"
            )
        for name, ratio in result["ratios"].items():
            print(f"{name:<28} {ratio:.3f}")
        for name, peak in result.get("peak_added_memory_mib", {}).items():
            print(f"{name:<20} memory added by one call (peak) {peak:.1f} MiB")
        for name, ratio in result.get("peak_added_memory_ratios", {}).items():
            shown = "none measured in one of the two calls" if ratio is None else f"{ratio:.3f}"
            print(f"{name:<36} added memory {shown}")
        write_output(options, {"loss_only": result})
        return
    if options.interleaved:
        result = interleaved_steps(options, model_path)
        print(f"{'setting':<16} {'wall s/step':>11} {'quartiles':>22} {'cpu s/step':>11}")
        for name, row in result["table"].items():
            quartiles = "/".join(f"{q:.4f}" for q in row["quartiles_step_s"])
            print(f"{name:<16} {row['median_step_s']:>11.4f} {quartiles:>22} {row['median_cpu_s']:>11.4f}")
        for name, ratio in result["ratios"].items():
            print(f"{name:<28} step time {ratio['step_time']:.3f}   cpu time {ratio['cpu_time']:.3f}")
        write_output(options, {"interleaved": result})
        return
    matmul_rate = measured_matmul_rate(options.device, options.bf16)
    print(
        f"[benchmark] measured matrix-product rate: {matmul_rate / 1e9:.1f} GFLOP/s "
        f"({'bf16' if options.bf16 else 'fp32'}, {options.device})",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name in options.settings}
    for repeat in range(options.repeats):
        for setting in options.settings:  # interleaved: every round runs every setting once
            spec = {
                key: getattr(options, key)
                for key in (
                    "device",
                    "bf16",
                    "steps",
                    "warmup",
                    "batch_size",
                    "num_generations",
                    "prompt_length",
                    "completion_length",
                )
            }
            spec.update(setting=setting, model_path=model_path)
            completed = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True
            )
            lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
            if completed.returncode != 0 or not lines:
                sys.exit(f"setting {setting} failed:\n{completed.stderr[-3000:]}")
            results[setting].append(json.loads(lines[-1][len("RESULT ") :]))
            print(
                f"[benchmark] round {repeat + 1}/{options.repeats} {setting}: "
                f"{statistics.median(results[setting][-1]['step_seconds']):.4f} s/step",
                flush=True,
            )
    summary = summarise(results, matmul_rate)
    summary["matmul_flops_per_s"] = matmul_rate
    print(
        f"\n{'setting':<16} {'s/step':>8} {'spread of run medians':>22} {'s/update':>9} {'tokens/s':>9} "
        f"{'peak MiB':>9} {'peak spread':>13} {'MFU step':>9} {'MFU upd.':>9}"
    )
    for setting, row in summary["table"].items():
        spread = f"{row['spread_step_s'][0]:.4f}-{row['spread_step_s'][1]:.4f}"
        peak_spread = f"{row['spread_peak_memory_mib'][0]:.1f}-{row['spread_peak_memory_mib'][1]:.1f}"
        print(
            f"{setting:<16} {row['median_step_s']:>8.4f} {spread:>22} {row['median_update_s']:>9.4f} "
            f"{row['tokens_per_s']:>9.0f} {row['peak_memory_mib']:>9.1f} {peak_spread:>13} {row['mfu_step']:>9.2%} "
            f"{row['mfu_update']:>9.2%}"
        )
    print("\n(s/update: the step without generation and scoring, i.e. the loss, backward and optimizer work)")
    for name, ratio in summary["ratios"].items():
        print(
            f"{name:<28} step time {ratio['step_time']:.3f}   update time {ratio['update_time']:.3f}   "
            f"peak memory {ratio['peak_memory']:.3f}"
        )
    write_output(options, summary)


if __name__ == "__main__":
    main()
