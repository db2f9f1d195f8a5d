"""Parity matrix between TOPRTrainer's loss code and TRL's GRPOTrainer._compute_loss, one row per shared feature.

(a) TOPRTrainer configured to *be* GRPO (loss_type="ppo", token ratios, the advantage signal,
    the matching aggregation, the same epsilons) gives GRPOTrainer's loss, gradients and logged metrics.
(b) TOPRTrainer with its own loss (loss_type="topr") changes loss and gradients exactly as GRPOTrainer does when a
    feature that does not touch the policy term is switched on (KL, entropy bonus, MoE aux loss), and logs the
    same kl / entropy / entropy_coef / aux_loss.

Both trainers see ONE hand-built inputs dict and the same weights; `_compute_loss` is called directly. A row that
fails because TOPRTrainer drifted from TRL stays in the matrix as a strict xfail whose reason names the drift.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM
from trl import GRPOConfig, GRPOTrainer

from topr_trl import TOPRConfig, TOPRTrainer
from topr_trl.tasks.tiny import build_tokenizer, save_pretrained

from .conftest import parity_reward, small_config_kwargs


RTOL = 1e-6  # fp32, the same operations in (nearly) the same order
# (b) compares *changes* of fp32 losses and gradients: the O(1) per-token policy terms cancel in the difference,
# and their rounding (a few ulps, amplified through backprop) is what is left, so gradients get 10x the room.
RTOL_CHANGE = 1e-5

# TRL loss type -> the TOPR aggregation that normalises the same way.
AGGREGATION = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "global-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}

# Metrics GRPOTrainer logs from `_compute_loss` that TOPRTrainer's own loss does not (it logs topr/* instead).
NOT_LOGGED_BY_TOPR = {
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
}
# Metrics that do not depend on the policy term: equal under TOPR's own loss too.
POLICY_FREE_METRICS = ("kl", "entropy", "entropy_coef", "aux_loss")

# Shapes of the hand-built batch: 8 completions (two groups of 4), prompts left-padded to 5, completions
# right-padded to 6 (< max_completion_length, so dr_grpo's normaliser is not the padded width).
PROMPT_LENGTHS = (5, 3, 4, 5, 2, 5, 4, 3)
COMPLETION_LENGTHS = (6, 4, 6, 2, 5, 6, 3, 1)
MAX_COMPLETION_LENGTH = 8
ADVANTAGES = (1.2, -0.4, -1.1, 0.3, 0.0, 0.9, -0.7, -0.2)


# ----------------------------------------------------------------------------------------- trainers and inputs
@pytest.fixture(scope="module")
def moe_model_path(tmp_path_factory) -> str:
    """A tiny Mixtral (4 experts, top-2 routing) whose config declares a router aux-loss coefficient."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return str(save_pretrained(MixtralForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-moe")))


