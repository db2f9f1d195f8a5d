"""The tables of experiments/README.md, each from the JSON its section's script writes (`late`, `paired`, `summary`:
see each script's docstring); the layout is the page's, every number the evidence file's."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from experiments.page_tables.evidence import (
    bold,
    decided,
    evidence,
    fixed,
    interval,
    listed,
    markdown_table,
    signed,
    signed_interval,
    table,
)


# --- Figure 1 (experiments/figure1.py: late[method][metric], paired["A-B"][metric]) ------------------------------

FIGURE1 = "figure1/figure1"
FIGURE1_LABELS = {
    "naive_reinforce": "naive REINFORCE",
    "ppo": "PPO-clip",
    "tis": "TIS",
    "sft_positives": "SFT on positives",
    "topr": "TOPR",
}


def paired(name: str, comparison: str) -> dict:
    return evidence(name)["paired"][comparison]["accuracy"]


def mean_over_runs(runs: dict, prefix: str, value: Callable[[dict], float]) -> float:
    """The mean of `value` over the runs whose key starts with `prefix` (a method's, or a setting's, seeds)."""
    return statistics.mean(value(run) for key, run in runs.items() if key.startswith(prefix))


def figure1() -> str:
    data, far = evidence(FIGURE1), "topr_far_off_policy"
    late, runs = data["late"], data["runs"]
    share = mean_over_runs(runs, f"{far}/", lambda run: run["dataset_positive_fraction"])
    labels = {
        **FIGURE1_LABELS,
        far: f"TOPR, far off-policy (μ: another model, pass@1 {data['far_behaviour_start']['pass@1']:.2f}, "
        f"{100 * share:.0f} % positive data)",
    }
    # The base model's pass@1: the step-0 checkpoint of each seed's run of the first method.
    start = mean_over_runs(runs, f"{data['options']['methods'][0]}/", lambda run: run["curve"][0]["pass@1"])
    return table(
        {
            f"method (start {fixed(start)})": lambda method: bold(labels[method], method == "topr"),
            "late pass@1": lambda method: bold(interval(late[method]["accuracy"]), method == "topr"),
            "per seed": lambda method: listed(late[method]["accuracy"]["values"]),
            "≥ 2 carries": lambda method: interval(late[method]["pass@1_carries>=2"]),
            "greedy": lambda method: fixed(late[method]["greedy_accuracy"]["mean"]),
            "invalid": lambda method: fixed(late[method]["invalid_rate"]["mean"]),
            "TOPR − this (paired)": lambda method: (
                "" if method == "topr" else signed_interval(paired(FIGURE1, f"topr-{method}"))
            ),
        },
        labels,
    )


# --- Figures 5-6 (experiments/baseline_sweep.py: late["p/pt/method"], paired["p/pt"]) ----------------------------

TARGETS = ["0.01", "0.05", "0.1", "0.2", "0.35", "0.6", "1"]


def sweep(target: str) -> dict:
    """The sweep's file holding a target p̃ (it ran in two lanes, p̃ up to 0.2 and above)."""
    return evidence(f"figures5-6/baseline_sweep_{'low' if float(target) <= 0.2 else 'high'}")


def sweep_late(target: str, method: str) -> dict:
    return sweep(target)["late"][f"p0.67/pt{target}/{method}"]


def sweep_paired(target: str) -> dict:
    """TOPR − TIS at p̃ `target`."""
    return sweep(target)["paired"][f"p0.67/pt{target}"]


def figures5_6() -> str:
    def baseline(target: str) -> str:
        return signed(mean_over_runs(sweep(target)["runs"], f"p0.67/pt{target}/topr/", lambda run: run["baseline"]))

    best = max(TARGETS, key=lambda target: sweep_late(target, "topr")["mean"])
    widest = max(TARGETS[:4], key=lambda target: sweep_paired(target)["mean"])
    return table(
        {
            f"target p̃ (p = 0.67, start {fixed(sweep('0.01')['summary']['start_accuracy'])})": str,
            "baseline c": baseline,
            "TOPR, late": lambda target: bold(interval(sweep_late(target, "topr")), target == best),
            "TIS, late": lambda target: interval(sweep_late(target, "tis")),
            "TOPR − TIS (paired)": lambda target: bold(signed_interval(sweep_paired(target)), target == widest),
            "per seed": lambda target: listed(sweep_paired(target)["values"], signed),
        },
        TARGETS,
    )


