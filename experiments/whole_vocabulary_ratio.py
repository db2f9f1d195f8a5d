"""What pi/mu would be on the whole vocabulary when mu samples with truncation, on the real model: the bias the exact
ratio removes (docs/off-policy.md).

mu samples SmolLM2-135M-Instruct's completions of the word problems at temperature 1 with top_k 500 or top_p 0.95.
At learning rate 0 pi is mu's model, so the exact ratio (pi scored on mu's support) is 1; pi scored on the whole
vocabulary instead gives, per token, pi(y)/mu(y) = the mass the truncation kept, and per sequence their product.
This script samples, then computes that product from the model's own logits (an independent computation: a softmax
over the whole vocabulary against one over the kept tokens, top-k by `torch.topk`, top-p by a sort).

    OMP_NUM_THREADS=1 python -m experiments.whole_vocabulary_ratio --prompts 32 --samples 4 \\
        --out experiments/evidence/real-model/whole-vocabulary-ratio.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from topr_trl.inputs.sources import resolve_model_source
from topr_trl.runtime.machine import machine_info
from topr_trl.tasks.word_problems import FEW_SHOT, WORD_PROBLEM_MODEL, WORD_PROBLEM_TOKENS, make_word_problems


def kept_log_mass(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """log of the probability mass the truncation keeps, per row of `logits` (temperature 1)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    if top_k:
        return torch.logsumexp(log_probs.topk(top_k, dim=-1).values, dim=-1)
    sorted_log_probs, _ = log_probs.sort(dim=-1, descending=True)
    cumulative = sorted_log_probs.exp().cumsum(dim=-1)
    # a token is kept while the mass before it is below top_p (transformers' and vLLM's rule; the first always kept)
    kept = (cumulative - sorted_log_probs.exp()) < top_p
    return torch.logsumexp(sorted_log_probs.masked_fill(~kept, float("-inf")), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--few_shot", type=int, default=FEW_SHOT, help="worked examples before each problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    path = resolve_model_source(WORD_PROBLEM_MODEL)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = make_word_problems(args.prompts, "validation", few_shot=args.few_shot)
    results = []
    for truncation in ({"top_k": 500}, {"top_p": 0.95}):
        torch.manual_seed(args.seed)
        log_ratios, lengths = [], []
        for row in problems:
            prompt = tokenizer.apply_chat_template(
                row["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            with torch.no_grad():
                out = model.generate(
                    prompt,
                    do_sample=True,
                    temperature=1.0,
                    max_new_tokens=WORD_PROBLEM_TOKENS,
                    num_return_sequences=args.samples,
                    top_k=truncation.get("top_k", 0),
                    top_p=truncation.get("top_p", 1.0),
                    pad_token_id=tokenizer.eos_token_id,
                )
                logits = model(out).logits[:, prompt.shape[1] - 1 : -1]
            completion = out[:, prompt.shape[1] :]
            mask = torch.ones_like(completion, dtype=torch.bool)
            for index, ids in enumerate(completion.tolist()):  # the tokens after the first EOS are padding
                if tokenizer.eos_token_id in ids:
                    mask[index, ids.index(tokenizer.eos_token_id) + 1 :] = False
            per_token = kept_log_mass(logits, truncation.get("top_k"), truncation.get("top_p"))
            log_ratios += (per_token * mask).sum(dim=1).tolist()
            lengths += mask.sum(dim=1).tolist()
        ratios = sorted(torch.tensor(log_ratios).exp().tolist())
        row = {
            **truncation,
            "sequences": len(ratios),
            "mean_tokens": statistics.mean(lengths),
            "ratio_median": statistics.median(ratios),
            "ratio_p10": ratios[len(ratios) // 10],
            "ratio_p90": ratios[9 * len(ratios) // 10],
            "ratio_min": ratios[0],
            "ratio_max": ratios[-1],
            "per_token_kept_mass_mean": statistics.mean(
                torch.tensor(log_ratios).div(torch.tensor(lengths, dtype=torch.float)).exp().tolist()
            ),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": WORD_PROBLEM_MODEL,
                "prompts": args.prompts,
                "samples": args.samples,
                "few_shot": args.few_shot,
                "seed": args.seed,
                "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
                "machine": machine_info(),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
