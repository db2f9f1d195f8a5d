"""Where a stopped asynchronous run resumes: which prompt groups a checkpoint has trained, exactly.

TRL 1.16's `AsyncGRPOTrainer` saves `rollout_state.json` with each checkpoint: the prompt the rollout worker restarts
from, the first group id missing from `_trained_groups`. That set is filled when a micro-batch is *collated*, and the
dataloader (accelerate's dispatcher) collates one micro-batch ahead of the one it trains, so a checkpoint counts the
read-ahead groups as trained and a resumed run never trains them; and a group the staleness cap dropped is never in
the set, so the position stops there for the rest of the run and everything after it is trained again (TRL issue
#7274). `RolloutLedger` counts instead what each optimizer step trained (a micro-batch is trained when the loss takes
it, in the order it was collated) and what the cap dropped, per group; `resume_position` is the first group not
wholly trained or dropped. The samples generated and not yet trained at a checkpoint (read ahead, queued, or in the
worker) are not saved: a resumed run generates their prompts again, from the resumed policy, and says how many.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path


ROLLOUT_STATE = "rollout_state.json"  # TRL's file name: its own resume reads `prompt_index` and `model_version`


@dataclass(frozen=True)
class ResumePosition:
    """`group`: the first of this run's groups not wholly trained (or dropped by the staleness cap); the samples
    generated in this run and not trained, which a resumed run generates again (`left_behind`); and the trained
    samples of groups from `group` on, which it trains again (`trained_again`: a group split across the last step)."""

    group: int
    left_behind: int
    trained_again: int


class RolloutLedger:
    """Per group id (this run's numbering, from 0): samples read from the queue, dropped there by the staleness
    cap, collated into micro-batches, and trained. Kept on the main process, which alone reads and collates."""

    def __init__(self):
        self.reset()

    def reset(self, start_prompt: int | None = 0) -> None:
        """Empty, for a new `train()` (whose worker numbers its groups from 0 again), whose group 0 is prompt
        `start_prompt` of the dataset (None: a worker that cannot be repositioned)."""
        self.start_prompt = start_prompt
        self.read = 0
        self.dropped: Counter[int] = Counter()
        self.trained: Counter[int] = Counter()
        self._collated: deque[list[int]] = deque()  # the group id of each sample of each micro-batch not yet trained

    def record_read(self, group_id: int, dropped: bool) -> None:
        self.read += 1
        if dropped:
            self.dropped[group_id] += 1

    def record_collated(self, group_ids: list[int]) -> None:
        self._collated.append(list(group_ids))

    def record_trained_micro_batch(self) -> None:
        """The loss took the oldest collated micro-batch (the dataloader yields them in the order it collates)."""
        if self._collated:
            self.trained.update(self._collated.popleft())

    def resume_position(self, samples_per_group: int) -> ResumePosition:
        group = 0
        while self.trained[group] + self.dropped[group] >= samples_per_group:
            group += 1
        trained = sum(self.trained.values())
        trained_again = sum(count for g, count in self.trained.items() if g >= group)
        return ResumePosition(group, self.read - trained - sum(self.dropped.values()), trained_again)


def write_rollout_state(
    checkpoint: str | Path, prompt_index: int, model_version: int, position: ResumePosition, queued: int
) -> dict:
    """`rollout_state.json` in `checkpoint`: TRL's two fields (`prompt_index`, the prompt this checkpoint's resumed
    run starts at; `model_version`) and this package's account of what that leaves out (`left_behind` adds the
    samples still queued)."""
    state = {
        "prompt_index": int(prompt_index),
        "model_version": int(model_version),
        "samples_left_behind": position.left_behind + int(queued),
        "samples_trained_again": position.trained_again,
    }
    (Path(checkpoint) / ROLLOUT_STATE).write_text(json.dumps(state))
    return state


def read_rollout_state(checkpoint: str | Path) -> dict | None:
    path = Path(checkpoint) / ROLLOUT_STATE
    return json.loads(path.read_text()) if path.is_file() else None


def describe_resume(checkpoint: str | Path, state: dict) -> str:
    """The one line a resumed run says: where the rollout restarts and what the stop cost."""
    line = f"resuming from {checkpoint}: the rollout restarts at prompt {state['prompt_index']}"
    left, again = state.get("samples_left_behind"), state.get("samples_trained_again")
    if left is not None:
        line += (
            f"; {left} samples generated before the stop and not trained are not kept (their prompts are "
            "generated again from the resumed policy)"
        )
    if again:
        line += f"; {again} samples of a group split across the checkpoint are trained again"
    return line