# --- Figure 7 (experiments/figure7.py: summary[method]) ----------------------------------------------------------


def figure7() -> str:
    data = evidence("figure7/figure7")
    steps = [len(run["grad_norms"]) for run in data["runs"].values()]
    results = {"untruncated IS": data["summary"]["untruncated_is"], "TOPR": data["summary"]["topr"]}
    return table(
        {
            f"{len(data['options']['seeds'])} seeds, {min(steps)}-{max(steps)} steps": str,
            "late pass@1": lambda label: bold(interval(results[label]["late_accuracy"]), label == "TOPR"),
            "per seed": lambda label: listed(results[label]["late_accuracy"]["values"]),
            "collapsed": lambda label: f"{len(results[label]['collapsed_seeds'])} of {len(data['options']['seeds'])}",
            "largest gradient norm, per seed": lambda label: listed(
                results[label]["max_grad_norm"]["values"], "{:.1f}".format
            ),
            "largest negative ratio π/μ, per seed": lambda label: listed(
                results[label]["largest_negative_ratio"], "{:.0f}".format
            ),
        },
        results,
    )


# --- sample efficiency (experiments/sample_efficiency.py: summary[method]) ----------------------------------------

SAMPLE_EFFICIENCY_METHODS = {
    "grpo": "online GRPO (TRL's default loss, `dapo`)",
    "topr_online": "online TOPR",
    "topr_offline_k1": "offline TOPR, 1 pass (fewer steps)",
    "topr_offline_k2": "offline TOPR, 2 passes (fewer steps)",
    "topr_offline_k4": "offline TOPR, 4 passes",
    "topr_iterated": "iterated TOPR, 4 x 32 prompts, 1 pass each (fewer steps)",
    "sft_offline_k4": "control: SFT on positives, 4 passes",
    "ppo_offline_k4": "control: PPO-clip, 4 passes",
}
HEADLINE = "topr_offline_k4"
"""The headline: offline TOPR on a quarter of the completions, at online GRPO's steps."""


def sample_efficiency() -> str:
    summary = evidence("sample_efficiency/sample_efficiency")["summary"]

    def headline(cell: Callable[[dict], str]) -> Callable[[str], str]:
        return lambda method: bold(cell(summary[method]), method == HEADLINE)

    return table(
        {
            "method": lambda method: bold(SAMPLE_EFFICIENCY_METHODS[method], method == HEADLINE),
            "generated completions": headline(lambda result: f"{result['completions_total']['mean']:,.0f}"),
            "optimizer steps": lambda method: f"{summary[method]['steps']['mean']:.0f}",
            "late pass@1": headline(lambda result: interval(result["late_pass@1"])),
            "per seed": lambda method: listed(summary[method]["late_pass@1"]["values"]),
            "− online GRPO (paired)": headline(
                lambda result: signed_interval(result["late_minus_grpo"]) if result["late_minus_grpo"] else ""
            ),
        },
        SAMPLE_EFFICIENCY_METHODS,
    )


# --- staleness (experiments/staleness.py: summary[method]["lags"][K], paired["method/kK-k1"], ...) ---------------


def stale_paired(name: str, key: str) -> dict:
    return evidence(f"staleness/{name}")["paired"][key]


