"""The numbers the pages quote in prose, each tied to the evidence file that gives it.

A claim is a fragment of a sentence as its page writes it, with `{}` where each number goes, and the function that
computes those numbers from the evidence. The check fills the fragment in and asserts the section says it (line
breaks aside), so a number misquoted by hand, or left behind when its evidence file changes, is reported. Write the
fragment long enough that it names one place on the page (a paired difference's "+0.010 ± 0.010" alone may appear
twice).

The numbers not tied here are settings (seeds, learning rates, batch sizes, "4 passes") or loose words ("about
0.2", "0.01-0.02").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from experiments.common import late_mean, paired_difference
from experiments.page_tables import real_model
from experiments.page_tables.evidence import evidence, fixed, interval, negated, signed, signed_interval
from experiments.page_tables.results import (
    ASYNC,
    FIGURE1,
    ITERATIONS,
    SAMPLE_EFFICIENCY,
    SERVER,
    TARGETS,
    async_paired,
    base_pass_at_1,
    late,
    late_values,
    paired,
    pooled,
    positive_share,
    stale_paired,
    sweep,
)


@dataclass(frozen=True)
class Claim:
    """A number (or several) the page quotes in `section` (a heading's text), as `template` with `{}` for each."""

    page: str
    section: str
    template: str
    compute: Callable[[], str | tuple[str, ...]]

    def expected(self) -> str:
        values = self.compute()
        return self.template.format(*(values if isinstance(values, tuple) else (values,)))


def section_claims(page: str, section: str, *claims: tuple[str, Callable[[], str | tuple[str, ...]]]) -> list[Claim]:
    return [Claim(page, section, template, compute) for template, compute in claims]


# --- what the claims read --------------------------------------------------------------------------------------------


def sample_efficiency(method: str, key: str = "late_minus_grpo", name: str = SAMPLE_EFFICIENCY) -> dict:
    return evidence(name)["summary"][method][key]


def d5_sample_efficiency(method: str, key: str = "late_minus_grpo", draw: str = "") -> dict:
    return sample_efficiency(method, key, f"harder/d5_sample_efficiency{draw}")


def percent(share: float) -> str:
    return f"{100 * share:.0f} %"


def seeds(statistic: dict) -> int:
    return len(statistic["values"])


def every_seed(statistic: dict) -> str:
    """The pages' "every seed", checked: every seed's difference has the mean's sign."""
    agreeing = [value > 0 if statistic["mean"] > 0 else value < 0 for value in statistic["values"]]
    return "every seed" if all(agreeing) else f"{sum(agreeing)} of {len(agreeing)} seeds"


def ceiling(value: float, digits: int = 1) -> str:
    """The bound a "below X" claim may state: `value` rounded up."""
    return f"{math.ceil(value * 10**digits) / 10**digits:.{digits}f}"


def cost(statistic: dict) -> str:
    """A loss stated as a positive amount ("cost TOPR 0.13")."""
    return f"{-statistic['mean']:.2f}"


def staleness_costs(method: str) -> str:
    costs = [cost(stale_paired("num_iterations", f"{method}/k{k}-k1")) for k in (4, 16, 64)]
    return f"{costs[0]}, {costs[1]} and {costs[2]}"


def chosen_rate(prefix: str, methods: list[str], rates: list[str]) -> str:
    """The learning rate a validation sweep chose: the highest mean late pass@1 over `methods`."""

    def mean(rate: str) -> float:
        summary = evidence(f"{prefix}{rate}")["summary"]
        return statistics.mean(summary[method]["late_pass@1"]["mean"] for method in methods)

    return max(rates, key=mean)


def figure7_summary(method: str) -> dict:
    return evidence("figure7/figure7")["summary"][method]


def coinciding_spikes() -> list[tuple[float, float]]:
    """Untruncated IS's (largest gradient norm, largest negative ratio) in the seeds where both fall on one step."""
    found = []
    for key, run in evidence("figure7/figure7")["runs"].items():
        if not key.startswith("untruncated_is/"):
            continue
        norms = {entry["step"]: entry["grad_norm"] for entry in run["grad_norms"]}
        ratios = {
            entry["step"]: entry["topr/ratio_negative/max"]
            for entry in run["ratio_maxima"]
            if "topr/ratio_negative/max" in entry
        }
        norm_step, ratio_step = max(norms, key=norms.get), max(ratios, key=ratios.get)
        if norm_step == ratio_step:
            found.append((norms[norm_step], ratios[ratio_step]))
    return found


def ratio_range(ratios: list[float]) -> str:
    return f"{min(ratios):.0f}-{max(ratios):.0f}"


def sweep_late(target: str, method: str = "topr", draw: str = "") -> dict:
    return evidence(sweep(target, draw))["late"][f"p0.67/pt{target}/{method}"]


def sweep_start(name: str) -> float:
    """The base model's pass@1 in a baseline-sweep file, the mean over the seeds' draws (each seed's TOPR runs start
    from it)."""
    starts = {run["seed"]: run["curve"][0]["pass@1"] for key, run in evidence(name)["runs"].items() if "/topr/" in key}
    return statistics.mean(starts.values())


def best_target() -> str:
    return max(TARGETS, key=lambda target: sweep_late(target)["mean"])


def near_best_targets() -> str:
    """The targets p̃ whose late pass@1 lies within 0.01 of the best, as a range ("0.6-1")."""
    best = sweep_late(best_target())["mean"]
    near = [target for target in TARGETS if best - sweep_late(target)["mean"] <= 0.01]
    return near[0] if len(near) == 1 else f"{near[0]}-{near[-1]}"


def low_target_gains() -> str:
    """TOPR − TIS at p̃ = 1-20 %: the smallest and largest paired means."""
    means = [evidence(sweep(target))["paired"][f"p0.67/pt{target}"]["mean"] for target in TARGETS[:4]]
    return f"{signed(min(means), 2)} to {signed(max(means), 2)}"


def low_targets_every_seed() -> str:
    """Whether TOPR is above TIS in every seed at every p̃ up to 20 %."""
    values = [
        value for target in TARGETS[:4] for value in evidence(sweep(target))["paired"][f"p0.67/pt{target}"]["values"]
    ]
    return "every seed" if all(value > 0 for value in values) else "not every seed"


def iterations_paired(first: str, second: str, name: str = ITERATIONS) -> dict:
    data = evidence(name)["paired"]
    return data[f"{first}-{second}"] if f"{first}-{second}" in data else negated(data[f"{second}-{first}"])


def pt015_against_c0(strategy: str) -> dict:
    return paired_difference(late_values(f"{ITERATIONS}_pt015", strategy), late_values(ITERATIONS, strategy))


D5, D5_AMD = "harder/d5_figure1", "harder/d5_figure1_draw_per_seed"
PT05, PT05_AMD = "harder/d5_figure1_pt05", "harder/d5_figure1_pt05_draw_per_seed"
REPLICATION, REPLICATION_AMD = "harder/d5_figure1_pt05_seeds5-9", "harder/d5_figure1_pt05_seeds5-9_draw_per_seed"
FIGURE4_D4 = "figure1/figure4_d4_preregistered"


def baseline_gain(first: str, second: str) -> str:
    """c for p̃ = 0.5 against c = 0 over 10 seeds (5 pre-registered, 5 replicating), with how many seeds agree."""
    gain = pooled(first, second, "topr_target-topr")
    agreeing = sum(value > 0 for value in gain["values"])
    return f"{interval(gain)} over c = 0 ({seeds(gain)} seeds, " + (
        "every one)" if agreeing == seeds(gain) else f"{agreeing} of them)"
    )


def tis_collapsed(name: str) -> int:
    """How many of TIS's runs ended below their start."""
    bases = base_pass_at_1(name, "tis")
    return sum(end < base for end, base in zip(late(name, "tis")["values"], bases, strict=True))


def tis_collapses(name: str) -> str:
    return f"{tis_collapsed(name)} seeds of {len(base_pass_at_1(name, 'tis'))}"


def server(pipeline: str, key: str) -> dict:
    return evidence(SERVER)["summary"]["paired"][key.format(pipeline=pipeline)]


def server_lag(pipeline: str) -> str:
    results = evidence(SERVER)["summary"]["by_method_and_pipeline"]
    lag = statistics.mean(results[f"{method}/{pipeline}"]["lag_mean"] for method in ("async_topr", "async_grpo_keep"))
    return f"{lag:.0f}"


def benchmark(name: str) -> dict:
    return evidence(f"benchmarks/{name}")


def h100_loss_ratio() -> str:
    return f"{benchmark('gpu-h100-15b-loss')['loss_only']['ratios']['topr-online / grpo-grpo']:.3f}x"


def replay_speedup() -> str:
    table = benchmark("gpu-h100-05b-proc")["table"]
    return f"{table['topr-online']['median_step_s'] / table['topr-replay']['median_step_s']:.0f}x"


def top_p_cost() -> str:
    medians = benchmark("cpu-smollm2-support-floors")["loss_only"]["median_loss_backward_s"]
    return f"{medians['topr-online-top-p'] / medians['topr-online']:.2f}x"


def async_server_ratio(name: str, digits: int = 2) -> str:
    return f"{benchmark(name)['median_ratio']:.{digits}f}x"


# --- README.md: What to expect --------------------------------------------------------------------------------------

README = section_claims(
    "README.md",
    "What to expect",
    (
        "**On-policy, TOPR and GRPO are level** ({} sampled pass@1)",
        lambda: signed_interval(sample_efficiency("topr_online")),
    ),
    (
        "epochs: {} over PPO-clip; μ up to 63 updates behind: {})",
        lambda: (
            signed(paired(FIGURE1, "topr-ppo")["mean"]),
            signed(stale_paired("fresh_b", "topr-grpo_clip/k64")["mean"]),
        ),
    ),
    (
        "(samples {} updates behind: {} over TRL's loss, level with synchronous TOPR)",
        lambda: (server_lag("w32"), signed(server("w32", "async_topr-async_grpo_keep/{pipeline}")["mean"])),
    ),
    (
        "only AsyncTOPR at {} updates is decided below synchronous training ({})",
        lambda: (server_lag("w1-f8"), signed_interval(server("w1-f8", "async_topr/{pipeline}-sync_topr"))),
    ),
    (
        "pushing every 8 steps puts TRL's loss below it ({})",
        lambda: signed_interval(server("w8", "async_grpo_keep/{pipeline}-sync_topr")),
    ),
    ("(the best p̃ here was {}; sweep it on a validation split)", near_best_targets),
    ("({} on one H100 at 1.5B, same peak memory)", h100_loss_ratio),
    ("an offline replay step with μ's log-probs stored is about {} faster than an online one", replay_speedup),
    ("costs nothing measurable under top_k 500 and {} of loss + backward under top_p 0.95", top_p_cost),
    (
        "TOPR trains {} the samples per second of synchronous TOPR when generation and training take about as long "
        "({} when generation dominates, {} when training does); with the real model and its two-shot prompts, {},",
        lambda: (
            async_server_ratio("async_server_throughput"),
            async_server_ratio("async_server_throughput_generation_heavy"),
            async_server_ratio("async_server_throughput_training_heavy"),
            async_server_ratio("async_server_throughput_smollm2", 1),
        ),
    ),
)


# --- experiments/README.md: What to expect (for users) -------------------------------------------------------------------

RESULTS = "experiments/README.md"
EXPECT = "What to expect (for users)"

RESULTS_EXPECT = section_claims(
    RESULTS,
    EXPECT,
    ("a harder 5-digit setting ({} correct)", lambda: percent(statistics.mean(base_pass_at_1(D5)))),
    # reuse
    (
        "Offline TOPR, 4 passes over {} generated completions, ends level with online GRPO on {} (paired {}, {} seeds)",
        lambda: (
            f"{sample_efficiency('topr_offline_k4', 'completions_total')['mean']:,.0f}",
            f"{sample_efficiency('grpo', 'completions_total')['mean']:,.0f}",
            signed_interval(sample_efficiency("topr_offline_k4")),
            str(seeds(sample_efficiency("topr_offline_k4"))),
        ),
    ),
    (
        "above PPO-clip with the same reuse ({}) and below positives-only SFT with the same reuse ({})",
        lambda: (
            signed_interval(sample_efficiency("ppo_offline_k4", "topr_minus_this")),
            signed_interval(sample_efficiency("sft_offline_k4", "topr_minus_this")),
        ),
    ),
    (
        "In the 5-digit setting it is below online GRPO ({}, undecided; on a warm start built on another CPU {}, {}), "
        "level with SFT reuse ({}; {}), above PPO-clip reuse ({}; {})",
        lambda: (
            signed_interval(d5_sample_efficiency("topr_offline_k4")),
            signed_interval(d5_sample_efficiency("topr_offline_k4", draw="_draw_per_seed")),
            every_seed(d5_sample_efficiency("topr_offline_k4", draw="_draw_per_seed")),
            *(
                signed_interval(d5_sample_efficiency(method, "topr_minus_this", draw))
                for method in ("sft_offline_k4", "ppo_offline_k4")
                for draw in ("", "_draw_per_seed")
            ),
        ),
    ),
    # reuse order
    (
        "`num_iterations` = 4, 16, 64 still cost TOPR {} against K = 1 and GRPO-clip {};",
        lambda: (staleness_costs("topr"), staleness_costs("grpo_clip")),
    ),
    # stale data
    (
        "(K = 64), TIS is level with TOPR ({}) and SFT on the positives is above it in every seed ({})",
        lambda: (
            signed_interval(stale_paired("controls", "topr-tis/k64")),
            signed_interval(stale_paired("controls", "topr-sft_positives/k64")),
        ),
    ),
    (
        "TOPR ended above GRPO-clip (paired {} and {} on two base models",
        lambda: (
            signed_interval(stale_paired("reuse_shipped_s16", "topr-grpo_clip/k4")),
            signed_interval(stale_paired("reuse_local2000_s16", "topr-grpo_clip/k4")),
        ),
    ),
    (
        "above GRPO-clip in every seed ({}) and above its own on-policy result",
        lambda: signed_interval(stale_paired("fresh_b", "topr-grpo_clip/k64")),
    ),
    ("PPO-clip in every seed ({}, Figure 1)", lambda: signed_interval(paired(FIGURE1, "topr-ppo"))),
    (
        "AsyncGRPOTrainer keeping every sample in every seed ({}, {}), level with its own TIS ({}) and below its "
        "positives-only SFT ({}) at K = 64",
        lambda: (
            signed_interval(async_paired(ASYNC, "async_topr-async_grpo_keep/k16")),
            signed_interval(async_paired(ASYNC, "async_topr-async_grpo_keep/k64")),
            signed_interval(async_paired("asynchronous/controls", "async_topr-async_tis/k64")),
            signed_interval(async_paired("asynchronous/controls", "async_topr-async_sft_positives/k64")),
        ),
    ),
    (
        "is level or slightly ahead ({} at K = 4)",
        lambda: signed_interval(async_paired(ASYNC, "async_topr-async_grpo_keep/k4")),
    ),
    # on-policy
    (
        "**Online and on-policy, expect parity with GRPO. [robust]** {} ({} seeds; at 5 digits {})",
        lambda: (
            signed_interval(sample_efficiency("topr_online")),
            str(seeds(sample_efficiency("topr_online"))),
            signed_interval(d5_sample_efficiency("topr_online")),
        ),
    ),
    # learning rate
    (
        "On the shipped model {} was best for GRPO and TOPR alike",
        lambda: chosen_rate(
            "sample_efficiency/val_lr", ["grpo", "topr_online", "topr_offline_k4"], ["3e-5", "1e-4", "3e-4", "1e-3"]
        ),
    ),
    (
        "At 5 digits {} was again the validation choice",
        lambda: chosen_rate(
            "harder/d5_sample_efficiency_val_lr", ["grpo", "topr_online", "topr_offline_k4"], ["1e-4", "3e-4"]
        ),
    ),
    # truncation
    ("TOPR − untruncated IS {}]**", lambda: signed_interval(figure7_summary("topr")["late_minus_untruncated_is"])),
    (
        "At {} negatives untruncated importance weights reached {} (per-seed maxima; {} over the {} seeds where the "
        "largest ratio and the largest spike coincide) and put the run's largest gradient spikes (up to {}) where they "
        "occurred; TOPR, seeing the same ratios, kept every gradient norm below {} (Figure 7, {} seeds)",
        lambda: (
            percent(1 - evidence("figure7/figure7")["options"]["proportion"]),
            ratio_range(figure7_summary("untruncated_is")["largest_negative_ratio"]),
            ratio_range([ratio for _, ratio in coinciding_spikes()]),
            str(len(coinciding_spikes())),
            f"{max(figure7_summary('untruncated_is')['max_grad_norm']['values']):.1f}",
            ceiling(max(figure7_summary("topr")["max_grad_norm"]["values"])),
            str(seeds(figure7_summary("topr")["late_accuracy"])),
        ),
    ),
    (
        "collapsed every run (Figure 1, {} seeds: {} from {})",
        lambda: (
            str(seeds(late(FIGURE1, "naive_reinforce"))),
            interval(late(FIGURE1, "naive_reinforce")),
            fixed(statistics.mean(base_pass_at_1(FIGURE1))),
        ),
    ),
    # the baseline
    (
        "At 5 digits (p = {}) c set for p̃ = 0.5 added {};",
        lambda: (f"{positive_share(D5, 'topr'):.2f}", baseline_gain(PT05, REPLICATION)),
    ),
    (
        "start whose data are {} positive it added {} (c = 0 already near p̃ = 0.5)",
        lambda: (
            percent(positive_share(D5_AMD, "topr")),
            signed_interval(pooled(PT05_AMD, REPLICATION_AMD, "topr_target-topr")),
        ),
    ),
    (
        "TOPR's late pass@1 rose with p̃ up to {} ({}) and was level at 1;",
        lambda: (best_target(), fixed(sweep_late(best_target())["mean"])),
    ),
    (
        "at 20 % at {} (Figures 5-6, {} seeds)",
        lambda: (fixed(sweep_late("0.2")["mean"]), str(seeds(sweep_late("0.2")))),
    ),
    (
        "(uniform {}, Anna Karenina {})",
        lambda: (signed_interval(pt015_against_c0("uniform")), signed_interval(pt015_against_c0("anna_karenina"))),
    ),
    ("(paired {} at p̃ = 1-20 %, {})", lambda: (low_target_gains(), low_targets_every_seed())),
    # Figure 4
    ("positives was as good as TOPR (Figure 1: {})", lambda: signed_interval(paired(FIGURE1, "topr-sft_positives"))),
    (
        "at 4 digits ({} positive data, 3e-4 not chosen on validation) the pre-registered 8-seed rerun is undecided "
        "(TOPR − SFT on positives {}; {} on a warm start built on another CPU)",
        lambda: (
            percent(positive_share(FIGURE4_D4, "topr")),
            signed_interval(paired(FIGURE4_D4, "topr-sft_positives")),
            signed_interval(paired(f"{FIGURE4_D4}_draw_per_seed", "topr-sft_positives")),
        ),
    ),
    (
        "at 5 digits ({} positive data) with c = 0 the pre-registered run fails, SFT on positives ahead in every seed ({})",
        lambda: (percent(positive_share(D5, "topr")), signed_interval(paired(D5, "topr-sft_positives"))),
    ),
    (
        "({} positive data) TOPR leans above SFT instead ({}; pooled over {} seeds {})",
        lambda: (
            percent(positive_share(D5_AMD, "topr")),
            signed_interval(paired(D5_AMD, "topr-sft_positives")),
            str(seeds(pooled(PT05_AMD, REPLICATION_AMD, "topr-sft_positives"))),
            signed_interval(pooled(PT05_AMD, REPLICATION_AMD, "topr-sft_positives")),
        ),
    ),
    (
        "SFT on positives in every seed ({}, pre-registered for that follow-up), but its replication on 5 new seeds is "
        "undecided ({}; 10 seeds pooled after the fact: {}; on the other warm start {} over 10 seeds)",
        lambda: (
            signed_interval(paired(PT05, "topr_target-sft_positives")),
            signed_interval(paired(REPLICATION, "topr_target-sft_positives")),
            signed_interval(pooled(PT05, REPLICATION, "topr_target-sft_positives")),
            signed_interval(pooled(PT05_AMD, REPLICATION_AMD, "topr_target-sft_positives")),
        ),
    ),
    (
        "positives only beat uniform data ({}) and Anna Karenina ({})",
        lambda: (
            signed_interval(iterations_paired("positives_only", "uniform")),
            signed_interval(iterations_paired("positives_only", "anna_karenina")),
        ),
    ),
    (
        "at 5 digits it ends above PPO-clip ({}; {} on the other warm start)",
        lambda: (signed_interval(paired(D5, "topr-ppo")), signed_interval(paired(D5_AMD, "topr-ppo"))),
    ),
    (
        "and above TIS ({}, which collapses; on the other warm start TIS collapses in {})",
        lambda: (signed_interval(paired(D5, "topr-tis")), tis_collapses(D5_AMD)),
    ),
    # measure
    ("greedy decoding hid a {} error rate here", lambda: percent(1 - statistics.mean(base_pass_at_1(FIGURE1)))),
)


# --- experiments/README.md: the paper side by side (a table whose cells are prose) --------------------------------------


def drawn(name: str) -> str:
    return f"{name}_draw_per_seed"


def sweep_topr(target: str, draw: str = "") -> str:
    return fixed(sweep_late(target, draw=draw)["mean"])


SIDE_BY_SIDE = section_claims(
    RESULTS,
    "The paper side by side",
    # Figure 1
    (
        "TOPR {}; TOPR − PPO-clip {} ({}), − naive REINFORCE {}: **reproduced**",
        lambda: (
            interval(late(FIGURE1, "topr")),
            signed_interval(paired(FIGURE1, "topr-ppo")),
            every_seed(paired(FIGURE1, "topr-ppo")),
            signed_interval(paired(FIGURE1, "topr-naive_reinforce")),
        ),
    ),
    ("− TIS {}, which agrees with the paper", lambda: signed_interval(paired(FIGURE1, "topr-tis"))),
    (
        "p ≈ {} here), − SFT on positives {} (Figure 4's claim, its row below)",
        lambda: (f"{positive_share(FIGURE1, 'topr'):.2f}", signed_interval(paired(FIGURE1, "topr-sft_positives"))),
    ),
    (
        "3 digits (p ≈ {}), shipped model, {} seeds",
        lambda: (f"{positive_share(FIGURE1, 'topr'):.2f}", str(seeds(late(FIGURE1, "topr")))),
    ),
    (
        "With an evaluation draw per seed in the intervals: {}, {}, {}, {}, the same conclusions",
        lambda: tuple(
            signed_interval(paired(drawn(FIGURE1), f"topr-{method}"))
            for method in ("ppo", "naive_reinforce", "tis", "sft_positives")
        ),
    ),
    # Figure 1, harder data
    (
        "TOPR − PPO-clip {}, − naive REINFORCE {}, every seed: **reproduced**; − TIS {}, every seed",
        lambda: tuple(signed_interval(paired(D5, f"topr-{method}")) for method in ("ppo", "naive_reinforce", "tis")),
    ),
    (
        "(on a warm start built on another CPU: {} and {}, every seed; − TIS {}, above in {} of {} seeds with TIS "
        "collapsing in {}: undecided there)",
        lambda: (
            signed(paired(D5_AMD, "topr-ppo")["mean"]),
            signed(paired(D5_AMD, "topr-naive_reinforce")["mean"]),
            signed_interval(paired(D5_AMD, "topr-tis")),
            str(sum(v > 0 for v in paired(D5_AMD, "topr-tis")["values"])),
            str(seeds(paired(D5_AMD, "topr-tis"))),
            str(tis_collapsed(D5_AMD)),
        ),
    ),
    (
        "− SFT on positives (Figure 4's claim) {}, on the other warm start {}: **not reproduced**",
        lambda: (
            signed_interval(paired(D5, "topr-sft_positives")),
            signed_interval(paired(D5_AMD, "topr-sft_positives")),
        ),
    ),
    ("5 digits, two planted errors ({} positive data), 5 seeds", lambda: percent(positive_share(D5, "topr"))),
    # Figure 4
    (
        "TOPR − SFT on positives at c = 0: {} (3 digits); {} (4 digits, pre-registered, undecided; {} on a warm start "
        "built on another CPU); {} (5 digits, pre-registered, fails; {} on the other warm start, whose data are {} positive)",
        lambda: (
            signed_interval(paired(FIGURE1, "topr-sft_positives")),
            signed_interval(paired(FIGURE4_D4, "topr-sft_positives")),
            signed_interval(paired(drawn(FIGURE4_D4), "topr-sft_positives")),
            signed_interval(paired(D5, "topr-sft_positives")),
            signed_interval(paired(D5_AMD, "topr-sft_positives")),
            percent(positive_share(D5_AMD, "topr")),
        ),
    ),
    (
        "4 digits: {} positive data, local warm start, {} seeds",
        lambda: (percent(positive_share(FIGURE4_D4, "topr")), str(seeds(paired(FIGURE4_D4, "topr-sft_positives")))),
    ),
    # Figure 4 with the baseline
    (
        "c for p̃ = 0.5: {} (seeds 0-4, pre-registered); replication {} (seeds 5-9): **undecided**; pooled afterwards {}, "
        "about 0.01; on the other warm start {} and {}, pooled {}",
        lambda: (
            signed_interval(paired(PT05, "topr_target-sft_positives")),
            signed_interval(paired(REPLICATION, "topr_target-sft_positives")),
            signed_interval(pooled(PT05, REPLICATION, "topr_target-sft_positives")),
            signed_interval(paired(PT05_AMD, "topr_target-sft_positives")),
            signed_interval(paired(REPLICATION_AMD, "topr_target-sft_positives")),
            signed_interval(pooled(PT05_AMD, REPLICATION_AMD, "topr_target-sft_positives")),
        ),
    ),
    # Figures 5-6
    (
        "best p̃ {} ({}), level at 1 ({}); p̃ = 10 % ends below the start ({} from {}; with a draw per seed {}, {}, {} from {})",
        lambda: (
            best_target(),
            interval(sweep_late(best_target())),
            interval(sweep_late("1")),
            interval(sweep_late("0.1")),
            fixed(evidence(sweep("0.1"))["summary"]["start_accuracy"]),
            sweep_topr("0.6", "_draw_per_seed"),
            sweep_topr("1", "_draw_per_seed"),
            sweep_topr("0.1", "_draw_per_seed"),
            fixed(sweep_start(sweep("0.1", "_draw_per_seed"))),
        ),
    ),
    (
        "p̃ = 0.5 − (c = 0) {} (5 digits, {} positive data, {} seeds); on the other warm start ({} positive) {} ({} seeds)",
        lambda: (
            signed_interval(pooled(PT05, REPLICATION, "topr_target-topr")),
            percent(positive_share(D5, "topr")),
            str(seeds(pooled(PT05, REPLICATION, "topr_target-topr"))),
            percent(positive_share(D5_AMD, "topr")),
            signed_interval(pooled(PT05_AMD, REPLICATION_AMD, "topr_target-topr")),
            str(seeds(pooled(PT05_AMD, REPLICATION_AMD, "topr_target-topr"))),
        ),
    ),
    (
        "TOPR − TIS {} at p̃ = 20 %, above in {} at p̃ = 1-20 %",
        lambda: (signed_interval(evidence(sweep("0.2"))["paired"]["p0.67/pt0.2"]), low_targets_every_seed()),
    ),
    (
        "level at p̃ ≥ 0.6 ({} at 0.6): **reproduced** (with a draw per seed: {} at 20 %, the same pattern)",
        lambda: (
            signed_interval(evidence(sweep("0.6"))["paired"]["p0.67/pt0.6"]),
            signed_interval(evidence(sweep("0.2", "_draw_per_seed"))["paired"]["p0.67/pt0.2"]),
        ),
    ),
    # Figure 7
    (
        "IS's largest gradient norms up to {}, at negative ratios up to {}; TOPR's at most {}: **reproduced** (the spikes). "
        "Collapse: {} of {} runs of either; TOPR − IS {} ({} with a draw per seed): **undecided**",
        lambda: (
            f"{max(figure7_summary('untruncated_is')['max_grad_norm']['values']):.1f}",
            f"{max(figure7_summary('untruncated_is')['largest_negative_ratio']):.0f}",
            ceiling(max(figure7_summary("topr")["max_grad_norm"]["values"])),
            str(
                len(figure7_summary("untruncated_is")["collapsed_seeds"])
                + len(figure7_summary("topr")["collapsed_seeds"])
            ),
            str(seeds(figure7_summary("topr")["late_accuracy"])),
            signed_interval(figure7_summary("topr")["late_minus_untruncated_is"]),
            signed_interval(evidence("figure7/figure7_draw_per_seed")["summary"]["topr"]["late_minus_untruncated_is"]),
        ),
    ),
    (
        "3 digits, fixed data {} positive, shipped model, {} seeds",
        lambda: (
            percent(evidence("figure7/figure7")["options"]["proportion"]),
            str(seeds(figure7_summary("topr")["late_accuracy"])),
        ),
    ),
    # Figure 8
    (
        "at equal steps, positives only − uniform {}, − Anna Karenina {} ({}): **not reproduced** (with a draw per seed: "
        "{}, {}, {})",
        lambda: (
            signed_interval(iterations_paired("positives_only", "uniform")),
            signed_interval(iterations_paired("positives_only", "anna_karenina")),
            every_seed(iterations_paired("positives_only", "anna_karenina")),
            signed_interval(iterations_paired("positives_only", "uniform", drawn(ITERATIONS))),
            signed_interval(iterations_paired("positives_only", "anna_karenina", drawn(ITERATIONS))),
            every_seed(iterations_paired("positives_only", "anna_karenina", drawn(ITERATIONS))),
        ),
    ),
    # sample efficiency
    (
        "offline TOPR on {} completions level with online GRPO on {} ({}), but SFT on positives with the same reuse "
        "beats GRPO ({}) and TOPR (TOPR − SFT {})",
        lambda: (
            f"{sample_efficiency('topr_offline_k4', 'completions_total')['mean']:,.0f}",
            f"{sample_efficiency('grpo', 'completions_total')['mean']:,.0f}",
            signed_interval(sample_efficiency("topr_offline_k4")),
            signed_interval(sample_efficiency("sft_offline_k4")),
            signed_interval(sample_efficiency("sft_offline_k4", "topr_minus_this")),
        ),
    ),
    (
        "at 5 digits the parity is gone ({}, undecided; {}, {}, on a warm start built on another CPU)",
        lambda: (
            signed_interval(d5_sample_efficiency("topr_offline_k4")),
            signed_interval(d5_sample_efficiency("topr_offline_k4", draw="_draw_per_seed")),
            every_seed(d5_sample_efficiency("topr_offline_k4", draw="_draw_per_seed")),
        ),
    ),
    # staleness
    (
        "TOPR − GRPO-clip {} ({}), level up to K = 16: **reproduced** against clipping; with Figure 1's controls "
        "TOPR − TIS {} and TOPR − SFT on positives {} ({})",
        lambda: (
            signed_interval(stale_paired("fresh_b", "topr-grpo_clip/k64")),
            every_seed(stale_paired("fresh_b", "topr-grpo_clip/k64")),
            signed_interval(stale_paired("controls", "topr-tis/k64")),
            signed_interval(stale_paired("controls", "topr-sft_positives/k64")),
            every_seed(stale_paired("controls", "topr-sft_positives/k64")),
        ),
    ),
    (
        "(with an evaluation draw per seed: {} against clipping, {} against TIS, {} against SFT)",
        lambda: tuple(
            signed_interval(stale_paired("controls_draw_per_seed", f"topr-{method}/k64"))
            for method in ("grpo_clip", "tis", "sft_positives")
        ),
    ),
    (
        "Back-to-back reuse costs both (TOPR K = 4 − K = 1 {}), neither better; spaced reuse {}",
        lambda: (
            signed_interval(stale_paired("num_iterations", "topr/k4-k1")),
            signed_interval(stale_paired("reuse_shipped_s16", "topr-grpo_clip/k4")),
        ),
    ),
    # asynchronous
    (
        "AsyncTOPR − AsyncGRPOTrainer keeping every sample {} (K = 16), {} (K = 64), every seed",
        lambda: (
            signed_interval(async_paired(ASYNC, "async_topr-async_grpo_keep/k16")),
            signed_interval(async_paired(ASYNC, "async_topr-async_grpo_keep/k64")),
        ),
    ),
    (
        "with the controls at K = 64 TOPR − TIS {}, TOPR − SFT on positives {} ({})",
        lambda: (
            signed_interval(async_paired("asynchronous/controls", "async_topr-async_tis/k64")),
            signed_interval(async_paired("asynchronous/controls", "async_topr-async_sft_positives/k64")),
            every_seed(async_paired("asynchronous/controls", "async_topr-async_sft_positives/k64")),
        ),
    ),
    (
        "on fresh data GRPO-clip level or ahead ({} at K = 4; {} at K = 1 with a draw per seed)",
        lambda: (
            signed_interval(async_paired(ASYNC, "async_topr-async_grpo_keep/k4")),
            signed_interval(async_paired("asynchronous/lags_draw_per_seed", "async_topr-async_grpo_keep/k1")),
        ),
    ),
    (
        "samples {} updates behind, AsyncTOPR − GRPO-clip {} ({}) and level with synchronous TOPR",
        lambda: (
            server_lag("w32"),
            signed_interval(server("w32", "async_topr-async_grpo_keep/{pipeline}")),
            every_seed(server("w32", "async_topr-async_grpo_keep/{pipeline}")),
        ),
    ),
    (
        "at the pipeline's own {}-{} updates the losses are level and AsyncTOPR is {}-{} below synchronous TOPR",
        lambda: (
            server_lag("w1-f8"),
            server_lag("w1"),
            f"{-server('w1', 'async_topr/{pipeline}-sync_topr')['mean']:.2f}",
            f"{-server('w1-f8', 'async_topr/{pipeline}-sync_topr')['mean']:.2f}",
        ),
    ),
)


# --- experiments/README.md: the base model, where the page describes it ---------------------------------------------------
def base_point(name: str) -> dict:
    """The base model's step-0 checkpoint in a file evaluated on one draw (every run's is the same)."""
    return next(iter(evidence(name)["runs"].values()))["curve"][0]


REGIME = section_claims(
    RESULTS,
    "The regime: the reasoning testbed",
    (
        "sampled pass@1 **{}** (4 samples x 500 held-out problems, temperature 1, evaluation seed 1234; SE across "
        "problems {})",
        lambda: (fixed(base_point(FIGURE1)["pass@1"]), f"{base_point(FIGURE1)['pass@1_problem_se']:.3f}"),
    ),
    ("Greedy accuracy is {}: greedy decoding hides", lambda: fixed(base_point(FIGURE1)["greedy_accuracy"])),
    ("where the planted error strikes most, pass@1 is {}.", lambda: fixed(base_point(FIGURE1)["pass@1_carries>=2"])),
) + section_claims(
    RESULTS,
    "Staleness: how far off-policy TOPR and GRPO-clip can go (`experiments/staleness.py`)",
    (
        "from the testbed's base model ({} on 500 held-out problems x 4 samples)",
        lambda: fixed(evidence("staleness/fresh_b")["base"]["pass@1"]),
    ),
)


def gpu_support_ratios(name: str) -> tuple[str, str]:
    """Top-k's and top-p's loss + backward against TOPR untruncated in one H200 run (`benchmarks/<name>`)."""
    ratios = benchmark(name)["loss_only"]["ratios"]
    return (f"{ratios['topr-online-top-k / topr-online']:.2f}x", f"{ratios['topr-online-top-p / topr-online']:.2f}x")


def floors_at_scale(scale: int) -> tuple[str, str]:
    return gpu_support_ratios(f"gpu-h200-05b-floors-support-loss-scale{scale}")


GPU_SUPPORT = section_claims(
    "experiments/benchmarks.md",
    "π on μ's support: what the exact ratio costs",
    (
        "on flat rows (random weights, scale 1) the rule costs {} (top-k) and {} (top-p) of TOPR untruncated, against {} "
        "and {} for the design it replaced",
        lambda: floors_at_scale(1) + gpu_support_ratios("gpu-h200-05b-support-loss"),
    ),
    (
        "(scale 4) {} and {}; on peaked rows (scale 8) level with TOPR ({} and {}:",
        lambda: floors_at_scale(4) + floors_at_scale(8),
    ),
)


# --- the real model: README.md's line and experiments/README.md's section ------------------------------------------------


def real_late(part: str, method: str) -> str:
    """A method's late held-out pass@1 on the real model: the mean over seeds (`real_model.comparison_summary`)."""
    return fixed(real_model.comparison_summary(part)["late"][method]["pass@1"]["mean"])


def real_start(part: str) -> str:
    return fixed(real_model.comparison_summary(part)["start"]["pass@1"]["mean"])


def real_seeds(part: str) -> str:
    seeds = real_model.comparison_summary(part)["seeds"]
    return "one seed" if len(seeds) == 1 else f"{len(seeds)} seeds"


def with_verdict(difference: dict) -> str:
    """A paired difference TOPR − B on the real model and what it decides (`real_model.verdict`)."""
    decided = real_model.verdict(difference)
    return f"{real_model.paired_shown(difference)}, {'TOPR ' + decided if decided in ('above', 'below') else decided}"


def real_paired(part: str, pair: str) -> str:
    """A pre-registered paired late pass@1 difference A − B on the real model, with its verdict."""
    return with_verdict(real_model.comparison_summary(part)["paired"][pair]["pass@1"])


def real_shown_if(difference: dict, decided: str) -> str:
    """A paired difference as a row prints it, only while `real_model.verdict` still says what the row's word says
    ("above" for reproduced, "undecided" for level or undecided)."""
    if real_model.verdict(difference) != decided:
        raise ValueError(f"{real_model.paired_shown(difference)} is no longer {decided}")
    return real_model.paired_shown(difference)


def real_online_own_rates() -> tuple[str, ...]:
    """Online, each method at its own validation choice: GRPO's rate and late pass@1, TOPR's rate, in how many seeds
    GRPO ended above TOPR, and TOPR − GRPO with its verdict."""
    topr_rate = real_model.chosen_learning_rate("online")
    control = real_model.own_rate_control("online", "grpo", topr_rate)
    return (
        real_model.rate(control["learning_rate"]),
        fixed(control["late"]["mean"]),
        real_model.rate(topr_rate),
        f"in {every_seed(control['difference'])}",
        with_verdict(control["difference"]),
    )


def validation_seeds(part: str, method: str, learning_rate: float) -> str:
    """The validation seeds a method's choice of `learning_rate` rests on, as the pages write them: "seed 0",
    "seeds 0 and 1"."""
    found = sorted(
        run["seed"]
        for run in real_model.validation_runs()
        if (run["part"], run["method"], run["options"]["learning_rate"]) == (part, method, learning_rate)
    )
    return f"seed {found[0]}" if len(found) == 1 else f"seeds {', '.join(map(str, found[:-1]))} and {found[-1]}"


def real_off_policy_baselines_rate() -> float:
    """The one rate off-policy TIS and PPO-clip each chose on validation, which the pages say is shared."""
    rates = {real_model.chosen_learning_rate("off_policy", method) for method in ("tis", "ppo")}
    if len(rates) != 1:
        raise ValueError(f"off-policy TIS and PPO-clip chose different rates on validation: {sorted(rates)}")
    return rates.pop()


def real_off_policy_pairs(topr_rate: float) -> tuple[dict, dict]:
    """Off-policy TOPR at `topr_rate` against TIS and PPO-clip, each at its own rate (`real_model.own_rate_control`)."""
    tis = real_model.own_rate_control("off_policy", "tis", topr_rate)
    ppo = real_model.own_rate_control("off_policy", "ppo", topr_rate)
    return tis, ppo


def real_topr_late(part: str, learning_rate: float) -> str:
    """TOPR's held-out late pass@1 at one rate: the mean over its seeds' runs."""
    return fixed(statistics.mean(real_model.held_out_late(part, "topr", learning_rate).values()))


def real_off_policy_own_rates() -> tuple[str, ...]:
    """Off-policy, each method at its own validation choice and the seeds it rests on; TOPR's, TIS's and PPO-clip's
    late pass@1 and TOPR − each with its verdict; then TOPR at the baselines' rate: its late pass@1 and TOPR − each."""
    topr_rate, baselines_rate = real_model.chosen_learning_rate("off_policy"), real_off_policy_baselines_rate()
    tis, ppo = real_off_policy_pairs(topr_rate)
    tis_there, ppo_there = real_off_policy_pairs(baselines_rate)
    return (
        real_model.rate(topr_rate),
        validation_seeds("off_policy", "topr", topr_rate),
        real_model.rate(baselines_rate),
        validation_seeds("off_policy", "ppo", baselines_rate),
        real_topr_late("off_policy", topr_rate),
        fixed(tis["late"]["mean"]),
        fixed(ppo["late"]["mean"]),
        with_verdict(tis["difference"]),
        with_verdict(ppo["difference"]),
        every_seed(ppo["difference"]),
        real_model.rate(baselines_rate),
        real_topr_late("off_policy", baselines_rate),
        with_verdict(tis_there["difference"]),
        with_verdict(ppo_there["difference"]),
        every_seed(ppo_there["difference"]),
    )


def real_figure1_row() -> tuple[str, ...]:
    """The side-by-side row of Figure 1 on the real model: each method at its own rate, TOPR − PPO-clip and − TIS
    undecided; with TOPR at the baselines' rate too, TOPR − PPO-clip decided above (and in how many seeds), − TIS
    undecided; at the comparison's one rate, both undecided."""
    topr_rate, baselines_rate = real_model.chosen_learning_rate("off_policy"), real_off_policy_baselines_rate()
    tis, ppo = (control["difference"] for control in real_off_policy_pairs(topr_rate))
    tis_there, ppo_there = (control["difference"] for control in real_off_policy_pairs(baselines_rate))
    at_one_rate = real_model.comparison_summary("off_policy")["paired"]
    return (
        real_model.rate(topr_rate),
        real_model.rate(baselines_rate),
        real_shown_if(ppo, "undecided"),
        every_seed(ppo),
        real_shown_if(tis, "undecided"),
        real_model.rate(baselines_rate),
        real_shown_if(ppo_there, "above"),
        every_seed(ppo_there),
        real_shown_if(tis_there, "undecided"),
        real_model.rate(real_model.comparison_learning_rate("off_policy")),
        real_shown_if(at_one_rate["topr-ppo"]["pass@1"], "undecided"),
        real_shown_if(at_one_rate["topr-tis"]["pass@1"], "undecided"),
    )


REAL_MODEL = section_claims(
    "README.md",
    "What to expect",
    (
        "online, GRPO ({}) reached {}, above TOPR ({}) {} (TOPR − GRPO {})",
        real_online_own_rates,
    ),
    (
        "off-policy, TOPR chose {} (validation {}) and TIS and PPO-clip {} ({}), where TOPR reached {}, TIS {} and "
        "PPO-clip {} (TOPR − TIS {}; TOPR − PPO-clip {}, TOPR ahead in {}). With TOPR at their rate, {}, it reached {} "
        "(TOPR − TIS {}; TOPR − PPO-clip {}, in {})",
        real_off_policy_own_rates,
    ),
    (
        "on held-out word problems, paired over {}: online, TOPR went from {} to {} sampled pass@1, GRPO (`dapo`) at "
        "TOPR's learning rate to {} and SFT on positives to {} (TOPR − GRPO {}; TOPR − SFT {}); trained 3 epochs on one "
        "dataset from the base model, TOPR reached {}, TIS {} and PPO-clip {} (TOPR − TIS {}; TOPR − PPO-clip {})",
        lambda: (
            real_seeds("online"),
            real_start("online"),
            real_late("online", "topr"),
            real_late("online", "grpo"),
            real_late("online", "sft_positives"),
            real_paired("online", "topr-grpo"),
            real_paired("online", "topr-sft_positives"),
            real_late("off_policy", "topr"),
            real_late("off_policy", "tis"),
            real_late("off_policy", "ppo"),
            real_paired("off_policy", "topr-tis"),
            real_paired("off_policy", "topr-ppo"),
        ),
    ),
)


def readme_run_timing() -> tuple[str, ...]:
    """The README's real-model command as timed: the installs' range, then each host's time (the first its memory)."""
    runs = real_model.readme_runs()
    first, *others = runs
    return (
        seconds_range([run["install_s"] for run in runs]),
        real_model.wall_clock(first),
        real_model.peak_memory(first),
        first["machine"]["cpu_capability"],
        ", ".join(f"{real_model.wall_clock(run)} on an {run['machine']['cpu_capability']} one" for run in others),
    )


def seconds_range(values: list[int]) -> str:
    """Measured seconds as the README quotes them: "50-100 s", or "50 s" where every run took the same."""
    low, high = min(values), max(values)
    return f"{low}-{high} s" if low != high else f"{low} s"


def conversion_times() -> str:
    return seconds_range([run["conversion_s"] for run in real_model.readme_runs()])


def readme_run_figures() -> tuple[str, ...]:
    """Sampled pass@1 before and after, then greedy accuracy before and after (the same on every host)."""
    run = real_model.readme_runs()[0]
    return tuple(fixed(run[when][key], 3) for key in ("pass@1", "greedy_accuracy") for when in ("before", "after"))


README_RUN = section_claims(
    "README.md",
    "The two commands",
    ("converted once, in {}, to an ordinary trainable folder", conversion_times),
    (
        "the install took {} (pip's cache warm) and the run {} and {} on an {} host, {}, the conversion included",
        readme_run_timing,
    ),
    (
        "on both it printed held-out sampled pass@1 **{} → {}** (48 problems × 4 samples at temperature 1; one seed) "
        "and greedy accuracy {} → {}",
        readme_run_figures,
    ),
)


def seed_range(difference: dict) -> str:
    """A paired difference's per-seed values as a range, "+0.234 to +0.453"."""
    return f"{signed(min(difference['values']))} to {signed(max(difference['values']))}"


def real_off_policy_topr_choice() -> tuple[str, ...]:
    """TOPR's off-policy near-tie on validation seed 0, rerun on later seeds: each rate's later runs in seed order
    ("0.440 and 0.5"), then TOPR's choice over all its seeds and the two rates' means."""
    rates = (1e-5, 3e-5)
    later: dict[float, list[str]] = {learning_rate: [] for learning_rate in rates}
    for run in sorted(real_model.validation_runs(), key=lambda run: run["seed"]):
        if (run["part"], run["method"]) == ("off_policy", "topr") and run["seed"] > 0:
            if run["options"]["learning_rate"] in later:
                later[run["options"]["learning_rate"]].append(fixed(late_mean(run["curve"])))
    scores = real_model.validation_scores("off_policy", "topr")
    chosen = real_model.chosen_learning_rate("off_policy")
    (other,) = set(rates) - {chosen}  # the sentence weighs the two rates the later seeds ran
    return (
        " and ".join(later[1e-5]),
        " and ".join(later[3e-5]),
        real_model.rate(chosen),
        fixed(scores[chosen]),
        fixed(scores[other]),
    )


REAL_MODEL_SECTION = section_claims(
    RESULTS,
    "The real model: SmolLM2-135M-Instruct on word problems (`experiments/real_model_comparison.py`)",
    (
        "{} at 1e-5 and {} at 3e-5, and over the two seeds TOPR's own choice is {} ({} against {})",
        real_off_policy_topr_choice,
    ),
    (
        "three seeds this far apart leave it undecided ({})",
        lambda: seed_range(real_off_policy_pairs(real_model.chosen_learning_rate("off_policy"))[1]["difference"]),
    ),
    (
        "the seeds agree closely enough ({}) that TOPR − PPO-clip is above zero",
        lambda: seed_range(real_off_policy_pairs(real_off_policy_baselines_rate())[1]["difference"]),
    ),
)


# The side-by-side rows on the real model (after the helpers they read).
SIDE_BY_SIDE_REAL_MODEL = section_claims(
    RESULTS,
    "The paper side by side",
    (
        "each method at its own rate, chosen on validation (TOPR {}, TIS and PPO-clip {}): TOPR − PPO-clip {} (ahead in "
        "{}), − TIS {}: **undecided**. With TOPR at the baselines' rate, {}: − PPO-clip {} ({}): reproduced at that "
        "rate; − TIS {}: level. At the one rate chosen on TOPR ({}), where TIS and PPO-clip collapsed on validation: − "
        "PPO-clip {}, − TIS {}, undecided",
        real_figure1_row,
    ),
    (
        "TOPR − SFT on positives {} at the one rate ({}; SFT on positives not tuned separately): **undecided**",
        lambda: (
            real_shown_if(
                real_model.comparison_summary("online")["paired"]["topr-sft_positives"]["pass@1"], "undecided"
            ),
            real_model.rate(real_model.comparison_learning_rate("online")),
        ),
    ),
)


CLAIMS: list[Claim] = (
    README
    + README_RUN
    + RESULTS_EXPECT
    + SIDE_BY_SIDE
    + SIDE_BY_SIDE_REAL_MODEL
    + REGIME
    + GPU_SUPPORT
    + REAL_MODEL
    + REAL_MODEL_SECTION
)
