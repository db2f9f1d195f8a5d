"""Generation by a frozen behaviour model mu that returns its sampling log-probs, as vLLM does.

`sample_with_logps` (transformers) and `sample_with_logps_vllm` (a vLLM engine) sample completions together with
log mu of every sampled token and return the same rows; offline dataset generation uses either, and
`make_behaviour_rollout(model, tokenizer)` wraps the first as a TRL `rollout_func`: TOPRTrainer then trains on
completions that the policy did not generate, with mu's log-probs as the denominator of pi/mu. This is the code
path vLLM takes (the generator reports its own log-probs) and runs anywhere, CPU included.

Prompts are tokenized by `tokenize_prompts`, which runs GRPOTrainer's own `_tokenize_prompts`: mu conditions on
exactly the token ids pi is trained on (BOS, chat template, `chat_template_kwargs` and tools included), so that
pi/mu compares the two models on the same sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..generation.completions import generate_completions, vllm_sampling_params
from ..inputs.prompts import tokenize_prompts
from ..support import SamplerProcessing


def sample_with_logps(
    model,
    tokenizer,
    prompts: list,
    num_completions: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 512,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[Callable] | None = None,
) -> list[dict]:
    """`num_completions` samples for each prompt (conversational or plain), as rows with `prompt_ids` (the prompt
    as GRPOTrainer tokenizes it, see `tokenize_prompts`), `completion`, `completion_ids` (ending with EOS when the
    completion stopped: it is what teaches the model to stop), `behaviour_logps` (log mu of each sampled token
    under the exact sampling distribution), `behaviour_sampling` (that distribution's processing, which the trainer
    scores pi with) and `truncated`."""
    sampling = SamplerProcessing(temperature, top_k or None, top_p, None, "transformers").as_row()
    prompt_ids = tokenize_prompts(tokenizer, prompts, chat_template_kwargs, tools)
    repeated = [ids for ids in prompt_ids for _ in range(num_completions)]
    samples = generate_completions(
        model,
        tokenizer,
        repeated,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        with_logps=True,
    )
    return [
        {
            "prompt_ids": list(ids),
            "completion": tokenizer.decode(sample["completion_ids"], skip_special_tokens=True),
            "completion_ids": sample["completion_ids"],
            "behaviour_logps": sample["logps"],
            "behaviour_sampling": sampling,
            "truncated": not sample["stopped"],
        }
        for ids, sample in zip(repeated, samples, strict=True)
    ]


def sample_with_logps_vllm(
    llm,
    tokenizer,
    prompts: list,
    num_completions: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 512,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[Callable] | None = None,
) -> list[dict]:
    """`sample_with_logps` with a vLLM engine (built by `topr_trl.generation.completions.make_vllm_engine`): the same
    rows, in the same order.

    Prompts are tokenized here by `tokenize_prompts`, as the transformers path does, and passed as token ids, so
    that both paths (and the trainer) condition on identical prompts. A completion that vLLM stopped at EOS keeps
    its EOS token; one that hit `max_new_tokens` is flagged `truncated`."""
    params = vllm_sampling_params(
        num_completions, temperature, top_p, top_k, max_new_tokens, logprobs=0, skip_special_tokens=True
    )
    sampling = SamplerProcessing(temperature, top_k or None, top_p, None, "vllm").as_row()
    prompt_ids = tokenize_prompts(tokenizer, prompts, chat_template_kwargs, tools)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    rows = []
    for ids, request in zip(prompt_ids, outputs, strict=True):
        for sample in request.outputs:
            tokens = list(sample.token_ids)
            # with logprobs=0 vLLM reports one entry per position: the sampled token's processed log-prob
            logps = [step[token].logprob for step, token in zip(sample.logprobs, tokens, strict=True)]
            rows.append(
                {
                    "prompt_ids": list(ids),
                    "completion": tokenizer.decode(tokens, skip_special_tokens=True),
                    "completion_ids": tokens,
                    "behaviour_logps": logps,
                    "behaviour_sampling": sampling,
                    "truncated": sample.finish_reason == "length",
                }
            )
    return rows


def make_behaviour_rollout(model, tokenizer, max_new_tokens: int | None = None) -> Callable:
    """A `rollout_func` sampling from the frozen `model` at the trainer's temperature (no top-k/top-p, so the
    stored log-probs are those of the exact sampling distribution, softmax(logits / temperature))."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)

    def rollout(prompts: list, trainer) -> dict[str, list]:
        rows = sample_with_logps(
            model,
            tokenizer,
            prompts,
            temperature=trainer.args.temperature,
            max_new_tokens=max_new_tokens or trainer.args.max_completion_length,
            chat_template_kwargs=trainer.chat_template_kwargs,
            tools=trainer.tools,
        )
        return {
            "prompt_ids": [row["prompt_ids"] for row in rows],
            "completion_ids": [row["completion_ids"] for row in rows],
            "logprobs": [row["behaviour_logps"] for row in rows],
        }

    return rollout
