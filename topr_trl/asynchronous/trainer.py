"""`AsyncTOPRTrainer`: TRL's asynchronous GRPO trainer with TOPR's loss, keeping every stale sample.

Generation and training are decoupled by TRL 1.16's `trl.experimental.async_grpo.AsyncGRPOTrainer`: a rollout worker
fills a queue with scored samples (prompt + completion ids, mu's per-token log-probs, the reward, the policy version
that generated them) while the trainer packs, trains and syncs weights. What this class changes:

- the loss: TOPR's (Eq. 7) on each packed micro-batch (`topr_trl.loss.packed_topr_loss`): the sequence ratio is each
  completion's sum of token log-ratios pi/mu over its packed tokens, truncated to [a+, b+] or [a-, b-] by the sign of
  its signal, a stop-gradient weight; each completion's loss is divided by its length. No KL, no clipping;
- the staleness cap: `AsyncTOPRConfig.max_staleness` is inf by default, so TRL's queue drops nothing;
- the signal: the worker's group advantage, or the paper's R - c from each sample's reward (`ConsumedSamples`);
- staleness is recorded for every sample and logged (TRL's `sample/staleness_mean`/`_max`, this class's histogram
  `sample/staleness_<bin>_total`).

Everything else (the worker, packing, batching, weight sync, checkpointing, metrics) is TRL's. `CPUSupport` lets it
run without CUDA.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import time
from collections import Counter
from pathlib import Path
from typing import Protocol, cast

import torch
from accelerate import PartialState
from accelerate.utils import broadcast, broadcast_object_list
from datasets import Dataset
from transformers import PreTrainedConfig
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl.chat_template_utils import add_response_schema, qwen3_template

from ..generation.vllm_server import BACKEND
from ..generation.vllm_server.client import GlooWeightTransfer, server_weight_backend
from ..inputs.sources import needs_resolving, resolve_model_source
from ..loss import packed_topr_loss, reads_the_ratio, unpack_segments
from ..runtime.noise import quiet_duplicate_callback_notice, quiet_trl_deprecations, tell_deepspeed_the_cpu
from ..support.scoring import chunked_processed_log_probs
from ..training.checkpoint_weights import loaded_through_renaming
from ..training.policy_metrics import staleness_bin_metrics, staleness_bin_sums
from ..training.shared import (
    TOPR_PAPER,
    check_finite_loss,
    forward_on_mus_support,
    log_policy_metrics,
    mu_processing,
    trained_method,
    warn_history_dependent_sampling,
)
from .config import AsyncTOPRConfig
from .cpu import CPUSupport, refuse_without_sdpa
from .lagged_worker import LaggedRolloutWorker
from .resume import RolloutLedger, describe_resume, read_rollout_state, write_rollout_state
from .trl_async import AsyncGRPOTrainer, AsyncRolloutWorker


logger = logging.get_logger(__name__)

# TRL's pipeline depth when its own default max_staleness (4) sizes max_inflight_tasks: optimizer steps of samples
# the worker may have in flight. With no cap, the same depth keeps the same throughput and memory as TRL's default.
DEFAULT_PIPELINE_DEPTH = 4
# Histogram bins of staleness (policy versions), logged as sample/staleness_<bin>_total. A negative staleness (a
# sample stamped with a version the trainer has not reached, e.g. a worker that outlived a restart) gets its own bin.
STALENESS_BINS: tuple[tuple[float, float, str], ...] = (
    (-math.inf, -1, "negative"),
    (0, 0, "0"),
    (1, 1, "1"),
    (2, 3, "2to3"),
    (4, 7, "4to7"),
    (8, 15, "8to15"),
    (16, 31, "16to31"),
    (32, 63, "32to63"),
    (64, math.inf, "64plus"),
)
STALENESS_BIN_NAMES = tuple(name for _, _, name in STALENESS_BINS)
# Where `ConsumedSamples` stamps the policy version that generated each sample in the sample's own `metrics` (TRL's
# queue dataset passes the metrics on, not the version); `TrajectoryVersions` takes it out again before TRL's
# collator averages the metrics into the logs.
MODEL_VERSION_KEY = "topr_trl/model_version"


def staleness_bin_indices(staleness: torch.Tensor) -> torch.Tensor:
    """The index in STALENESS_BINS of every entry of an integer tensor of staleness (the bins are contiguous, so a
    value's bin is the number of lower edges, past the first, at or below it)."""
    lower_edges = torch.tensor(
        [low for low, _, _ in STALENESS_BINS[1:]], dtype=staleness.dtype, device=staleness.device
    )
    return torch.bucketize(staleness, lower_edges, right=True)


def staleness_bin_index(staleness: int) -> int:
    return int(staleness_bin_indices(torch.tensor(staleness)))


def staleness_bin(staleness: int) -> str:
    return STALENESS_BIN_NAMES[staleness_bin_index(staleness)]


class ConsumedSamples:
    """The rollout queue as the trainer's `RolloutQueueDataset` reads it (`get`, `qsize`): each sample's staleness
    (trainer version minus the version that generated it) is counted in `staleness_counts`, logged as a histogram
    bin, the sample's version is stamped on it (`MODEL_VERSION_KEY`, for the loss's ratio metrics by staleness), it
    is entered in the `ledger` (dropped or not, by TRL's rule: staleness above `max_staleness`), and with
    `reward_baseline` set its `advantage` becomes the paper's signal R - c (0 for an unscored sample)."""

    def __init__(
        self,
        source,
        model_version_fn,
        metrics,
        reward_baseline: float | None = None,
        ledger: RolloutLedger | None = None,
        max_staleness: float = math.inf,
    ):
        self.source = source
        self.model_version_fn = model_version_fn
        self.metrics = metrics
        self.reward_baseline = reward_baseline
        self.ledger = ledger if ledger is not None else RolloutLedger()
        self.max_staleness = max_staleness
        self.staleness_counts: Counter[int] = Counter()

    def get(self, block: bool = True, timeout: float | None = None):
        sample = self.source.get(block, timeout)
        staleness = self.model_version_fn() - sample.model_version
        self.staleness_counts[staleness] += 1
        self.ledger.record_read(sample.group_id, dropped=staleness > self.max_staleness)
        self.metrics[f"sample/staleness_{staleness_bin(staleness)}_total"].append(1.0)
        changes: dict[str, object] = {"metrics": {**sample.metrics, MODEL_VERSION_KEY: sample.model_version}}
        if self.reward_baseline is not None:
            reward = sample.metrics.get("reward", math.nan)
            changes["advantage"] = 0.0 if math.isnan(reward) else reward - self.reward_baseline
        return dataclasses.replace(sample, **changes)

    def qsize(self) -> int:
        return self.source.qsize()


class TrajectoryVersions:
    """The collate function of TRL's rollout dataloader with each packed row's policy versions added to the batch:
    `trajectory_model_version` ((rows, samples), -1 padding) holds, for sample i of row r, the version that generated
    it (stamped by `ConsumedSamples`, taken out of its metrics). TRL's `TreeRow.pack` numbers a row's segments by its
    samples' order, so the loss reads segment i's version at index i of its rank's row: the version travels with the
    data it describes, and the staleness is taken when the sample trains (the dataloader reads a micro-batch ahead,
    so the staleness TRL logs when a sample is read can be one version short of the one it trains at)."""

    def __init__(self, collate, ledger: RolloutLedger):
        self.collate = collate
        self.ledger = ledger

    def __call__(self, examples):
        (rows,) = examples  # one micro-batch: a row per process (TRL's planner)
        self.ledger.record_collated([sample["group_id"] for row in rows for sample in row.samples])
        versions = [[int(sample["metrics"].pop(MODEL_VERSION_KEY, -1)) for sample in row.samples] for row in rows]
        batch = self.collate(examples)
        width = max((len(row) for row in versions), default=0)
        batch["trajectory_model_version"] = torch.tensor(
            [row + [-1] * (width - len(row)) for row in versions], dtype=torch.long
        ).reshape(len(versions), width)
        return batch


class TransferOnTheMainProcess:
    """What a process other than the main one passes as TRL's `weight_transfer` while the main process holds a gloo
    transfer: TRL keeps the main process's alone (it sets None on the others), but every process decides from the one
    it is passed whether to probe the server for adapter-only sync (`AsyncGRPOTrainer.__init__`, a PEFT model with no
    transfer: `broadcast_object_list` from the main process), and a process that probes alone waits there for the
    main process's next collective."""


def gloo_weight_transfer(args: AsyncTOPRConfig):
    """The weight transfer for TRL's rollout worker against `args.vllm_server_base_url`: this package's gloo path
    (`topr_trl.generation.vllm_server.GlooWeightTransfer`) when the server runs it, as `topr-trl vllm-serve` does
    without a GPU; otherwise None, and TRL builds its own (NCCL). Asked on the main process only, which alone talks to
    the server; with several processes its answer (or its error) is broadcast, and the others pass
    `TransferOnTheMainProcess` where it found one, so that every process takes the same branch of TRL's constructor."""
    state = PartialState()
    transfer = None
    if state.is_main_process:
        try:
            transfer = _gloo_weight_transfer_of_server(args)
        except Exception as error:  # raised on every process below: on the main one alone, the others would wait
            transfer = error
    if state.num_processes > 1:
        (found,) = broadcast_object_list(
            [transfer if isinstance(transfer, Exception) else transfer is not None], from_process=0
        )
        if isinstance(found, Exception):
            raise found
        if not state.is_main_process:
            transfer = TransferOnTheMainProcess() if found else None
    if isinstance(transfer, Exception):
        raise transfer
    return transfer


def _gloo_weight_transfer_of_server(args: AsyncTOPRConfig):
    url = args.vllm_server_base_url.rstrip("/")
    try:  # one look, no wait: a server not up yet, or not there, is TRL's to wait for and report
        backend = server_weight_backend(url, timeout_s=0)
    except (ConnectionError, OSError):
        return None
    return GlooWeightTransfer(url, sync_timeout_s=float(args.weight_sync_timeout)) if backend == BACKEND else None


def with_response_template(tokenizer):
    """The tokenizer TRL's rollout worker needs: one that parses each generated response. TRL sets the template of
    the chat formats it knows (`add_response_schema`); a ChatML template it does not know by name (SmolLM2's, the
    built-in tasks') ends responses as Qwen's does, so Qwen's template parses them. Any other raises TRL's error."""
    if getattr(tokenizer, "response_template", None) is not None:
        return tokenizer
    try:
        return add_response_schema(tokenizer)
    except ValueError:
        if "<|im_start|>assistant" not in (tokenizer.chat_template or ""):
            raise
    tokenizer.response_template = qwen3_template
    return tokenizer


# What TRL's FLOPs estimate reads that some configs name otherwise or lack: multi-head attention has as many key/value
# heads as heads (GPTNeoX, OPT, GPT-2 declare no `num_key_value_heads`); the MLP's width is `ffn_dim` (OPT) or
# `n_inner` (GPT-2, None meaning 4 x hidden).
_FLOPS_FIELDS = {
    "num_key_value_heads": lambda config: config.num_attention_heads,
    "intermediate_size": lambda config: (
        getattr(config, "ffn_dim", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    ),
}


@contextlib.contextmanager
def flops_fields(config):
    """`config` with the fields TRL's FLOPs estimate reads (`_FLOPS_FIELDS`), for the block only: those it lacks
    are set to what its architecture means by them, then removed, so that nothing reaches a saved config.json.
    Before, the asynchronous trainer's first step on a GPTNeoX or an OPT raised AttributeError there."""
    added = []
    for name, value_of in _FLOPS_FIELDS.items():
        if getattr(config, name, None) is None:
            setattr(config, name, value_of(config))
            added.append(name)
    try:
        yield config
    finally:
        for name in added:
            delattr(config, name)


class RepositionableWorker(Protocol):
    """A rollout worker with `resume_at` (`LaggedRolloutWorker`): it says where this run's group 0 sits."""

    @property
    def start_prompt(self) -> int: ...

    def resume_at(self, prompt_index: int, model_version: int) -> None: ...


def derived_config(args: AsyncTOPRConfig, rollout_worker) -> AsyncTOPRConfig:
    """The config the trainer runs with: the user's, or a shallow copy of it (not validated again: the user's already
    was) where TRL would size a setting from something absent here; the user's own config is left as given.

    - `max_inflight_tasks` unset with no staleness cap: TRL sizes it from max_staleness (inf here); TRL's default
      pipeline depth is kept instead.
    - `token_budget` unset with the CPU stand-in worker: TRL sizes it from the vLLM server's max_model_len, waiting
      for a server the stand-in does not have (240 s, then a time-out); per_device_train_batch_size samples are
      packed per row instead."""
    derived = {}
    if args.keeps_every_sample and args.max_inflight_tasks < 0:
        derived["max_inflight_tasks"] = (
            DEFAULT_PIPELINE_DEPTH
            * args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * PartialState().num_processes
        )
    if args.token_budget is None and isinstance(rollout_worker, LaggedRolloutWorker):
        derived["token_budget"] = 0
    if not derived:
        return args
    run_config = copy.copy(args)
    for name, value in derived.items():
        setattr(run_config, name, value)
    return run_config


class AsyncTOPRTrainer(CPUSupport, AsyncGRPOTrainer):
    """
    Asynchronous TOPR: [`trl.experimental.async_grpo.AsyncGRPOTrainer`] with TOPR's loss and no stale sample thrown
    away (see the module docstring). Same constructor as TRL's class; `args` is an [`AsyncTOPRConfig`].

    On a CPU (no CUDA) it runs with a rollout worker of your own (TRL's `RolloutWorkerProtocol`), such as
    [`~topr_trl.asynchronous.LaggedRolloutWorker`] with its `weight_transfer()`: TRL's default worker needs a vLLM
    server and its weight sync NCCL.
    """

    _tag_names = ["trl", "async-grpo", "topr"]
    _name = "AsyncTOPR"
    _paper = TOPR_PAPER
    args: AsyncTOPRConfig

    def __init__(self, model: str, reward_funcs=None, args: AsyncTOPRConfig | None = None, *pargs, **kwargs):
        if args is None:
            args = AsyncTOPRConfig(f"{str(model).rstrip('/').split('/')[-1]}-AsyncTOPR")
        if not isinstance(args, AsyncTOPRConfig):
            raise TypeError(
                f"AsyncTOPRTrainer takes an AsyncTOPRConfig, got {type(args).__name__}: swap "
                "AsyncGRPOConfig for AsyncTOPRConfig (same fields, TOPR's loss, no staleness cap)."
            )
        if needs_resolving(model):  # a .gguf file, or a packaged Hub id where the Hub cannot be reached
            model = resolve_model_source(model)
        if args.use_cpu or not torch.cuda.is_available():
            refuse_without_sdpa(model)
        if args.loss_type != "topr":  # the card and the model's tags name the loss that trains, never TOPR for another
            self._name, self._paper, self._tag_names = trained_method(args.loss_type)
        if kwargs.get("weight_transfer") is None and kwargs.get("rollout_worker") is None:
            kwargs["weight_transfer"] = gloo_weight_transfer(args)
        args = derived_config(args, kwargs.get("rollout_worker"))
        tell_deepspeed_the_cpu()
        with quiet_trl_deprecations(), quiet_duplicate_callback_notice():
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self._loss_spec = args.policy_loss_spec
        # TRL's worker samples on vLLM; the CPU stand-in worker says how it samples
        self._sampler_processing = mu_processing(
            args, args.temperature, "vllm", rollout_worker=kwargs.get("rollout_worker")
        )
        # the loss is always one of TOPR's here: TRL's worker samples with the penalty
        warn_history_dependent_sampling(args.repetition_penalty)
        self.rollout_ledger = RolloutLedger()

    @property
    def staleness_counts(self) -> Counter[int]:
        """How many samples the trainer received at each staleness (policy versions), over the whole run (main
        process; empty elsewhere)."""
        return self.rollout_queue.staleness_counts if isinstance(self.rollout_queue, ConsumedSamples) else Counter()

    def get_train_dataloader(self):
        """TRL's rollout dataloader, on the main process (the one that takes samples from the queue and collates them;
        TRL dispatches the batches) built over the queue wrapped by `ConsumedSamples`, its collate function wrapped
        by `TrajectoryVersions`: each sample's staleness is read as the trainer takes it, and the ledger learns which
        samples each step trains."""
        if not self.accelerator.is_main_process:
            return super().get_train_dataloader()
        # SEAM: TRL's queue and collate function wrapped where its dataloader is built; see docs/copies.md
        if not isinstance(self.rollout_queue, ConsumedSamples):  # once: a second train() builds on the same queue
            baseline = self.args.topr_baseline if self.args.topr_signal == "reward" else None
            assert not isinstance(baseline, str)  # a number: AsyncTOPRConfig refuses a mode
            # TRL types its attribute as the worker's queue; its RolloutQueueDataset reads only `get` and `qsize`
            self.rollout_queue = ConsumedSamples(  # type: ignore[assignment]
                self.rollout_queue,
                lambda: self.model_version,
                self._metrics["train"],
                reward_baseline=baseline,
                ledger=self.rollout_ledger,
                max_staleness=self.args.max_staleness,
            )
        loader = super().get_train_dataloader()
        built = getattr(loader, "base_dataloader", loader)  # accelerate's adapter holds the DataLoader TRL built
        built.collate_fn = TrajectoryVersions(built.collate_fn, self.rollout_ledger)
        return loader

    # ------------------------------------------------------------------ checkpoints and resume
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not loaded_through_renaming(self, resume_from_checkpoint, model):  # see topr_trl.training.checkpoint_weights
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        if not loaded_through_renaming(self, self.state.best_model_checkpoint):
            super()._load_best_model()

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, with `rollout_state.json` written from what the optimizer steps trained
        (`topr_trl.asynchronous.resume`): TRL's position counts the micro-batch read ahead as trained."""
        super()._save_checkpoint(model, trial)
        start = self.rollout_ledger.start_prompt if self.accelerator.is_main_process else None
        if start is None:
            return
        checkpoint = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        samples_per_group = getattr(self.rollout_worker, "num_generations", None) or self.args.num_generations
        position = self.rollout_ledger.resume_position(samples_per_group)
        write_rollout_state(
            checkpoint, start + position.group, self.model_version, position, queued=self.rollout_queue.qsize()
        )

    def _inner_training_loop(self, *args, **kwargs):
        """TRL's loop; a fresh ledger for each `train()`, and on resume from a checkpoint with a rollout state, a
        worker with `resume_at` repositioned (TRL repositions its own) and one line saying what the stop cost."""
        checkpoint = kwargs.get("resume_from_checkpoint")
        state = read_rollout_state(checkpoint) if checkpoint is not None else None
        if state is not None and self.accelerator.is_main_process:
            if hasattr(self.rollout_worker, "resume_at"):
                self.rollout_worker.resume_at(state["prompt_index"], state.get("model_version", 0))
                self.model_version = state.get("model_version", 0)
                self.rollout_worker.update_model_version(self.model_version)
                self._groups_before_resume = state["prompt_index"]
            logger.warning(describe_resume(checkpoint, state))
        self.rollout_ledger.reset(self._start_prompt(state))
        return super()._inner_training_loop(*args, **kwargs)

    def _start_prompt(self, state: dict | None) -> int | None:
        """The prompt this run's group 0 is: a worker with `resume_at` says so; TRL's worker starts at the checkpoint's
        rollout state for a `datasets.Dataset` (its own `_inner_training_loop`), at 0 otherwise; None for a worker
        that cannot be repositioned."""
        if hasattr(self.rollout_worker, "resume_at"):
            return cast(RepositionableWorker, self.rollout_worker).start_prompt
        if isinstance(self.rollout_worker, AsyncRolloutWorker):
            return state["prompt_index"] if state is not None and isinstance(self.train_dataset, Dataset) else 0
        return None

    def _scored_packed_forward(self, model, inputs):
        """`_packed_forward`, with pi scored on the support the worker sampled from
        (`forward_on_mus_support`) when its sampling truncated, for the tokens whose weight reads
        pi/mu (`reads_the_ratio`; every sample here is off-policy): the backbone's hidden states of the same forward,
        projected again for those tokens."""

        def packed_tokens(outputs, owner, captured):
            """pi's log-probs on mu's support of the trained tokens whose weight reads pi/mu, and where they are."""
            log_probs, _, selected, _ = outputs
            scored = reads_the_ratio(inputs["advantages"][selected], self._loss_spec).to(log_probs.device)
            # the packed row's hidden state at position t predicts its label `shift_labels` at t (TRL's packed forward)
            hidden = torch.cat([state.reshape(-1, state.size(-1)) for state in captured.hidden])
            labels = inputs["shift_labels"][inputs["attention_mask"].bool()].to(hidden.device)
            rows = inputs["token_index"][selected].to(hidden.device)[scored.to(hidden.device)]
            processed = torch.zeros(log_probs.shape, dtype=torch.float32, device=log_probs.device)
            processed[scored] = chunked_processed_log_probs(
                owner, hidden[rows], labels[rows], self._sampler_processing, captured.head_dtype()
            ).to(log_probs.device)
            return processed, scored

        forward = functools.partial(self._packed_forward, model, inputs)
        if self._sampler_processing is None:
            return forward()
        return forward_on_mus_support(model, forward, packed_tokens)

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TOPR's loss on one packed micro-batch of this rank, scaled as TRL scales its own: DDP averages the
        gradients of the ranks and the micro-batches of a step are summed, so the rank's share is divided by the
        micro-batch's completions (or tokens) per rank and by the accumulation steps."""
        if self.accelerator.is_main_process:
            self.rollout_ledger.record_trained_micro_batch()
        log_probs, entropy, selected, aux_loss = self._scored_packed_forward(model, inputs)
        behaviour_logps = inputs["old_log_probs"][selected]
        token_signal = inputs["advantages"][selected]
        segment_id = inputs["segment_id"][selected]
        world_size = self.accelerator.num_processes
        aggregate_kwargs = {"aggregation": self.args.topr_loss_aggregation}
        if aggregate_kwargs["aggregation"] == "global-token-mean":
            aggregate_kwargs["num_tokens"] = (inputs["global_n_tokens"][0] / world_size).clamp(min=1.0)
        loss, terms, mask = packed_topr_loss(
            log_probs, behaviour_logps, token_signal, segment_id, self._loss_spec, **aggregate_kwargs
        )
        if segment_id.numel() == 0:
            # a row with nothing to train: a zero that still joins the gradient all-reduce, and the metrics'
            # collectives below, which every other rank makes (returning here would leave them waiting)
            loss = log_probs.sum() * 0.0
        elif aggregate_kwargs["aggregation"] == "seq-mean-token-mean":
            # the mean over this rank's completions, as a share of the micro-batch's mean over all completions
            completions = inputs["global_n_forward_tokens"][0] / inputs["mean_seq_len"][0]
            loss = loss * mask.size(0) / (completions / world_size).clamp(min=1.0)
        loss = loss / self.current_gradient_accumulation_steps
        if aux_loss is not None:  # TRL's: the router's load-balancing loss, scaled for accumulation like the loss
            loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps
        with torch.no_grad():
            entropies, _ = unpack_segments(entropy.detach(), segment_id)
            signal, _ = unpack_segments(token_signal.to(log_probs.dtype), segment_id)
            # pi/mu of a sample not scored on a truncated mu's support would carry the bias: it is not reported
            read = reads_the_ratio(signal[:, :1], self._loss_spec) if self._sampler_processing is not None else None
            nonfinite, ratio_ranges = log_policy_metrics(
                self.accelerator,
                self._metrics["train"],
                terms,
                signal[:, :1],
                mask,
                entropies,
                terms.per_token_loss,
                aggregate_kwargs,
                loss,
                negative_weight=self._loss_spec.negative_weight,
                reward_signal=self.args.topr_signal == "reward",
                ratio_read=read,
            )
            self._log_staleness_metrics(terms, signal[:, :1], mask, inputs.get("trajectory_model_version"), read)
        check_finite_loss(nonfinite, ratio_ranges, stop=self.args.topr_check_finite, step=self.state.global_step)
        self._account_step(inputs)
        return loss

    def _log_staleness_metrics(self, terms, signal, mask, versions, read=None) -> None:
        """pi/mu by the staleness of the samples at this step
        (`topr_trl.training.policy_metrics.staleness_bin_metrics`): the main process's policy version (the one that
        counts syncs) broadcast, and one reduction; every rank joins both, since the batch holds
        `trajectory_model_version` on every rank or on none."""
        if versions is None:
            return
        versions = versions.reshape(-1)[: mask.size(0)]  # this rank's row: one version per segment, in segment order
        current = torch.tensor([self.model_version], dtype=versions.dtype, device=versions.device)
        if self.accelerator.num_processes > 1:
            current = broadcast(current, from_process=0)
        bins = torch.where(versions >= 0, staleness_bin_indices(current - versions), -1)
        sums = staleness_bin_sums(terms, signal, mask, bins, len(STALENESS_BINS), self._loss_spec.negative_weight, read)
        totals = self.accelerator.reduce(sums, reduction="sum")
        for name, value in staleness_bin_metrics(totals.cpu(), STALENESS_BIN_NAMES).items():
            self._metrics["train"][name].append(value)

    # ------------------------------------------------------------------ MIRROR of TRL 1.16.0
    # `AsyncGRPOTrainer.compute_loss` is one method: the packed forward, its PPO loss and metrics, and the step's
    # accounting. The forward and the accounting are copied here from it, unchanged, so that the loss between them
    # can be TOPR's; tests/test_async.py holds this copy to TRL's method (same loss and gradient for PPO clipping).
    def _packed_forward(self, model, inputs):
        """The packed forward of `AsyncGRPOTrainer.compute_loss`: per-token log-probs and entropies of the trained
        tokens of this rank's row (inter-rank padding stripped), the mask selecting their loss terms, and the MoE
        router's auxiliary loss (None unless enabled)."""
        mask_bool = inputs["attention_mask"].bool()
        selected = inputs["token_index"] >= 0
        input_ids = inputs["input_ids"][mask_bool].unsqueeze(0)
        position_ids = inputs["position_ids"][mask_bool].unsqueeze(0)
        shift_labels = inputs["shift_labels"][mask_bool].unsqueeze(0)
        token_index = inputs["token_index"][selected]
        tree_kwargs = {
            key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
        }
        tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
        forward_start = time.time()
        router_kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
        outputs = model(
            input_ids=input_ids,
            position_ids=position_ids,
            shift_labels=shift_labels,
            fused_lm_head=True,
            **router_kwargs,
            **tree_kwargs,
        )
        self._last_forward_time_s = time.time() - forward_start
        aux_loss = outputs.aux_loss if self.aux_loss_enabled else None
        return outputs.log_probs.flatten()[token_index], outputs.entropy.flatten()[token_index], selected, aux_loss

    def _account_step(self, inputs) -> None:
        """The per-step accounting at the end of `AsyncGRPOTrainer.compute_loss` (flushed by its
        `_log_step_metrics`)."""
        n_forward_tokens = float(inputs["global_n_forward_tokens"][0])
        mean_seq_len = float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += n_forward_tokens
        self._step_trained_tokens += float(inputs["global_n_tokens"][0])
        self._step_seq_len_weighted += mean_seq_len * n_forward_tokens
        self._step_samples += n_forward_tokens / mean_seq_len
        self._step_forward_s += self._last_forward_time_s

    def _log_step_metrics(self) -> None:
        """TRL's step metrics, its FLOPs estimate included (`trl.trainer.utils.compute_flops_per_token`), on every
        architecture: see `flops_fields`."""
        assert self.model is not None
        with flops_fields(cast(PreTrainedConfig, self.model.config).get_text_config()):
            super()._log_step_metrics()
