"""A stand-in for TRL's vLLM rollout worker with a controllable lag, for CPUs, tests and staleness experiments.

`LaggedRolloutWorker` implements TRL 1.16's `RolloutWorkerProtocol` (start, stop, update_model_version,
check_health, plus the `rollout_buffer` and `metrics_queue` queues) and `weight_transfer()` gives the matching
`WeightTransferProtocol`: the trainer's weight syncs (TRL's `_sync_weight`, unchanged) hand each version of the policy
to the worker in the same process instead of streaming it to a vLLM server over NCCL.

The worker samples groups of `num_generations` completions in a thread, with their log-probs under the exact
sampling distribution (what vLLM reports), scores them with the reward functions and queues TRL `RolloutSample`s with
the group advantage TRL's worker computes. Two knobs make it a controlled experiment:

- `lag` K: every group is sampled from the policy K versions before the newest one (version 1, the initial weights,
  while fewer exist), and stamped with that version: TRL's trainer measures the staleness of each sample from it.
- `seconds_per_sample`: a group takes at least this many seconds per completion (the worker sleeps the rest),
  standing in for an inference server on its own hardware; 0 generates as fast as this CPU does.

`lockstep=True` makes it synchronous: it generates `samples_per_version` samples for each policy version and then
waits for the next one, so generation and training never overlap. TRL's dataloader (accelerate's dispatcher, which
TRL's asynchronous trainer uses) reads one micro-batch ahead before it trains a step, so the trainer cannot move
unless `samples_ahead` samples (by default one step's: a micro-batch when gradient_accumulation_steps is 1) are
generated before the version they are trained at. TRL measures a sample's staleness when it reads it from the queue,
so in lockstep it reads K (once K versions exist) and the sample is trained one optimizer step later. Otherwise the
worker runs ahead, up to `max_queued_samples` samples in the queue.
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from ..generation.completions import generate_completions
from ..inputs.prompts import tokenize_prompts
from ..support import SamplerProcessing
from .trl_async import RolloutSample


# The reward functions' extra keyword arguments, as GRPOTrainer passes them (the dataset's other columns).
RewardFunction = Callable[..., list[float]]


def group_advantages(rewards: Sequence[float]) -> np.ndarray:
    """MIRROR of TRL 1.16's asynchronous group advantage (`_AsyncRolloutLoop._score_group`, the rollout worker's
    loop): (r - mean) / (std + 1e-8) over the group's scored completions, population std; an unscored completion
    (NaN reward) gets advantage 0. tests/test_async.py runs TRL's method on the same rewards and holds this to it
    (docs/copies.md)."""
    rewards = np.asarray(rewards, dtype=float)
    advantages = np.zeros_like(rewards)
    scored = ~np.isnan(rewards)
    if scored.any():
        advantages[scored] = (rewards[scored] - rewards[scored].mean()) / (rewards[scored].std() + 1e-8)
    return advantages


def summed_rewards(per_function: list[list[float | None]]) -> list[float]:
    """MIRROR of TRL 1.16's reward sum (`_AsyncRolloutLoop._score_group`): the sum over reward functions per
    completion, None as NaN; NaN where every function returned None (such a completion is unscored, not 0)."""
    table = np.array([[math.nan if value is None else value for value in row] for row in per_function], dtype=float)
    total = np.nansum(table, axis=0)
    total[np.all(np.isnan(table), axis=0)] = math.nan
    return total.tolist()


class InProcessWeightTransfer:
    """TRL's `WeightTransferProtocol` for a worker in this process: each sync's parameters are copied to the CPU and
    handed to the worker, which labels them with the version the trainer announces next."""

    def __init__(self, worker: LaggedRolloutWorker):
        self._worker = worker

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._worker.receive_weights({name: tensor.detach().to("cpu", copy=True) for name, tensor in iterator})

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class LaggedRolloutWorker:
    """See the module docstring. `model` is the sampling copy (any causal LM of the policy's architecture, e.g. the
    base model loaded again); `dataset` rows have a `prompt` (plain or conversational) and the columns the reward
    functions read."""

    def __init__(
        self,
        model,
        tokenizer,
        dataset,
        reward_funcs: RewardFunction | list[RewardFunction],
        *,
        num_generations: int,
        max_completion_length: int,
        temperature: float = 1.0,
        lag: int = 0,
        seconds_per_sample: float = 0.0,
        lockstep: bool = False,
        samples_per_version: int | None = None,
        samples_ahead: int | None = None,
        max_queued_samples: int = 256,
        chat_template_kwargs: dict | None = None,
        generation_kwargs: dict | None = None,
        seed: int = 0,
    ):
        if lag < 0 or int(lag) != lag:
            raise ValueError(f"lag must be a whole number of policy versions >= 0, got {lag!r}.")
        if seconds_per_sample < 0:
            raise ValueError(f"seconds_per_sample must be >= 0, got {seconds_per_sample!r}.")
        if lockstep and (not samples_per_version or samples_per_version % num_generations):
            raise ValueError(
                f"lockstep needs samples_per_version, a multiple of num_generations ({num_generations}): "
                "the samples of one optimizer step times weight_sync_steps."
            )
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        self.num_generations = num_generations
        self.max_completion_length = max_completion_length
        self.temperature = temperature
        self.lag = int(lag)
        self.seconds_per_sample = seconds_per_sample
        self.lockstep = lockstep
        self.samples_per_version = samples_per_version
        self.samples_ahead = samples_per_version if samples_ahead is None else samples_ahead
        self.generation_kwargs = dict(generation_kwargs or {})  # extra `generate` arguments, e.g. min_new_tokens
        self.rows = [dict(row) for row in dataset]
        if not self.rows:
            raise ValueError("the rollout worker's dataset has no rows.")
        self.prompt_ids = tokenize_prompts(tokenizer, [row["prompt"] for row in self.rows], chat_template_kwargs)
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=max_queued_samples)
        self.metrics_queue: queue.Queue = queue.Queue()
        self._order_rng = random.Random(seed)
        self._epoch_orders: list[list[int]] = []  # the prompt order of each pass over the rows, drawn from `seed`
        self._start_prompt = 0  # where this run's group 0 sits in that order (a resumed run's saved position)
        self._generator = torch.Generator().manual_seed(seed)
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._pending: dict[str, torch.Tensor] | None = None
        self._model_version = 0
        self._loaded_version = None
        self._produced = 0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_beat = time.time()
        self._next_group = 0
        self.samples_queued = 0  # samples put in `rollout_buffer` (a group generated while stopping is not)

    # ------------------------------------------------------------------ RolloutWorkerProtocol

    @property
    def sampling(self) -> SamplerProcessing:
        """How this worker turns logits into its sampling distribution (its temperature, and the top_k / top_p of
        `generation_kwargs`): the trainer scores pi on that support."""
        return SamplerProcessing(
            temperature=self.temperature,
            top_k=self.generation_kwargs.get("top_k") or None,
            top_p=self.generation_kwargs.get("top_p"),
            min_p=self.generation_kwargs.get("min_p"),
        )

    @property
    def start_prompt(self) -> int:
        """The position in the run's prompt order of this run's group 0."""
        return self._start_prompt

    def resume_at(self, prompt_index: int, model_version: int) -> None:
        """Start at prompt `prompt_index` of the run's prompt order (group 0 of this run is that prompt), as a run
        resumed from a checkpoint whose rollout state says so; lockstep counts its samples from `model_version` on.
        Before `start`."""
        if self._thread is not None:
            raise RuntimeError("resume_at must be called before the worker starts.")
        self._start_prompt = int(prompt_index)
        self._produced = int(model_version) * (self.samples_per_version or 0)

    def weight_transfer(self) -> InProcessWeightTransfer:
        return InProcessWeightTransfer(self)

    def receive_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with self._changed:
            self._pending = weights

    def update_model_version(self, model_version: int) -> None:
        with self._changed:
            if self._pending is not None:
                self._versions[model_version] = self._pending
                self._pending = None
            self._model_version = model_version
            # keep only what a later group can still be sampled from: the versions from K back on, and the newest
            # one before them (the policy K versions back while fewer than K + 1 exist)
            wanted = model_version - self.lag
            older = [v for v in self._versions if v <= wanted]
            for version in sorted(older)[:-1]:
                del self._versions[version]
            self._changed.notify_all()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="lagged-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"the rollout worker failed: {type(self._error).__name__}: {self._error}"
            ) from self._error
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the rollout worker is not running (it was never started, or it stopped).")
        if time.time() - self._last_beat > stale_after_s:
            raise RuntimeError(f"the rollout worker produced nothing for {stale_after_s:.0f} s.")

    # ------------------------------------------------------------------ the loop
    def behaviour_version(self, model_version: int) -> int:
        """The version a group started at `model_version` is sampled from: K before it, or the oldest kept."""
        wanted = model_version - self.lag
        return (
            max(v for v in self._versions if v <= wanted)
            if any(v <= wanted for v in self._versions)
            else min(self._versions)
        )

    def _wait_for_turn(self) -> int | None:
        """Block until a group may be generated; the current model version, or None when stopping."""
        with self._changed:
            while not self._stop.is_set():
                if self._versions:
                    version = self._model_version
                    if not self.lockstep or self._produced < version * self.samples_per_version + self.samples_ahead:
                        return version
                self._changed.wait(timeout=0.5)
        return None

    def _epoch_order(self, epoch: int) -> list[int]:
        """The rows in the order of pass `epoch` over them: one generator from `seed` shuffles each pass in turn, so
        a resumed run finds the same order at the same position."""
        while len(self._epoch_orders) <= epoch:
            order = list(range(len(self.rows)))
            self._order_rng.shuffle(order)
            self._epoch_orders.append(order)
        return self._epoch_orders[epoch]

    def _next_row(self) -> tuple[int, int]:
        """This run's next group id (from 0) and its row: prompt `start + group id` of the run's prompt order."""
        group_id = self._next_group
        self._next_group += 1
        position = self._start_prompt + group_id
        return group_id, self._epoch_order(position // len(self.rows))[position % len(self.rows)]

    def _run(self) -> None:
        try:
            while True:
                version = self._wait_for_turn()
                if version is None:
                    return
                started = time.time()
                with self._changed:
                    behaviour = self.behaviour_version(version)
                    weights = self._versions[behaviour]
                if self._loaded_version != behaviour:
                    self.model.load_state_dict(weights, strict=False)
                    self._loaded_version = behaviour
                samples = self._sample_group(behaviour)
                remaining = self.seconds_per_sample * len(samples) - (time.time() - started)
                if remaining > 0 and self._stop.wait(remaining):
                    return
                with self._changed:
                    self._produced += len(samples)
                for sample in samples:
                    sample.enqueued_at = time.time()
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=0.5)
                            self.samples_queued += 1
                            break
                        except queue.Full:
                            self._last_beat = time.time()  # waiting on the trainer is not a hang
                self.metrics_queue.put(
                    {"rollout/generation_s": time.time() - started, "rollout/behaviour_lag": float(version - behaviour)}
                )
                self._last_beat = time.time()
        except BaseException as error:  # noqa: BLE001 - handed to the trainer through check_health
            self._error = error

    def _sample_group(self, behaviour_version: int) -> list:
        group_id, row_index = self._next_row()
        row = self.rows[row_index]
        prompt_ids = self.prompt_ids[row_index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._generator)))
            completions = generate_completions(
                self.model,
                self.tokenizer,
                [prompt_ids] * self.num_generations,
                max_new_tokens=self.max_completion_length,
                temperature=self.temperature,
                with_logps=True,
                **self.generation_kwargs,
            )
        texts = [self.tokenizer.decode(c["completion_ids"], skip_special_tokens=True) for c in completions]
        prompt = row["prompt"]
        completion_messages = (
            [[{"role": "assistant", "content": text}] for text in texts] if isinstance(prompt, list) else texts
        )
        columns = {key: [value] * len(texts) for key, value in row.items() if key not in ("prompt", "completion")}
        per_function = [
            func(prompts=[prompt] * len(texts), completions=completion_messages, **columns)
            for func in self.reward_funcs
        ]
        rewards = summed_rewards(per_function)
        advantages = group_advantages(rewards)
        samples = []
        for completion, message, reward, advantage in zip(
            completions, completion_messages, rewards, advantages, strict=True
        ):
            ids = completion["completion_ids"]
            samples.append(
                RolloutSample(
                    prompt=prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}],
                    completion=message if isinstance(message, list) else [{"role": "assistant", "content": message}],
                    input_ids=np.asarray(list(prompt_ids) + list(ids), dtype=np.int64),
                    completion_mask=np.asarray([0] * len(prompt_ids) + [1] * len(ids), dtype=np.int64),
                    old_log_probs=np.asarray([0.0] * len(prompt_ids) + list(completion["logps"]), dtype=np.float32),
                    advantage=float(advantage),
                    model_version=behaviour_version,
                    group_id=group_id,
                    metrics={"reward": float(reward)},
                )
            )
        return samples
