"""The built-in verifiable task: integer arithmetic with a checkable answer.

Prompts are conversational (`[{"role": "user", "content": "23+58="}]`), the reference answer is a string,
and `arithmetic_reward` follows TRL's reward-function signature, so the dataset and reward plug into
GRPOTrainer and TOPRTrainer alike. Rewards are +1 for a correct answer and -1 otherwise, as in the paper.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..evaluation.rewards import CORRECT, INCORRECT, INVALID, completion_text
from ..generation.completions import generate_completions
from ..inputs.prompts import tokenize_prompts
from .tiny import (
    build_model,
    build_tokenizer,
    install_prebuilt,
    machine_key,
    prebuilt_model,
    record_build,
    save_pretrained,
    staged_folder,
)


_INTEGER = re.compile(r"-?\d+")


def make_arithmetic_dataset(num_prompts: int, digits: int = 2, seed: int = 0, operators: str = "+") -> Dataset:
    """`num_prompts` distinct problems `a<op>b=` with operands of up to `digits` digits."""
    rng = random.Random(seed)
    high = 10**digits - 1
    if num_prompts > (high + 1) ** 2 * len(operators):
        raise ValueError(f"only {(high + 1) ** 2 * len(operators)} distinct problems with {digits} digit(s)")
    seen, prompts, answers = set(), [], []
    while len(prompts) < num_prompts:
        a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(operators)
        if (a, b, op) in seen:
            continue
        seen.add((a, b, op))
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompts.append([{"role": "user", "content": f"{a}{op}{b}="}])
        answers.append(str(value))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def parse_answer(text: str) -> str | None:
    """The first integer in the completion, or None when there is none (an invalid answer)."""
    match = _INTEGER.search(text)
    return match.group(0) if match else None


def arithmetic_reward(completions, answer, **kwargs) -> list[float]:
    """+1 when the completion's first integer equals the reference answer, -1 otherwise (TRL signature)."""
    return [
        1.0 if parse_answer(completion_text(c)) == str(a) else -1.0 for c, a in zip(completions, answer, strict=True)
    ]


def _arithmetic_classify(text, reference) -> str:
    answer = parse_answer(completion_text(text))
    if answer is None:
        return INVALID
    return CORRECT if answer == str(reference).strip() else INCORRECT


arithmetic_classify = _arithmetic_classify
arithmetic_classify.extract = lambda text: parse_answer(completion_text(text))
arithmetic_classify.equivalent = None
"""classify(text, reference) -> "correct" | "incorrect" | "invalid": the completion's first integer against the
reference (as `arithmetic_reward` scores it), with the `extract` / `equivalent` attributes
`topr_trl.evaluation.runner.evaluate_model` uses for maj@k."""


def _encode_example(tokenizer, prompt, answer) -> tuple[list[int], int]:
    prompt_text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return list(prompt_ids) + answer_ids, len(prompt_ids)


