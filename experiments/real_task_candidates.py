"""The real model's base figures on candidate tasks: sampled pass@1 of SmolLM2-135M-Instruct (the packaged copy, its
chat template, temperature 1) on GSM8K's test questions and on the word problems the package generates
(`topr_trl.tasks.word_problems`), with the whole vocabulary and with the paper's top_k 500. The built-in real task is
the candidate whose held-out pass@1 lies in the paper's regime (0.2-0.7).

    OMP_NUM_THREADS=1 python -m experiments.real_task_candidates --candidate word_problems --top_k 0 500 \\
        --questions 48 --samples 8 --out experiments/evidence/real-model/candidates-word_problems.json

One JSON file per call: per candidate and top_k, pass@1 with its bootstrap SE over questions, the share of questions
with 0 < p < 1, the mean completion length, the share cut at the budget, the time, and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from datasets import Dataset

from topr_trl.evaluation.runner import evaluate_model
from topr_trl.inputs.sources import resolve_model_source
from topr_trl.runtime.machine import machine_info
from topr_trl.tasks.word_problems import make_word_problems


MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GSM8K_FILE = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "example_model_solutions.jsonl"


def gsm8k_questions(count: int) -> Dataset:
    rows = [json.loads(line) for line in GSM8K_FILE.read_text().splitlines()[:count]]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": row["question"]}],
                "answer": row["ground_truth"].rsplit("A:", 1)[1].strip(),
            }
            for row in rows
        ]
    )


def single_digit_sums(count: int) -> Dataset:
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)][:count]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"What is {a} plus {b}? Answer with the number."}],
                "answer": str(a + b),
            }
            for a, b in pairs
        ]
    )


CANDIDATES = {
    "gsm8k": (gsm8k_questions, 256),
    # the shipped task (two worked examples), then the candidates it was chosen from
    "word_problems_2_shot": (lambda count: make_word_problems(count, "validation"), 64),
    "word_problems_to_20_2_shot": (lambda count: make_word_problems(count, "validation", max_number=20), 64),
    "word_problems_0_shot": (lambda count: make_word_problems(count, "validation", few_shot=0), 64),
    "word_problems_0_shot_to_20": (
        lambda count: make_word_problems(count, "validation", few_shot=0, max_number=20),
        64,
    ),
    "word_problems_0_shot_no_instruction": (
        lambda count: make_word_problems(count, "validation", few_shot=0, instruction=None),
        64,
    ),
    "plain_questions": (
        lambda count: make_word_problems(count, "validation", style="plain", max_number=12, few_shot=0),
        64,
    ),
    "single_digit_sums": (single_digit_sums, 48),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidate", choices=sorted(CANDIDATES), required=True)
    parser.add_argument("--questions", type=int, default=48)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--top_k", type=int, nargs="+", default=[0, 500])
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default: the candidate's own budget")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    make, budget = CANDIDATES[args.candidate]
    budget = args.max_new_tokens or budget
    dataset = make(args.questions)
    model = resolve_model_source(MODEL)
    results = []
    for top_k in args.top_k:
        started = time.time()
        result = evaluate_model(
            model,
            None,
            dataset,
            k=1,
            num_samples=args.samples,
            temperature=1.0,
            top_k=top_k,
            max_new_tokens=budget,
            batch_size=args.batch_size,
            seed=args.seed,
            show_progress=False,
            backend=args.backend,
            num_bootstrap=1000,
        )
        p = [record["num_correct"] / args.samples for record in result.records]
        lengths = [n for record in result.records for n in record["num_tokens"]]
        cut = [t for record in result.records for t in record["truncated"]]
        row = {
            "top_k": top_k,
            "pass@1": result.pass_at_1,
            "pass@1_se": result.standard_errors.get("pass@1"),
            "questions_0<p<1": sum(0 < x < 1 for x in p) / len(p),
            "mean_tokens": sum(lengths) / len(lengths),
            "truncated": sum(cut) / len(cut),
            "seconds": round(time.time() - started, 1),
            "example": result.records[0]["completions"][0][:300],
        }
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "example"}), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "candidate": args.candidate,
                "model": MODEL,
                "questions": len(dataset),
                "samples": args.samples,
                "temperature": 1.0,
                "max_new_tokens": budget,
                "backend": args.backend,
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