class Bench:
    """Builds each trainer configuration once, keeps one reference state dict per model, and runs `_compute_loss`."""

    def __init__(self, model_paths: dict[str, str], dataset, root):
        self.model_paths, self.dataset, self.root = model_paths, dataset, root
        self.trainers: dict[str, object] = {}
        self.weights: dict[str, dict] = {}
        self.inputs: dict[tuple, dict] = {}
        self.pairs: dict[str, list] = {}  # (a): one run per row, shared by its loss and its metrics test

    def trainer(self, kind: str, loss_type: str, config: dict, model: str = "dense", tag: str = ""):
        """kind: "grpo" (GRPOTrainer, `loss_type`), "ppo" (TOPRTrainer reduced to GRPO) or "topr" (TOPR's loss).
        `tag` keeps apart trainers whose attributes a test changes after construction."""
        key = repr((kind, loss_type, model, sorted(config.items()), tag))
        if key in self.trainers:
            return self.trainers[key]
        config = dict(config)
        shared = dict(
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=MAX_COMPLETION_LENGTH,
            epsilon=0.2,
            epsilon_high=0.28,
        )
        topr_only = {name: config.pop(name) for name in list(config) if name.startswith("topr_")}
        kwargs = small_config_kwargs(self.root / f"run{len(self.trainers)}", **shared, **config)
        if kind == "grpo":
            args = GRPOConfig(loss_type=loss_type, **kwargs)
            trainer_class = GRPOTrainer
        else:
            variant = {"loss_type": "ppo", "topr_ratio_level": "token"} if kind == "ppo" else {"loss_type": "topr"}
            args = TOPRConfig(
                topr_signal="advantage",
                topr_loss_aggregation=AGGREGATION[loss_type],
                **{**variant, **topr_only},
                **kwargs,
            )
            trainer_class = TOPRTrainer
        trainer = trainer_class(
            model=self.model_paths[model], reward_funcs=parity_reward, args=args, train_dataset=self.dataset
        )
        # identical weights in every trainer of a model, whatever was loaded
        reference = self.weights.setdefault(model, {k: v.clone() for k, v in trainer.model.state_dict().items()})
        trainer.model.load_state_dict(reference)
        self.trainers[key] = trainer
        return trainer

    def make_inputs(
        self,
        model: str = "dense",
        seed: int = 0,
        *,
        old=True,
        ref=False,
        sampling=False,
        tool_mask=False,
        importance_sampling_ratio=False,
        steps_per_generation=1,
    ) -> dict:
        """One micro-batch as GRPOTrainer's `_generate_and_score_completions` hands it to `_compute_loss`; the
        stored log-probs are the model's own, shifted, so that pi differs from pi_old, pi_ref and the sampler."""
        key = (model, seed, old, ref, sampling, tool_mask, importance_sampling_ratio, steps_per_generation)
        if key in self.inputs:
            return self.inputs[key]
        trainer = self.trainer("grpo", "grpo", {}, model)
        generator = torch.Generator().manual_seed(seed)
        pad = trainer.processing_class.pad_token_id
        vocab = trainer.model.config.vocab_size
        batch, prompt_width, completion_width = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), max(COMPLETION_LENGTHS)
        prompt_mask = (torch.arange(prompt_width) >= prompt_width - torch.tensor(PROMPT_LENGTHS)[:, None]).long()
        completion_mask = (torch.arange(completion_width) < torch.tensor(COMPLETION_LENGTHS)[:, None]).long()
        prompt_ids = torch.randint(3, vocab, (batch, prompt_width), generator=generator)  # 0-2: special tokens
        prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, pad)
        completion_ids = torch.randint(3, vocab, (batch, completion_width), generator=generator)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
        inputs = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.tensor(ADVANTAGES).roll(seed),
        }
        loss_mask = completion_mask
        if tool_mask:  # tool-result tokens inside completions, as a multi-turn rollout marks them
            inputs["tool_mask"] = torch.ones_like(completion_mask)
            inputs["tool_mask"][[0, 2, 5], 1:3] = 0
            loss_mask = completion_mask * inputs["tool_mask"]
        # what GRPOTrainer stores: the generation batch's token count (all its micro-batches)
        inputs["num_items_in_batch"] = loss_mask.sum() * steps_per_generation
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model,
                torch.cat([prompt_ids, completion_ids], 1),
                torch.cat([prompt_mask, completion_mask], 1),
                completion_width,
            )

        def shifted(scale_sequence, scale_token):
            per_sequence = (torch.rand(batch, 1, generator=generator) * 2 - 1) * scale_sequence
            return logps + per_sequence + scale_token * torch.randn(logps.shape, generator=generator)

        if old:  # num_iterations > 1: mu is the policy of a few updates ago, far enough for PPO to clip
            inputs["old_per_token_logps"] = shifted(0.4, 0.15)
        if ref:
            inputs["ref_per_token_logps"] = shifted(0.2, 0.3)
        if sampling:
            inputs["sampling_per_token_logps"] = shifted(0.3, 0.1)
        if importance_sampling_ratio:
            inputs["importance_sampling_ratio"] = 0.5 + torch.rand(logps.shape, generator=generator)
        inputs["_current_logps"] = logps  # for test_inputs_exercise_the_features; `run` drops "_" keys
        self.inputs[key] = inputs
        return inputs

    def run(self, trainer, inputs, *, ga: int = 1, mode: str = "train", model: str = "dense"):
        """Loss, per-parameter gradients and the metrics logged by one `_compute_loss` call on fresh state."""
        trainer.model.load_state_dict(self.weights[model])
        trainer.model.train(mode == "train")
        trainer.current_gradient_accumulation_steps = ga
        trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = (
            trainer.args.entropy_coef,
            math.inf,
            None,
        )
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(trainer.model, {k: v for k, v in inputs.items() if not k.startswith("_")})
        loss.backward()
        grads = {
            name: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
            for name, p in trainer.model.named_parameters()
        }
        metrics = {name: list(values) for name, values in trainer._metrics[mode].items()}
        return loss.detach(), grads, metrics