def warm_start(
    model,
    tokenizer,
    dataset: Dataset,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    target_accuracy: float | None = None,
    eval_dataset: Dataset | None = None,
    check_every: int = 2,
    progress=None,
    progress_every: int = 100,
):
    """Supervised warm-start on reference answers (cross-entropy on answer tokens only), so that RL starts
    from a model that is right sometimes, as the paper's instruct models are.

    With `target_accuracy`, stops at the first check (every `check_every` steps) where greedy accuracy on
    `eval_dataset` reaches it: a tiny model learns arithmetic in a sudden jump, so a fixed step count would
    land anywhere between 0 % and 90 %. The jump spans a few tens of steps: checking every 10 steps overshot a 30 %
    target to 54 % held-out, every 2 steps lands at 19 % (1 thread). `progress(step, steps, loss)` is called every
    `progress_every` steps and at the last one."""
    if target_accuracy is not None and eval_dataset is None:
        raise ValueError("target_accuracy needs an eval_dataset")
    generator = torch.Generator().manual_seed(seed)
    examples = [_encode_example(tokenizer, p, a) for p, a in zip(dataset["prompt"], dataset["answer"], strict=True)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    reported, loss = 0, None
    for step in range(steps):
        if target_accuracy is not None and step % check_every == 0 and step > 0:
            if accuracy(model, tokenizer, eval_dataset)["accuracy"] >= target_accuracy:
                if progress is not None and reported < step and loss is not None:
                    progress(step, steps, loss.item())  # where the target stopped it
                break
            model.train()
        batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=generator).tolist()]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (ids, prompt_length) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, prompt_length : len(ids)] = torch.tensor(ids[prompt_length:])
            attention[row, : len(ids)] = 1
        device = model.device  # the batch is built on the CPU; a model on a GPU trains there
        loss = model(input_ids=input_ids.to(device), attention_mask=attention.to(device), labels=labels.to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if progress is not None and ((step + 1) % progress_every == 0 or step + 1 == steps):
            progress(step + 1, steps, loss.item())
            reported = step + 1
    model.eval()
    return model


@torch.no_grad()
def accuracy(model, tokenizer, dataset: Dataset, max_new_tokens: int = 8, batch_size: int = 64) -> dict[str, float]:
    """Greedy accuracy on `dataset`, the invalid rate (no integer in the answer: the reward cannot score it) and the
    malformed rate (the answer is not exactly one integer followed by EOS, the format the model was taught)."""
    was_training = model.training
    model.eval()
    correct = invalid = malformed = 0
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        # the prompts as GRPOTrainer tokenizes them for training (special tokens and chat template included)
        completions = generate_completions(
            model,
            tokenizer,
            tokenize_prompts(tokenizer, rows["prompt"]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
        decoded = [tokenizer.decode(c["completion_ids"], skip_special_tokens=True) for c in completions]
        stopped = [c["stopped"] for c in completions]
        for text, reference, ended in zip(decoded, rows["answer"], stopped, strict=True):
            parsed = parse_answer(text)
            invalid += parsed is None
            correct += parsed == reference
            malformed += not (ended and _INTEGER.fullmatch(text.strip()))
    model.train(was_training)
    return {
        "accuracy": correct / len(dataset),
        "invalid_rate": invalid / len(dataset),
        "malformed_rate": malformed / len(dataset),
    }


def warm_model_key(digits: int = 2, target_accuracy: float = 0.15, seed: int = 0) -> str:
    """The folder name of the built-in arithmetic model of these settings (`build_warm_model`), without the machine
    part that a locally trained one adds (`warm_model_folder`)."""
    return f"arithmetic-d{digits}-acc{target_accuracy:g}-seed{seed}"


def warm_model_folder(cache_dir: str | Path, digits: int = 2, target_accuracy: float = 0.15, seed: int = 0) -> Path:
    """Where the built-in arithmetic model of these settings is cached under `cache_dir`: the shipped one (default
    settings) by its settings alone, a locally trained one with the torch version, CPU kernels and threads."""
    key = warm_model_key(digits, target_accuracy, seed)
    return Path(cache_dir) / (key if prebuilt_model(key) is not None else f"{key}-{machine_key()}")


WARM_START_MAX_STEPS = 3000  # the cap the shipped arithmetic model was built with

ARITHMETIC_HEAD_DIM = 16
"""The arithmetic model keeps the tiny model's first head size, 16, which vLLM's CPU attention kernel refuses: with
heads of 32 (`topr_trl.tasks.tiny.HEAD_DIM`) its warm start needs 5,152 steps to reach 30 % and its RL run then
falls (greedy 0.305 -> 0.265 on the held-out set with `topr-trl train`'s defaults, against 0.320 -> 0.515 with
heads of 16). vLLM runs the reasoning model, the main job's."""


def build_warm_model(
    path: str | Path,
    digits: int = 2,
    target_accuracy: float = 0.15,
    max_steps: int = WARM_START_MAX_STEPS,
    seed: int = 0,
    progress=None,
    **model_kwargs,
):
    """Build (or load, if `path` holds one) the tiny model of the built-in task, warm-started by SFT until its
    greedy accuracy on problems outside the RL train and eval sets first reaches `target_accuracy`; the shipped
    weights are installed instead where these are the settings they were built with."""
    path = Path(path)
    if not (path / "config.json").exists() and not model_kwargs and max_steps == WARM_START_MAX_STEPS:
        install_prebuilt(warm_model_key(digits, target_accuracy, seed), path)
    if (path / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, **{"head_dim": ARITHMETIC_HEAD_DIM, **model_kwargs})
    warm_start(
        model,
        tokenizer,
        make_arithmetic_dataset(2000, digits=digits, seed=seed + 1000),
        max_steps,
        target_accuracy=target_accuracy,
        eval_dataset=make_arithmetic_dataset(100, digits=digits, seed=seed + 2000),
        progress=progress,
    )
    with staged_folder(path) as staging:
        save_pretrained(model, tokenizer, staging)
        record_build(
            staging,
            dict(digits=digits, target_accuracy=target_accuracy, max_steps=max_steps, seed=seed, **model_kwargs),
        )
    return model, tokenizer
