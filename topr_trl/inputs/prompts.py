"""Prompts as token ids, exactly as GRPOTrainer tokenizes them: what mu samples from, what is stored, what pi is
trained and evaluated on."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving
from trl.data_utils import is_conversational


def check_prompt_columns(datasets: dict) -> None:
    """Each dataset GRPOTrainer is handed (`train_dataset`, `eval_dataset` or a dict of them) has the `prompt` column
    it reads at every step: a dataset without it is refused at construction in one line naming its columns, not with
    a bare `KeyError: 'prompt'` at the first step. A dataset whose columns are unknown (a streamed one) passes."""
    for name, dataset in datasets.items():
        if isinstance(dataset, dict):
            check_prompt_columns({f"{name}[{key!r}]": value for key, value in dataset.items()})
            continue
        columns = getattr(dataset, "column_names", None)
        if isinstance(columns, list) and "prompt" not in columns:
            raise ValueError(
                f"{name} has no 'prompt' column (its columns: {', '.join(columns) or 'none'}); GRPOTrainer reads the "
                "prompts from 'prompt': rename the column that holds them, e.g. "
                f"{name}.rename_column({(columns or ['question'])[0]!r}, 'prompt')"
            )


def tokenize_prompts(
    tokenizer,
    prompts: Sequence,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[Callable] | None = None,
    chat_template: str | None = None,
) -> list[list[int]]:
    """The token ids of each prompt exactly as GRPOTrainer tokenizes it for generation, with GRPOConfig's
    `chat_template_kwargs` and the trainer's `tools`: plain-text prompts get the tokenizer's special tokens (e.g.
    BOS), conversational ones the chat template with the generation prompt. `chat_template`: the trainer's override
    (`trainer.chat_template`); by default the one GRPOTrainer would pick for these tools. Text-only: images in
    prompts are not supported here.

    MIRROR of the text-only branch of TRL 1.16's `GRPOTrainer._tokenize_prompts` (no environments, no images; see
    docs/copies.md), held against a real trainer's tokenization by tests/test_offline_sources.py."""
    prompts, tools = list(prompts), list(tools or [])
    if not prompts:
        return []
    if not is_conversational({"prompt": prompts[0]}):
        return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]
    if chat_template is None and tools and not is_chat_template_prefix_preserving(tokenizer):
        chat_template = get_training_chat_template(tokenizer)  # GRPOTrainer swaps in the same template
    tokenized = tokenizer.apply_chat_template(
        conversation=prompts,
        tools=tools or None,  # as TRL: a Llama template renders tool boilerplate for tools=[]
        chat_template=chat_template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **dict(chat_template_kwargs or {}),
    )
    return [list(ids) for ids in tokenized["input_ids"]]


def model_positions(config) -> int | None:
    """How many positions (prompt and completion together) the model with `config` can take at most: the table of
    learned position embeddings (OPT, GPT-2), past which an embedding lookup fails; None for rotary positions (a
    RoPE model runs past `max_position_embeddings`, its trained context, without failing) or a config that does not
    say."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any("rope" in key or "rotary" in key for key in config.to_dict()):
        return None
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def rotary_context(config) -> int | None:
    """The context a rotary-position model was trained on (`max_position_embeddings`), which it runs past without
    failing but degrades beyond; None for learned positions (`model_positions`) or a config that does not say."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not any("rope" in key or "rotary" in key for key in config.to_dict()):
        return None
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def past_trained_context(
    prompts: Sequence, tokenizer, context: int, max_completion_length: int, chat_template_kwargs: dict | None = None
) -> str | None:
    """One line saying that the longest prompt plus `max_completion_length` runs past a rotary model's trained
    `context` (None when it fits): the run goes on, as GRPOTrainer's does, but not without a word."""
    longest = max((len(ids) for ids in tokenize_prompts(tokenizer, prompts, chat_template_kwargs)), default=0)
    if longest + max_completion_length <= context:
        return None
    room = f"lower --max_completion_length to {context - longest}" if context > longest else "shorten the prompts"
    return (
        f"prompts of up to {longest} tokens with --max_completion_length {max_completion_length} reach "
        f"{longest + max_completion_length} positions, past the {context} the model was trained on "
        f"(max_position_embeddings; rotary positions run past it, but a model degrades there): {room} to stay within "
        "it"
    )


def untemplated_conversation(row: int) -> str:
    return (
        f"prompt row {row} is a conversation (a list of messages) and the model's tokenizer has no chat template to "
        "render it: give the prompts as plain text (a string per row), or a model whose tokenizer carries a "
        "chat template (`chat_template` in its tokenizer_config.json, or a chat_template.jinja beside it)"
    )


def has_chat_template(model_folder: str) -> bool | None:
    """Whether the tokenizer saved in `model_folder` carries a chat template, read from its files without loading
    it (None: not a local folder, unknown)."""
    folder = Path(model_folder).expanduser()
    if not folder.is_dir():
        return None
    if any((folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def check_prompts_fit(
    prompts: Sequence,
    tokenizer,
    positions: int | None,
    max_completion_length: int,
    chat_template_kwargs: dict | None = None,
) -> None:
    """Raises ValueError, in one line naming the row, for what would fail far into a run: a conversational prompt
    with a message that is not a `role`/`content` record (the chat template's type error), and a prompt whose tokens
    plus `max_completion_length` exceed the model's `positions` (an embedding's "index out of range" in a model with
    learned positions, such as OPT)."""
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, list) and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(untemplated_conversation(row))
        if isinstance(prompt, list):
            for message in prompt:
                if not isinstance(message, dict) or "role" not in message or "content" not in message:
                    raise ValueError(
                        f"prompt row {row}: every message of a conversational prompt needs `role` and "
                        f"`content`, got {message!r:.80}"
                    )
    if positions is None:
        return
    if max_completion_length >= positions:
        raise ValueError(
            f"--max_completion_length {max_completion_length} leaves no room for a prompt in the model's "
            f"{positions} positions (max_position_embeddings): lower it below {positions}"
        )
    lengths = [len(ids) for ids in tokenize_prompts(tokenizer, prompts, chat_template_kwargs)]
    longest = max(lengths, default=0)
    if longest + max_completion_length > positions:
        row = lengths.index(longest)
        raise ValueError(
            f"prompt row {row} has {longest} tokens, which with --max_completion_length "
            f"{max_completion_length} make {longest + max_completion_length} positions, and the model has "
            f"{positions} (max_position_embeddings): shorten the prompts or lower --max_completion_length "
            f"to {positions - longest} or less"
        )