@pytest.fixture(scope="module")
def bench(tiny_model_path, moe_model_path, arithmetic_dataset, tmp_path_factory) -> Bench:
    models = {"dense": tiny_model_path, "moe": moe_model_path}
    return Bench(models, arithmetic_dataset, tmp_path_factory.mktemp("parity"))


def assert_loss_close(actual, expected, what=""):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * 1e-2, msg=lambda m: f"{what} loss: {m}")


def assert_loss_change_close(actual, expected, losses, what=""):
    """A difference of two losses: what rounding leaves in it is that of the per-token terms, which are
    O(max |advantage|) whatever the aggregate, so that is added to the scale of the tolerance."""
    rounding = max(loss.abs().item() for loss in losses) + max(abs(a) for a in ADVANTAGES)
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=RTOL * rounding, msg=lambda m: f"{what} change of loss: {m}"
    )


def assert_grads_close(actual: dict, expected: dict, scale: dict | None = None, rtol=RTOL, what=""):
    """Per parameter, within `rtol` of the largest expected entry (of `scale`'s, for differences of gradients)."""
    assert any(g.abs().max() > 0 for g in expected.values()), "no gradient reached the model"
    for name, wanted in expected.items():
        reference = (scale or expected)[name].abs().max().item()
        torch.testing.assert_close(
            actual[name],
            wanted,
            rtol=rtol,
            atol=rtol * reference + 1e-12,
            msg=lambda m, name=name: f"{what} gradient of {name}: {m}",
        )


def assert_metrics_close(actual: dict, expected: dict, keys=None, what=""):
    """Every metric in `keys` that GRPO logged, logged by TOPR with the same values; policy_loss is checked last,
    so that a known policy_loss drift (an xfail) still has every other metric checked first."""
    keys = expected.keys() if keys is None else [k for k in keys if k in expected]
    for key in sorted(keys, key=lambda k: (k == "policy_loss", k)):
        assert key in actual, f"{what}: GRPO logs {key!r}, TOPR does not"
        assert actual[key] == pytest.approx(expected[key], rel=RTOL, abs=1e-9, nan_ok=True), (
            f"{what} metric {key!r}: TOPR {actual[key]} vs GRPO {expected[key]}"
        )


# ----------------------------------------------------------------------------------------- (a) reduction to GRPO
def row(
    id_,
    loss_type="grpo",
    config=None,
    inputs=None,
    ga=1,
    mode="train",
    model="dense",
    vllm_is=False,
    xfail_loss=None,
    xfail_metrics=None,
):
    """One feature: the TRL `loss_type`, config fields for both trainers (`topr_*` ones for TOPR only), the
    `make_inputs` options, the accumulation steps, train/eval, the model, and the known drifts (xfail reasons)."""
    return dict(
        id=id_,
        loss_type=loss_type,
        config=config or {},
        inputs=inputs or {},
        ga=ga,
        mode=mode,
        model=model,
        vllm_is=vllm_is,
        xfail_loss=xfail_loss,
        xfail_metrics=xfail_metrics,
    )