def staleness_fresh() -> str:
    files = {4: "fresh_a", 16: "fresh_b", 64: "fresh_b"}

    def lagged(lag: int, method: str, name: str = "") -> dict:
        return evidence(f"staleness/{name or files[lag]}")["summary"][method]["lags"][str(lag)]["late_pass@1"]

    def paired_cell(difference: dict) -> str:
        """A decided difference in bold, with "every seed" where every seed has its sign, else the seeds above 0."""
        text, values = signed_interval(difference), difference["values"]
        above, below = sum(value > 0 for value in values), sum(value < 0 for value in values)
        agreeing = (
            "every seed" if (above if difference["mean"] > 0 else below) == len(values) else f"{above} of {len(values)}"
        )
        return f"**{text}** ({agreeing})" if decided(difference) else text

    comparisons = {
        "TOPR − GRPO-clip (paired)": "topr-grpo_clip/k{k}",
        "TOPR, K − (K = 1) (paired)": "topr/k{k}-k1",
        "GRPO-clip, K − (K = 1) (paired)": "grpo_clip/k{k}-k1",
    }
    rows = [
        ["TOPR", *(bold(interval(lagged(k, "topr")), k == 64) for k in files)],
        ["GRPO-clip", *(interval(lagged(k, "grpo_clip")) for k in files)],
        *(
            [label, *(paired_cell(stale_paired(files[k], key.format(k=k))) for k in files)]
            for label, key in comparisons.items()
        ),
    ]
    header = f"late pass@1 (K = 1: {interval(lagged(1, 'topr', 'fresh_b'))} for both)"
    return markdown_table([header, "K = 4", "K = 16", "K = 64"], rows)


# --- asynchronous training (experiments/async_staleness.py: summary.by_method_and_lag, summary.paired) ----------

LAGS = [0, 1, 4, 16, 64]


def async_staleness() -> str:
    summary = evidence("asynchronous/async_staleness")["summary"]

    def late_cells(method: str, emphasised: set[int], lags: list[int] = LAGS) -> list[str]:
        late = summary["by_method_and_lag"]
        return [
            bold(interval(late[f"{method}/k{k}"]["late_pass@1"]), k in emphasised) if k in lags else "" for k in LAGS
        ]

    def paired_cells(key: str, emphasised: set[int], lags: list[int] = LAGS) -> list[str]:
        return [bold(signed_interval(summary["paired"][key.format(k=k)]), k in emphasised) for k in lags]

    dropping = [summary["by_method_and_lag"][f"async_grpo_drop/k{k}"] for k in (16, 64)]
    rows = [
        ["AsyncTOPRTrainer (keeps every sample)", *late_cells("async_topr", {64})],
        ["AsyncGRPOTrainer keeping every sample (GRPO-clip)", *late_cells("async_grpo_keep", {0, 1, 4})],
        [
            "AsyncGRPOTrainer as shipped (drops > 4 versions)",
            *["as keeping"] * 3,
            f"{interval(dropping[0]['late_pass@1'])}: the run stopped after {dropping[0]['steps_mean']} steps (every "
            f"later sample dropped), so this is its start, not a trained result",
            f"the same: stopped after {dropping[1]['steps_mean']} steps",
        ],
        [bold("AsyncTOPR − GRPO-clip keeping (paired)"), *paired_cells("async_topr-async_grpo_keep/k{k}", {16, 64})],
        ["AsyncTOPR, K − (K = 0) (paired)", "", *paired_cells("async_topr/k{k}-k0", {64}, LAGS[1:])],
        ["GRPO-clip keeping, K − (K = 0) (paired)", "", *paired_cells("async_grpo_keep/k{k}-k0", {16, 64}, LAGS[1:])],
        ["control: AsyncTOPR with TRL's token-mean aggregation", *late_cells("async_topr_token_mean", set(), [0, 64])],
    ]
    return markdown_table(["late pass@1, 5 seeds", *(f"K = {k}" for k in LAGS)], rows)


TABLES: dict[str, Callable[[], str]] = {
    "figure1": figure1,
    "figures5-6": figures5_6,
    "figure7": figure7,
    "sample-efficiency": sample_efficiency,
    "staleness-fresh": staleness_fresh,
    "async-staleness": async_staleness,
}
