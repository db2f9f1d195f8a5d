"""Generation by a frozen behaviour model mu that returns its sampling log-probs, as vLLM does.

`sample_with_logps` is the one place that samples completions together with log mu of every sampled token;
offline dataset generation uses it, and `make_behaviour_rollout(model, tokenizer)` wraps it as a TRL
`rollout_func`: TOPRTrainer then trains on completions that the policy did not generate, with mu's log-probs as
the denominator of pi/mu. This is the code path vLLM takes (the generator reports its own log-probs) and runs
anywhere, CPU included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


@torch.no_grad()
def sample_with_logps(
    model,
    tokenizer,
    prompts: list,
    num_completions: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 512,
) -> list[dict]:
    """`num_completions` samples for each prompt (conversational or plain), as rows with `prompt_ids`,
    `completion`, `completion_ids` (ending with EOS when the completion stopped: it is what teaches the model to
    stop), `behaviour_logps` (log mu of each sampled token under the exact sampling distribution) and
    `truncated`."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if isinstance(p, list) else p
             for p in prompts for _ in range(num_completions)]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    encoded = {key: value.to(model.device) for key, value in encoded.items()}
    output = model.generate(
        **encoded, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
        output_scores=True, return_dict_in_generate=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    new_tokens = output.sequences[:, encoded["input_ids"].size(1):]
    # `scores` are the processed logits (temperature, top-k, top-p applied; masked tokens at -inf), so their
    # log-softmax is the distribution the tokens were actually drawn from.
    step_logps = torch.stack([torch.log_softmax(score.float(), dim=-1) for score in output.scores], dim=1)
    token_logps = step_logps.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    rows = []
    for row in range(new_tokens.size(0)):
        tokens = new_tokens[row].tolist()
        stopped = tokenizer.eos_token_id in tokens
        if stopped:
            tokens = tokens[: tokens.index(tokenizer.eos_token_id) + 1]
        rows.append({
            "prompt_ids": encoded["input_ids"][row][encoded["attention_mask"][row].bool()].tolist(),
            "completion": tokenizer.decode(tokens, skip_special_tokens=True),
            "completion_ids": tokens,
            "behaviour_logps": token_logps[row, : len(tokens)].tolist(),
            "truncated": not stopped,
        })
    return rows


def make_behaviour_rollout(model, tokenizer, max_new_tokens: int | None = None) -> Callable:
    """A `rollout_func` sampling from the frozen `model` at the trainer's temperature (no top-k/top-p, so the
    stored log-probs are those of the exact sampling distribution, softmax(logits / temperature))."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)

    def rollout(prompts: list, trainer) -> dict[str, list]:
        rows = sample_with_logps(model, tokenizer, prompts, temperature=trainer.args.temperature,
                                 max_new_tokens=max_new_tokens or trainer.args.max_completion_length)
        return {
            "prompt_ids": [row["prompt_ids"] for row in rows],
            "completion_ids": [row["completion_ids"] for row in rows],
            "logprobs": [row["behaviour_logps"] for row in rows],
        }

    return rollout