KL = {"beta": 0.1, "use_bias_correction_kl": False}
BIAS_KL = {"beta": 0.1, "use_bias_correction_kl": True}
ENTROPY = {"entropy_coef": 0.01}
GA2 = {"gradient_accumulation_steps": 2}
OLD = {"num_iterations": 2}  # with old_per_token_logps in the inputs (make_inputs' default)
OFF_POLICY_THRESHOLD = 0.02  # drops one negative-advantage sequence of the seed-0 batch, keeps the others
OFF_POLICY = {"off_policy_mask_threshold": OFF_POLICY_THRESHOLD}
PPO_DELTA = 1.3  # > 1 + epsilon_high, as TRL recommends; some negative-advantage tokens have larger ratios
# Drifts this matrix found and that were fixed (each was an xfail until then): the KL bias correction used the
# token ratio where GRPO uses its importance-sampling level's ratio; loss_type='ppo' ignored GRPOConfig.delta;
# policy_loss was logged after the gradient-accumulation division (half of GRPO's at GA=2).

ROWS = [
    *[row(f"aggregation-{lt}", lt, OLD) for lt in AGGREGATION],
    row("on_policy", "grpo", {}, {"old": False}),
    *[row(f"beta-{lt}", lt, {**KL, **OLD}, {"ref": True}) for lt in ("grpo", "dapo")],
    *[row(f"beta-bias_kl-{lt}", lt, {**BIAS_KL, **OLD}, {"ref": True}) for lt in AGGREGATION],
    row("beta-bias_kl-on_policy", "grpo", BIAS_KL, {"ref": True, "old": False}),
    row(
        "is_level_sequence",
        "grpo",
        {**OLD, "importance_sampling_level": "sequence", "topr_ratio_level": "length_normalized"},
    ),
    row(
        "beta-bias_kl-is_level_sequence",
        "grpo",
        {**BIAS_KL, **OLD, "importance_sampling_level": "sequence", "topr_ratio_level": "length_normalized"},
        {"ref": True},
    ),
    row("ppo_two_sided_clip_delta", "grpo", {**OLD, "delta": PPO_DELTA}),
    *[row(f"entropy_static-{lt}", lt, {**ENTROPY, **OLD}) for lt in AGGREGATION],
    row("top_entropy_quantile", "grpo", {**OLD, "top_entropy_quantile": 0.5}),
    row("top_entropy_quantile-entropy_static", "bnpo", {**OLD, **ENTROPY, "top_entropy_quantile": 0.5}),
    row("off_policy_mask", "grpo", {**OLD, **OFF_POLICY}),
    row(
        "off_policy_mask-sampling_logps",
        "grpo",
        {**OLD, **OFF_POLICY, "topr_behaviour_source": "policy"},
        {"sampling": True},
    ),
    row("tool_mask", "grpo", OLD, {"tool_mask": True}),
    row("tool_mask-dapo", "dapo", OLD, {"tool_mask": True}),
    row(
        "vllm_importance_sampling_correction",
        "grpo",
        {**OLD, "topr_behaviour_source": "policy"},
        {"sampling": True, "importance_sampling_ratio": True},
        vllm_is=True,
    ),
    *[
        row(f"grad_accumulation-{lt}", lt, {**GA2, **OLD, **ENTROPY}, {"steps_per_generation": 2}, ga=2)
        for lt in AGGREGATION
    ],
    *[
        row(
            f"eval-{lt}",
            lt,
            {**GA2, **OLD, **ENTROPY, **BIAS_KL},
            {"ref": True, "steps_per_generation": 2},
            ga=2,
            mode="eval",
        )
        for lt in ("grpo", "dapo")
    ],
    row("aux_loss", "grpo", {**OLD, "router_aux_loss_coef": 0.02}, model="moe"),
    row(
        "aux_loss-grad_accumulation",
        "bnpo",
        {**OLD, **GA2, **ENTROPY, "router_aux_loss_coef": 0.02},
        {"steps_per_generation": 2},
        ga=2,
        model="moe",
    ),
    *[
        row(
            f"everything-{lt}",
            lt,
            {**BIAS_KL, **GA2, **OLD, **ENTROPY, **OFF_POLICY, "top_entropy_quantile": 0.5},
            {"ref": True, "tool_mask": True, "steps_per_generation": 2},
            ga=2,
        )
        for lt in ("grpo", "dapo")
    ],
]


def params(check: str):
    reasons = {"loss": "xfail_loss", "metrics": "xfail_metrics"}
    out = []
    for r in ROWS:
        reason = r[reasons[check]]
        marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []
        out.append(pytest.param(r, id=r["id"], marks=marks))
    return out


