"""π on μ's support, the rule alone: this checkout's `processed_log_probs` against another checkout's (an earlier
design of `topr_trl/support/rule.py`), interleaved call by call in one process on the real model's logits: the
completion positions of word-problem completions SmolLM2-135M-Instruct sampled at top_p 0.95, with top-p, top-k and
min-p processings. Reports each design's median time, the ratio, and the largest difference of their log-probs.

    git worktree add ../old-rule 2288012~1     # the rule that sorted every row whole
    OMP_NUM_THREADS=1 python -m experiments.rule_speed --baseline_checkout ../old-rule \\
        --output experiments/evidence/benchmarks/rule-floors-vs-whole-sort.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")


def baseline_rule(checkout: Path) -> types.ModuleType:
    """The other checkout's rule module, loaded beside this one (its relative import of the processing resolved to
    this checkout's `SamplerProcessing`, which both designs share)."""
    source = (checkout / "topr_trl" / "support" / "rule.py").read_text()
    module = types.ModuleType("baseline_rule")
    exec(
        compile(
            source.replace("from .processing import", "from topr_trl.support.processing import"),
            str(checkout / "topr_trl/support/rule.py"),
            "exec",
        ),
        module.__dict__,
    )
    return module


def real_logits(rows: int, seed: int):
    """(logits, sampled tokens): the first `rows` completion positions of 2 samples x 8 validation word problems,
    SmolLM2-135M-Instruct at top_p 0.95, and a token per row drawn from the whole-vocabulary softmax."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.inputs.sources import resolve_model_source
    from topr_trl.tasks.word_problems import make_word_problems

    path = resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(seed)
    hidden = []
    with torch.no_grad():
        for row in make_word_problems(8, "validation"):
            ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt")
            ids = ids if torch.is_tensor(ids) else ids["input_ids"]
            out = model.generate(
                ids.repeat(2, 1),
                do_sample=True,
                top_p=0.95,
                top_k=0,
                max_new_tokens=64,
                pad_token_id=tokenizer.eos_token_id,
            )
            states = model.model(out).last_hidden_state[:, ids.size(1) - 1 : -1]
            hidden.append(states.reshape(-1, states.size(-1)))
        logits = model.lm_head(torch.cat(hidden)[:rows]).float()
    return logits, logits.softmax(-1).multinomial(1).squeeze(-1)


def main(argv: list[str] | None = None) -> dict:
    import torch

    from topr_trl.runtime.machine import machine_info
    from topr_trl.support import rule
    from topr_trl.support.processing import SamplerProcessing

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline_checkout", required=True, type=Path)
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="writes the results as JSON")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    baseline = baseline_rule(options.baseline_checkout)
    logits, tokens = real_logits(options.rows, options.seed)
    results = []
    for processing in (SamplerProcessing(top_p=0.95), SamplerProcessing(top_k=500), SamplerProcessing(min_p=0.05)):
        times: dict[str, list[float]] = {"baseline": [], "this": []}
        for _ in range(options.repeats):
            for name, module in (("baseline", baseline), ("this", rule)):
                started = time.perf_counter()
                module.processed_log_probs(logits, tokens, processing)
                times[name].append(time.perf_counter() - started)
        difference = (
            (
                baseline.processed_log_probs(logits, tokens, processing)
                - rule.processed_log_probs(logits, tokens, processing)
            )
            .abs()
            .max()
        )
        row = {
            "processing": processing.as_row(),
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "max_abs_difference": float(difference),
        }
        row["this_over_baseline"] = row["median_s"]["this"] / row["median_s"]["baseline"]
        results.append(row)
        print(
            f"{processing}: baseline {row['median_s']['baseline']:.3f} s, this {row['median_s']['this']:.3f} s, "
            f"ratio {row['this_over_baseline']:.3f}, max |difference| {row['max_abs_difference']:.2e}",
            flush=True,
        )
    outcome = {
        "rows": int(logits.size(0)),
        "vocabulary": int(logits.size(1)),
        "repeats": options.repeats,
        "baseline_checkout": str(options.baseline_checkout),
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        "results": results,
    }
    if options.output:
        Path(options.output).parent.mkdir(parents=True, exist_ok=True)
        Path(options.output).write_text(json.dumps(outcome, indent=2))
    return outcome


if __name__ == "__main__":
    main()
