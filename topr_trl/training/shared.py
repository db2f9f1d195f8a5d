"""What both trainers share, below them, as plain functions they call: `TOPRTrainer` (`topr_trl.trainer`) and the
asynchronous trainer (`topr_trl.asynchronous`) score pi on mu's support the same way (`mu_processing`,
`forward_on_mus_support`), log TOPR's metrics and check the loss the same way (`log_policy_metrics`,
`check_finite_loss`), and their model cards name the method that trained the model the same way (`trained_method`,
TOPR's own identity in `TOPR_NAME`, `TOPR_PAPER`, `TOPR_TAG_NAMES`)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence

import torch
from datasets import Dataset
from transformers.utils import logging
from trl import GRPOTrainer

from ..loss import POLICY_LOSSES, branch_losses
from ..offline.schema import stored_processing
from ..support.processing import SamplerProcessing
from ..support.scoring import CapturedBackbone, captured_outputs, fused_head_parts, on_mus_support
from .policy_metrics import branch_ratios, metric_sums, policy_metrics, ratio_minima, ratio_quantiles


logger = logging.get_logger(__name__)

TOPR_NAME = "TOPR"
TOPR_TAG_NAMES = ["trl", "grpo", "topr"]
TOPR_PAPER = {
    "title": "Tapered Off-Policy REINFORCE: Stable and efficient reinforcement learning for LLMs",
    "id": "2503.14286",
    "citation": textwrap.dedent("""\
        @article{leroux2025tapered,
            title        = {{Tapered Off-Policy REINFORCE: Stable and efficient reinforcement learning for LLMs}},
            author       = {Nicolas Le Roux and Marc G. Bellemare and Jonathan Lebensold and Arnaud Bergeron and
                            Joshua Greaves and Alex Fr{\\'e}chette and Carolyne Pelletier and Eric Thibodeau-Laufer
                            and S{\\'a}ndor Toth and Sam Work},
            year         = 2025,
            eprint       = {arXiv:2503.14286},
        }"""),
}


# What a trainer's forward is scored with on mu's support: from its outputs (the log-probs first), the causal LM that
# owns the output layer and the backbone's captured last hidden states, pi's log-probs on mu's support (shaped like
# the log-probs) and where they hold.
SupportProjection = Callable[[tuple, torch.nn.Module, CapturedBackbone], tuple[torch.Tensor, torch.Tensor]]


def mu_processing(
    args, temperature: float, engine: str, replayed: Sequence[Dataset] = (), rollout_worker: object | None = None
) -> SamplerProcessing | None:
    """How mu turned logits into its sampling distribution, when it differs from what TRL scores the policy with (the
    whole vocabulary at the trainer's `temperature`): then pi is scored on mu's support; else None. By default the
    config's generation settings (temperature, top_k, top_p, min_p) in `engine`'s filter order (the synchronous
    trainer's own generation, or vLLM: TRL's rollout worker's). Offline, the `replayed` datasets' stored
    `behaviour_sampling` (one processing for them all; rows that do not say take the config's, said once). A
    `rollout_worker` that says how it samples (`sampling`, as the CPU stand-in `LaggedRolloutWorker` does), as it
    says."""
    processing = SamplerProcessing(
        temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p, min_p=args.min_p, engine=engine
    )
    if replayed:
        processing = stored_processing(replayed, processing)
    sampling = getattr(rollout_worker, "sampling", None)
    if isinstance(sampling, SamplerProcessing):
        processing = sampling
    return processing if processing.differs_from(temperature) else None


def warn_history_dependent_sampling(repetition_penalty: float) -> None:
    """Says so when mu's sampling depended on the tokens already seen, which pi's scoring does not replay: a repetition
    penalty rescales the logits of every token in the prompt or the completion so far before temperature and
    truncation, so pi/mu then carries the penalty's effect on top of how far the policy moved."""
    if repetition_penalty != 1.0:
        logger.warning(
            f"repetition_penalty={repetition_penalty} changes mu's sampling distribution by the tokens already "
            "seen, and pi is not scored with it: pi/mu carries the penalty's effect as well as the policy's "
            "movement (negatives' weights are off by it). Leave repetition_penalty at 1.0 for an exact ratio."
        )


def forward_on_mus_support(model, forward: Callable[[], tuple], project: SupportProjection) -> tuple:
    """`forward()`, TRL's forward through its fused head (its outputs begin with the log-probs), with the log-probs
    worth pi's on mu's support where `project` scores them, from the backbone's last hidden states of that same forward
    (captured by a hook: TRL's fused head never holds a row's logits whole, and the backbone runs once). Only the
    values change: the gradient stays TRL's (`on_mus_support`)."""
    backbone, owner = fused_head_parts(model)
    with captured_outputs(backbone) as captured:
        outputs = forward()
    log_probs = outputs[0]
    processed, scored = project(outputs, owner, captured)
    return (on_mus_support(log_probs, processed.to(log_probs.device), scored.to(log_probs.device)), *outputs[1:])


def log_policy_metrics(
    accelerator,
    logged: dict[str, list[float]],
    terms,
    signal,
    mask,
    entropies,
    policy_per_token,
    aggregate_kwargs,
    loss,
    *,
    negative_weight: float,
    reward_signal: bool,
    ratio_read=None,
) -> tuple[int, str]:
    """TOPR's metrics (`topr_trl.training.policy_metrics`) appended to `logged` (a trainer's `_metrics[mode]`), reduced
    over processes with two collectives, so every rank logs every key; returns what `check_finite_loss` needs (the
    number of processes whose loss is not finite, and the ratio ranges), which every rank agrees on. `ratio_read`
    (B,) leaves out of the ratio statistics the sequences whose pi was not scored on mu's support (None: every
    sequence's pi/mu is reported)."""
    sums = metric_sums(terms, signal, mask, entropies, loss, negative_weight, ratio_read)
    reduced = accelerator.reduce(torch.stack(list(sums.values())), reduction="sum").tolist()
    totals = dict(zip(sums, reduced, strict=True))
    minima = ratio_minima(terms, signal, mask, ratio_read)
    losses = torch.stack(branch_losses(policy_per_token, terms.is_positive, mask, **aggregate_kwargs)).float()
    # one collective for both: each process's row is its minima then its branch losses
    gathered = accelerator.gather(torch.cat([minima, losses]).unsqueeze(0))
    all_minima, all_losses = gathered.split([minima.numel(), losses.numel()], dim=1)
    # a process that trained no trajectory (an empty packed row) has NaN branch losses and joins the mean as none
    values = policy_metrics(
        totals, all_minima.amin(dim=0).tolist(), all_losses.nanmean(dim=0).tolist(), reward_signal=reward_signal
    )
    ratios = branch_ratios(terms, signal, mask, ratio_read)
    if accelerator.num_processes > 1:  # every process's ratios, NaN-padded to one length
        ratios = accelerator.pad_across_processes(ratios, dim=1, pad_index=float("nan"))
        ratios = accelerator.gather(ratios.unsqueeze(0)).transpose(0, 1).flatten(1)
    values.update(ratio_quantiles(ratios))
    for name, value in values.items():
        # a branch with nothing to report (no sample, or no ratio read) is left out of the step's log, not logged as
        # NaN, which GRPOTrainer's `log` turns into a null when the whole window has none
        if not (name.startswith("topr/") and math.isnan(value)):
            logged[name].append(value)
    ratio_ranges = (
        f"positives [{values['topr/ratio_positive/min']}, {values['topr/ratio_positive/max']}], "
        f"negatives [{values['topr/ratio_negative/min']}, {values['topr/ratio_negative/max']}]"
    )
    return int(totals["nonfinite_loss"]), ratio_ranges


def check_finite_loss(processes: int, ratio_ranges: str, *, stop: bool, step: int) -> None:
    """Nothing when every process's loss is finite (`processes` 0). Otherwise GRPOTrainer trains on a non-finite loss
    (logged as NaN); TOPRTrainer does too unless `stop` (topr_check_finite), warning once (the ratio ranges of every
    step are logged as topr/ratio_*)."""
    if not processes:
        return
    if stop:
        raise FloatingPointError(
            f"TOPR loss is not finite on {processes} process(es) at step {step}. Ratio ranges: {ratio_ranges}. Check "
            "the reward functions and, in bf16/fp16, the model's logits; rerun with bf16=False to rule out overflow."
        )
    logger.warning_once(
        "TOPR loss is not finite on some steps (logged as NaN; the ratio ranges are logged as topr/ratio_*). "
        "Check the reward functions and, in bf16/fp16, the model's logits. Training goes on, as in GRPOTrainer "
        "(topr_check_finite=True stops at the first such step); this is said once."
    )


def trained_method(loss_type: str) -> tuple[str, dict, list[str]]:
    """What the model card and the model's tags say trained the model: TOPR (and its paper) only for
    loss_type='topr'; another loss of the registry by its name, with no paper claimed; TRL's loss types as GRPO, which
    is what computed them."""
    if loss_type == "topr":
        return TOPR_NAME, TOPR_PAPER, TOPR_TAG_NAMES
    if loss_type in POLICY_LOSSES:
        return f"the `{loss_type}` policy loss of topr-trl's TOPRTrainer", {}, ["trl", "grpo", "topr-trl", loss_type]
    return GRPOTrainer._name, GRPOTrainer._paper, GRPOTrainer._tag_names