def run_pair(bench: Bench, r: dict):
    """GRPOTrainer(loss_type) and TOPRTrainer(loss_type='ppo') on the row's inputs: (grpo, topr) results."""
    if r["id"] in bench.pairs:
        return bench.pairs[r["id"]]
    results = []
    for kind in ("grpo", "ppo"):
        config = r["config"] if kind == "ppo" else {k: v for k, v in r["config"].items() if not k.startswith("topr_")}
        trainer = bench.trainer(kind, r["loss_type"], config, r["model"], tag="vllm" if r["vllm_is"] else "")
        if r["vllm_is"]:  # vLLM cannot run here: switch GRPOTrainer's (and TOPR's) vLLM IS correction on by hand
            trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
        inputs = bench.make_inputs(r["model"], **r["inputs"])
        results.append(bench.run(trainer, inputs, ga=r["ga"], mode=r["mode"], model=r["model"]))
    bench.pairs[r["id"]] = results
    return results


@pytest.mark.parametrize("r", params("loss"))
def test_reduces_to_grpo_loss_and_gradients(r, bench):
    (grpo_loss, grpo_grads, _), (topr_loss, topr_grads, _) = run_pair(bench, r)
    assert grpo_loss.abs() > 0
    assert_loss_close(topr_loss, grpo_loss, r["id"])
    assert_grads_close(topr_grads, grpo_grads, what=r["id"])


@pytest.mark.parametrize("r", params("metrics"))
def test_reduces_to_grpo_metrics(r, bench):
    (_, _, grpo_metrics), (_, _, topr_metrics) = run_pair(bench, r)
    missing = set(grpo_metrics) - set(topr_metrics)
    assert missing <= NOT_LOGGED_BY_TOPR, f"GRPO metrics TOPR does not log: {sorted(missing)}"
    assert_metrics_close(topr_metrics, grpo_metrics, keys=set(grpo_metrics) - NOT_LOGGED_BY_TOPR, what=r["id"])


@pytest.mark.parametrize("tool_mask", [False, True], ids=["completion_mask", "tool_mask"])
def test_inputs_exercise_the_features(tool_mask, bench):
    """Guards against a vacuous matrix: PPO clips some tokens and not others, the off-policy mask drops a
    negative-advantage sequence and keeps another (judged by old and by sampling log-probs), the tool mask removes
    tokens, TRL's two-sided clip `delta` bites, and one advantage is 0 (the sign convention at 0 matters)."""
    inputs = bench.make_inputs(old=True, ref=True, sampling=True, tool_mask=tool_mask)
    logps = inputs["_current_logps"]
    mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
    advantages = inputs["advantages"].unsqueeze(1)
    token_ratio = (logps - inputs["old_per_token_logps"]).exp()
    ratio = token_ratio[mask.bool()]
    assert ((ratio < 0.8) | (ratio > 1.28)).float().mean() > 0.2
    assert ((ratio > 0.8) & (ratio < 1.28)).any()
    assert (token_ratio[(mask.bool() & (advantages < 0))] > PPO_DELTA).any()  # two-sided clipping bites
    for behaviour in ("old_per_token_logps", "sampling_per_token_logps"):
        kept = GRPOTrainer.get_off_policy_mask(advantages, logps, inputs[behaviour], mask, OFF_POLICY_THRESHOLD)
        assert not kept[advantages < 0].all() and kept[advantages < 0].any(), behaviour
    assert inputs["advantages"].eq(0).any()
    if tool_mask:
        assert mask.sum() < inputs["completion_mask"].sum()


# ----------------------------------------------------------------------------------------- (b) TOPR's own loss
def feature(id_, base, on, loss_type="grpo", inputs=None, ga=1, model="dense", xfail=None):
    """A feature switched from the `base` config to the `on` config, on both trainers."""
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=xfail)] if xfail else []
    return pytest.param(
        dict(base=base, on=on, loss_type=loss_type, inputs=inputs or {}, ga=ga, model=model), id=id_, marks=marks
    )


