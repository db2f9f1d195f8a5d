"""Generation by a frozen behaviour model mu that returns its sampling log-probs, as vLLM does.

`make_behaviour_rollout(model, tokenizer)` builds a TRL `rollout_func`: TOPRTrainer then trains on
completions that the policy did not generate, with mu's log-probs as the denominator of pi/mu. This is the
code path vLLM takes (the generator reports its own log-probs) and runs anywhere, CPU included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def make_behaviour_rollout(model, tokenizer, max_new_tokens: int | None = None) -> Callable:
    """A `rollout_func` sampling from the frozen `model` at the trainer's temperature (no top-k/top-p, so the
    stored log-probs are those of the exact sampling distribution, softmax(logits / temperature))."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)

    @torch.no_grad()
    def rollout(prompts: list, trainer) -> dict[str, list]:
        texts = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if isinstance(p, list) else p
            for p in prompts
        ]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        encoded = {key: value.to(model.device) for key, value in encoded.items()}
        output = model.generate(
            **encoded,
            do_sample=True,
            temperature=trainer.args.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens or trainer.args.max_completion_length,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new_tokens = output.sequences[:, encoded["input_ids"].size(1) :]
        step_logps = torch.stack([torch.log_softmax(score.float(), dim=-1) for score in output.scores], dim=1)
        token_logps = step_logps.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        prompt_ids, completion_ids, logprobs = [], [], []
        for row in range(new_tokens.size(0)):
            tokens = new_tokens[row].tolist()
            if tokenizer.eos_token_id in tokens:  # keep the EOS: it is what teaches the model to stop
                tokens = tokens[: tokens.index(tokenizer.eos_token_id) + 1]
            prompt = encoded["input_ids"][row][encoded["attention_mask"][row].bool()].tolist()
            prompt_ids.append(prompt)
            completion_ids.append(tokens)
            logprobs.append(token_logps[row, : len(tokens)].tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout
