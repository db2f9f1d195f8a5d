"""Prompts as token ids, exactly as GRPOTrainer tokenizes them: what mu samples from, what is stored, what pi is
trained and evaluated on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

from trl import GRPOTrainer
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving


def tokenize_prompts(
    tokenizer,
    prompts: Sequence,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[Callable] | None = None,
    chat_template: str | None = None,
) -> list[list[int]]:
    """The token ids of each prompt exactly as GRPOTrainer tokenizes it for generation: TRL's own
    `GRPOTrainer._tokenize_prompts`, run on `tokenizer` with GRPOConfig's `chat_template_kwargs` and the trainer's
    `tools` (plain-text prompts get the tokenizer's special tokens, e.g. BOS; conversational ones the chat template
    with the generation prompt). `chat_template`: the trainer's override (`trainer.chat_template`); by default the
    one GRPOTrainer would pick for these tools. Text-only: images in prompts are not supported here."""
    tools = list(tools or [])
    if chat_template is None and tools:
        if not is_chat_template_prefix_preserving(tokenizer):  # GRPOTrainer swaps in the same template
            chat_template = get_training_chat_template(tokenizer)
    # MIRROR of the attributes TRL 1.16's `GRPOTrainer._tokenize_prompts` reads, as GRPOTrainer sets them for a
    # text-only model without environments: TRL's method runs on this view (docs/copies.md; held by
    # tests/test_offline_sources.py against a real trainer's tokenization).
    trainer_view = SimpleNamespace(processing_class=tokenizer, tools=tools, chat_template=chat_template,
                                   chat_template_kwargs=dict(chat_template_kwargs or {}), _is_vlm=False,
                                   environment_factories=None)
    prompt_ids, _, _ = GRPOTrainer._tokenize_prompts(trainer_view, list(prompts))
    return [list(ids) for ids in prompt_ids]