FEATURES = [
    *[feature(f"beta-{lt}", OLD, {**OLD, **KL}, lt, {"ref": True}) for lt in ("grpo", "dapo")],
    *[feature(f"beta-bias_kl-{lt}", OLD, {**OLD, **BIAS_KL}, lt, {"ref": True}) for lt in AGGREGATION],
    feature("beta-bias_kl-on_policy", {}, BIAS_KL, "grpo", {"ref": True, "old": False}),
    feature("beta-bias_kl-tool_mask", OLD, {**OLD, **BIAS_KL}, "bnpo", {"ref": True, "tool_mask": True}),
    feature(
        "beta-bias_kl-is_level_sequence",
        {**OLD, "importance_sampling_level": "sequence"},
        {**OLD, **BIAS_KL, "importance_sampling_level": "sequence"},
        "grpo",
        {"ref": True},
    ),
    *[feature(f"entropy_static-{lt}", OLD, {**OLD, **ENTROPY}, lt) for lt in AGGREGATION],
    feature(
        "entropy_static-top_entropy_quantile",
        {**OLD, "top_entropy_quantile": 0.5},
        {**OLD, **ENTROPY, "top_entropy_quantile": 0.5},
        "grpo",
    ),
    feature(
        "entropy_static-grad_accumulation",
        {**OLD, **GA2},
        {**OLD, **GA2, **ENTROPY},
        "grpo",
        {"steps_per_generation": 2},
        ga=2,
    ),
    feature(
        "aux_loss", {**OLD, "router_aux_loss_coef": 0.0}, {**OLD, "router_aux_loss_coef": 0.02}, "grpo", model="moe"
    ),
    feature(
        "aux_loss-grad_accumulation",
        {**OLD, **GA2, "router_aux_loss_coef": 0.0},
        {**OLD, **GA2, "router_aux_loss_coef": 0.02},
        "dapo",
        {"steps_per_generation": 2},
        ga=2,
        model="moe",
    ),
]


@pytest.mark.parametrize("f", FEATURES)
def test_topr_loss_feature_matches_grpo(f, bench):
    """Switching the feature on changes TOPR's loss and gradients by exactly what it changes GRPO's, and the
    policy-free metrics are GRPO's."""
    inputs = bench.make_inputs(f["model"], **f["inputs"])
    results = {}
    for kind in ("grpo", "topr"):
        for state in ("base", "on"):
            trainer = bench.trainer(kind, f["loss_type"], f[state], f["model"])
            results[kind, state] = bench.run(trainer, inputs, ga=f["ga"], model=f["model"])
    loss_delta = {kind: results[kind, "on"][0] - results[kind, "base"][0] for kind in ("grpo", "topr")}
    assert loss_delta["grpo"].abs() > 1e-4, "the feature does not change GRPO's loss: the row tests nothing"
    assert_loss_change_close(loss_delta["topr"], loss_delta["grpo"], [result[0] for result in results.values()])
    grad_delta = {
        kind: {name: results[kind, "on"][1][name] - results[kind, "base"][1][name] for name in results[kind, "on"][1]}
        for kind in ("grpo", "topr")
    }
    scale = {name: torch.stack([results[key][1][name].abs().max() for key in results]) for name in grad_delta["grpo"]}
    assert_grads_close(grad_delta["topr"], grad_delta["grpo"], scale=scale, rtol=RTOL_CHANGE, what="change of")
    assert_metrics_close(results["topr", "on"][2], results["grpo", "on"][2], keys=POLICY_FREE_METRICS)


# ----------------------------------------------------------------------------------------- adaptive entropy
def test_adaptive_entropy_over_optimizer_steps(bench):
    """Four optimizer steps of two micro-batches with TRL's adaptive entropy control (Skywork-OR1): GRPO,
    TOPR reduced to GRPO, and TOPR's own loss move the coefficient identically, gate the bonus identically (the
    reduced TOPR's losses and window gradients are GRPO's; TOPR's own loss changes by GRPO's bonus), and log
    the same entropy_coef and entropy."""
    adaptive = {
        **OLD,
        **GA2,
        "use_adaptive_entropy": True,
        "entropy_coef": 0.01,
        "entropy_coef_delta": 0.02,
        "entropy_coef_min": 0.0,
        "entropy_coef_max": 0.03,
    }
    plain = {**OLD, **GA2}
    trainers = {
        (kind, name): bench.trainer(kind, "grpo", config)
        for kind in ("grpo", "ppo", "topr")
        for name, config in (("adaptive", adaptive), ("plain", plain))
    }
    windows = [
        [bench.make_inputs(seed=10 + 2 * step + micro, steps_per_generation=2) for micro in (0, 1)] for step in range(4)
    ]

    # The controller compares each window's entropy with entropy_target: put the target between the windows'
    # entropies so that the coefficient moves both up and down (and hits its bounds).
    def window_entropy(window):
        sums = torch.zeros(2)
        for inputs in window:
            trainer = trainers["grpo", "plain"]
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():
                _, entropies, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.model, ids, attention, inputs["completion_ids"].size(1), compute_entropy=True
                )
            sums += torch.stack([(entropies * inputs["completion_mask"]).sum(), inputs["completion_mask"].sum()])
        return (sums[0] / sums[1]).item()

    entropies = [window_entropy(w) for w in windows]
    target = sorted(entropies)[1]
    state = {}
    for trainer in trainers.values():
        trainer.model.load_state_dict(bench.weights["dense"])
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
        trainer.args.entropy_target = target
        trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = (
            trainer.args.entropy_coef,
            math.inf,
            None,
        )
    coefficients, bonuses = [], []
    accelerator = trainers["grpo", "plain"].accelerator  # its GradientState is process-wide: every trainer's
    try:
        for step, window in enumerate(windows):
            for trainer in trainers.values():
                trainer.model.zero_grad(set_to_none=True)
            for micro, inputs in enumerate(window):
                accelerator.sync_gradients = micro == len(window) - 1  # the optimizer steps after the last one
                clean = {k: v for k, v in inputs.items() if not k.startswith("_")}
                for key, trainer in trainers.items():
                    loss = trainer._compute_loss(trainer.model, clean)
                    loss.backward()
                    state[key] = loss.detach()
                what = f"step {step} micro-batch {micro}"
                assert_loss_close(state["ppo", "adaptive"], state["grpo", "adaptive"], what)
                bonus = {kind: state[kind, "adaptive"] - state[kind, "plain"] for kind in ("grpo", "topr")}
                bonuses.append(bonus["grpo"].item())
                assert_loss_change_close(bonus["topr"], bonus["grpo"], list(state.values()), what)
            grads = {
                key: {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
                for key, trainer in trainers.items()
            }
            assert_grads_close(grads["ppo", "adaptive"], grads["grpo", "adaptive"], what=f"step {step}")
            coefficients.append(trainers["grpo", "adaptive"].entropy_coef)
            for kind in ("ppo", "topr"):
                trainer, reference = trainers[kind, "adaptive"], trainers["grpo", "adaptive"]
                assert trainer.entropy_coef == pytest.approx(reference.entropy_coef, abs=1e-12), (kind, step)
                assert trainer._last_world_entropy == pytest.approx(reference._last_world_entropy, rel=RTOL), (
                    kind,
                    step,
                )
    finally:
        accelerator.sync_gradients = True
    # the controller went both ways, and gated the bonus off (first window: no measurement yet) and on
    assert 0.0 in bonuses and any(abs(b) > 1e-4 for b in bonuses), bonuses
    assert any(b > a for a, b in zip([0.01, *coefficients], coefficients, strict=False))
    assert any(b < a for a, b in zip([0.01, *coefficients], coefficients, strict=False))
    assert 0.0 in coefficients and 0.03 in coefficients, coefficients  # clamped at entropy_coef_min and _max
    reference = trainers["grpo", "adaptive"]._metrics["train"]
    assert len(reference["entropy_coef"]) == len(windows)  # one per optimizer step
    for kind in ("ppo", "topr"):
        assert_metrics_close(
            trainers[kind, "adaptive"]._metrics["train"], reference, keys=("entropy_coef", "entropy"), what=kind
        )
