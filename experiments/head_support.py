"""Where the time of pi's support goes in the head's part of one forward (`topr_trl.head_tiles`), and which rows it
leaves to a second projection, on a Qwen2.5-shaped model with random weights.

    python -m experiments.head_support --logit_scale 4 --top_p 0.95 --repeats 6 --output head.json
    python -m experiments.head_support --smoke      # seconds: a one-layer model, a 66,000-token vocabulary
    python -m experiments.head_support --device cuda --bf16 --prompt_length 512 --completion_length 512  # a GPU
    python -m experiments.head_support --rows_at_once 512 2048 ...   # the tiles read 512, then 2,048 rows at a time

It counts the torch calls one forward's support makes and those that read a result on the host (`torch_calls`, on
any device), and on a GPU the host synchronisations themselves (`torch.cuda.set_sync_debug_mode`): there each call
costs the host some microseconds and each synchronisation empties the device's queue.

Each repeat runs the model's forward on the same 4 x 96 random token ids (the last 64 of each scored, as
GRPOTrainer's loss scores 4 completions of 64 tokens) with TRL's fused head alone, then under `HeadTileSupport` with
the support scored (`processed`); the difference is what the support adds. Its parts are timed by wrapping the
functions that do them (the band's reading of the tiles, its members gathered, the nucleus decided on them, and
the rows projected again). The rows are then sorted by what decided them, against the sorted rule
(`_keep_top_p_sorted`) on their whole logits: the candidates, the band, or a second projection, this last because
the crossing lies under or above the band or (in it) within float rounding of 1 - p.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch

from experiments.benchmark import QWEN_COMMON, QWEN_SHAPES, qwen_config


PARTS = {  # the part's name: (module, attribute) of the function that does it
    "band's reading of the tiles": ("_NucleusBand", "read"),
    "band's members gathered": ("_NucleusBand", "members"),
    "nucleus decided on the band": (None, "nucleus_from_band"),
    "rows projected again": (None, "chunked_processed_log_probs"),
    "candidates kept": ("_TileStream", "_keep_candidates"),
}


@contextlib.contextmanager
def wrapped(targets: dict[str, tuple[str | None, str]], wrap: Callable[[Callable, str], Callable]) -> Iterator[None]:
    """Each function `targets` names ((class in `topr_trl.head_tiles`, None: the module), attribute) replaced by
    `wrap(original, name)`, restored on exit."""
    from topr_trl import head_tiles

    saved = []
    for name, (owner_name, attribute) in targets.items():
        owner = getattr(head_tiles, owner_name) if owner_name else head_tiles
        original = getattr(owner, attribute)
        saved.append((owner, attribute, original))
        setattr(owner, attribute, wrap(original, name))
    try:
        yield
    finally:
        for owner, attribute, original in saved:
            setattr(owner, attribute, original)


def timed_parts(seconds: dict[str, float], sync: Callable[[], None]):
    """Each of `PARTS` wrapped so that its wall time adds up in `seconds` (the device's queue emptied by `sync` at
    both ends), restored on exit."""

    def wrap(original: Callable, name: str) -> Callable:
        def timed(*args, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sync()
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return timed

    return wrapped(PARTS, wrap)


def build(options):
    """(model with TRL's fused head, token ids, labels) on `--device` (bf16 with `--bf16`): random weights (seed 0),
    the output embedding times `--logit_scale`, as `experiments.benchmark.build_model` builds its models."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from topr_trl.tasks.tiny import build_tokenizer

    torch.manual_seed(0)
    if options.smoke:
        config = Qwen2Config(**{**QWEN_COMMON, "vocab_size": 66_000}, hidden_size=32, num_hidden_layers=1,
                             intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    else:
        config = qwen_config(options.model, build_tokenizer())
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(options.logit_scale)
    add_fused_lm_head(model, temperature=options.temperature)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (options.sequences, options.prompt_length + options.completion_length),
                        generator=generator)
    labels = ids.clone()
    labels[:, :-options.completion_length] = -100
    model.to(options.device, dtype=torch.bfloat16 if options.bf16 else None)
    return model, ids.to(options.device), labels.to(options.device)


def movable_at_the_cut(scaled: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether a token's cumulative mass is within `TOP_P_ROUNDING` of 1 - p, what those tokens may move the log of
    the support's mass by) (N,) each, for (N, V) scaled logits, from their exact (float64) ascending cumulative
    masses, 256 rows at a time. A cut within rounding is the float rounding's (another projection of the same hidden
    states, the band's sum or the sampler's own logits may move a token there), so the log of the support's mass
    may differ from the sorted rule's by what those tokens weigh, -log(1 - their mass / p), and by no more."""
    from topr_trl.sampler_support import TOP_P_ROUNDING

    limit = 1 - top_p
    at_the_cut, mass = [], []
    for start in range(0, scaled.size(0), 256):
        ascending = scaled[start:start + 256].double().sort(dim=-1).values.softmax(dim=-1)
        within = (ascending.cumsum(dim=-1) - limit).abs() <= limit * TOP_P_ROUNDING
        at_the_cut.append(within.any(dim=-1))
        mass.append((ascending * within).sum(dim=-1))
    return torch.cat(at_the_cut), -torch.log1p(-torch.cat(mass) / top_p)


def classify(support, owner, processing, processed: torch.Tensor) -> dict[str, float]:
    """How many of the forward's scored rows each path decided, and why the band left the others: the crossing (the
    smallest logit the sorted rule keeps, on the row's whole logits) under the band or above it, a token's cumulative
    mass within rounding of 1 - p (`TOP_P_ROUNDING`), members past the limit (a row may have several reasons); and
    how far the `processed` log-probs are from the sorted rule's on the whole logits: over every row, over the rows
    within rounding (decided by the bins' sum where the tokens the cut may move are negligible, `TOP_P_NEGLIGIBLE`,
    else by the sort on a second projection, whose rounding may move them too), and beyond what the tokens within
    rounding of the cut weigh (the float32 rounding of the log-probs alone)."""
    from topr_trl.sampler_support import (
        _keep_top_p_sorted,
        head_logits,
        scaled_logits,
        with_the_sampled_token,
    )

    stream = support.streams[0]
    band = stream.band
    counts = {"rows": int(stream.rows.tokens.numel()), "projected again": support.projected_rows,
              "decided on the band": support.band_rows}
    if band is None:
        return counts
    hidden = support.captured.hidden[0][:, :-1].reshape(-1, support.captured.hidden[0].size(-1))
    scaled = scaled_logits(head_logits(owner, hidden[stream.rows.grid_index]), processing.temperature)
    kept = _keep_top_p_sorted(scaled, torch.ones_like(scaled, dtype=torch.bool), processing.top_p)
    crossing = scaled.masked_fill(~kept, torch.inf).amin(dim=-1)
    banded = band.banded
    counts.update({"banded": int(banded.sum()), "members": band.kept,
                   "crossing under the band": int((banded & (crossing < band.low)).sum()),
                   "crossing above the band": int((banded & (crossing >= band.high)).sum()),
                   "members past the limit": int(band.lost.sum())})
    at_the_cut, movable = movable_at_the_cut(scaled, processing.top_p)
    counts["a cumulative mass within rounding of 1 - p"] = int((banded & at_the_cut).sum())
    tokens = stream.rows.tokens
    expected = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - with_the_sampled_token(kept, scaled, tokens, 1.0)
    apart = (processed - expected).abs()
    counts["largest difference from the sorted rule"] = float(apart.max())
    counts["largest within rounding of 1 - p"] = float(apart[at_the_cut].max()) if bool(at_the_cut.any()) else 0.0
    counts["largest difference beyond the tokens at the cut"] = float((apart.double() - movable).clamp_min(0).max())
    probabilities = scaled.softmax(dim=-1)
    counts["likeliest token in a later tile"] = int((banded & (probabilities.argmax(dim=-1) >= 32_768)).sum())
    return counts


SYNCING = {"nonzero", "tolist", "item", "__bool__", "__int__", "__float__", "unique", "masked_select"}
"""Torch functions that read a result on the host (a size or a value), so that on an accelerator the host waits for
the device's queue to empty; also a boolean mask's indexing and `repeat_interleave` without `output_size`."""


def torch_calls(work: Callable[[], object]) -> dict[str, int]:
    """How many torch functions the support calls while `work` runs (in its reads of the tiles and its `processed`),
    and how many of them wait on the device (`SYNCING`): on any device, as a count of calls rather than a time."""
    from torch.overrides import TorchFunctionMode

    counts = {"torch calls": 0, "calls that wait on the device": 0}
    inside = [0]

    def waits(name: str, args: tuple, kwargs: dict) -> bool:
        if name in SYNCING:
            return True
        if name == "repeat_interleave":
            return "output_size" not in kwargs
        if name == "__getitem__":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in index)
        return False

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if inside[0]:
                counts["torch calls"] += 1
                counts["calls that wait on the device"] += waits(getattr(func, "__name__", ""), args, kwargs)
            return func(*args, **kwargs)

    def wrap(original: Callable, name: str) -> Callable:
        def counted(*args, **kwargs):
            inside[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] -= 1
        return counted

    with wrapped({"reads": ("_TileStream", "read"), "processed": ("HeadTileSupport", "processed")}, wrap), Count():
        work()
    return counts


def host_syncs(work: Callable[[], object]) -> int:
    """How many times `work` makes the host wait on the GPU (CUDA's sync debug mode warns at each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def run(options) -> dict:
    """The measurements at the first of `options.rows_at_once` (0: `head_tiles.rows_at_once`'s choice), and at each
    other width its times, host synchronisations and memory under `"other widths"`."""
    from topr_trl import head_tiles
    from topr_trl.head_tiles import HeadTileSupport, completion_rows
    from topr_trl.sampler_support import SamplerProcessing, fused_head_parts

    model, ids, labels = build(options)
    backbone, owner = fused_head_parts(model)
    mask = torch.ones_like(ids)
    processing = SamplerProcessing(temperature=options.temperature, top_p=options.top_p, top_k=options.top_k or None)
    cuda = options.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    chosen_width = head_tiles.rows_at_once

    def forward() -> None:
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)

    def with_support(seconds: dict[str, float] | None = None):
        with timed_parts(seconds, sync) if seconds is not None else contextlib.nullcontext():
            with HeadTileSupport(backbone, owner, processing,
                                 completion_rows(ids, mask, options.completion_length)) as support:
                forward()
            values = support.processed()
        return support, values

    def peak_added_mib(work: Callable[[], object]) -> float | None:
        """The most GPU memory `work` holds above what was allocated when it starts."""
        if not cuda:
            return None
        sync()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        work()
        sync()
        return (torch.cuda.max_memory_allocated() - resident) / 2**20

    def measure(width: int) -> tuple[dict, HeadTileSupport, torch.Tensor]:
        # an experiment's knob: how many rows of a tile are read at once (0: `rows_at_once`'s own choice)
        head_tiles.rows_at_once = (lambda tile: width) if width else chosen_width
        plain, supported, parts = [], [], []
        forward(), with_support()  # warm-up
        for _ in range(options.repeats):
            sync()
            start = time.perf_counter()
            forward()
            sync()
            plain.append(time.perf_counter() - start)
            # On a GPU the parts' timers empty the device's queue at each part: timed in a pass of their own
            seconds: dict[str, float] = {}
            start = time.perf_counter()
            support, values = with_support(None if cuda else seconds)
            sync()
            supported.append(time.perf_counter() - start)
            if cuda:
                with_support(seconds)
            parts.append(seconds)
        median_plain, median_supported = statistics.median(plain), statistics.median(supported)
        result = {"forward_s": median_plain, "forward_with_support_s": median_supported,
                  "support_added_s": median_supported - median_plain, "ratio": median_supported / median_plain,
                  "parts_s": {name: statistics.median(part.get(name, 0.0) for part in parts) for name in PARTS},
                  "peak_added_mib": {"forward": peak_added_mib(forward),
                                     "forward with the support": peak_added_mib(with_support)} if cuda else None}
        result["calls in one forward's support"] = torch_calls(with_support)
        if cuda:
            result["host syncs in one forward's support"] = host_syncs(with_support)
        return result, support, values

    widths = options.rows_at_once or [0]
    with torch.no_grad():
        result, support, values = measure(widths[0])
        result["rows"] = classify(support, owner, processing, values)
        others = {}
        for width in widths[1:]:
            other, other_support, other_values = measure(width)
            others[str(width)] = {key: other[key] for key in ("support_added_s", "ratio", "parts_s", "peak_added_mib",
                                                               "calls in one forward's support",
                                                               "host syncs in one forward's support") if key in other}
            others[str(width)].update({  # the same rows, decided the same way, to the same values
                "decided on the band": other_support.band_rows, "projected again": other_support.projected_rows,
                "largest difference from the first width": float((other_values - values).abs().max())})
    head_tiles.rows_at_once = chosen_width
    if others:
        result["other widths"] = others
    return {**result, "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a one-layer model at a 66,000-token vocabulary")
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(QWEN_SHAPES))
    parser.add_argument("--logit_scale", type=float, default=4.0)
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action="store_true", help="the model in bfloat16 (TRL's head then projects in bf16)")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--rows_at_once", type=int, nargs="+", default=[0],
                        help="read the tiles this many rows at a time (0: `head_tiles.rows_at_once`'s choice); "
                             "several: the first in full, the others' times, host syncs and memory as well")
    parser.add_argument("--output", help="write the results as JSON here")
    options = parser.parse_args()
    if options.smoke:
        options.repeats = 1
    result = run(options)
    print(f"forward {result['forward_s']:.3f} s, with the support {result['forward_with_support_s']:.3f} s "
          f"(+{result['support_added_s']:.3f} s, {result['ratio']:.3f}x), {result['device']}, "
          f"{result['threads']} threads")
    for name, seconds in result["parts_s"].items():
        print(f"  {name:<32} {seconds:.3f} s")
    for name, count in result["rows"].items():
        print(f"  {name:<40} {count:.2e}" if isinstance(count, float) else f"  {name:<40} {count}")
    for name in ("peak_added_mib", "calls in one forward's support", "host syncs in one forward's support"):
        if result.get(name) is not None:
            print(f"  {name}: {result[name]}")
    for width, other in result.get("other widths", {}).items():
        syncs = other.get("host syncs in one forward's support", "-")
        print(f"  {width} rows at once: +{other['support_added_s']:.3f} s ({other['ratio']:.3f}x), {syncs} host syncs, "
              f"memory {other['peak_added_mib']}, {other['projected again']} rows projected again, values "
              f"{other['largest difference from the first width']:.1e} from the first width's")
    if options.output:
        with open(options.output, "w") as handle:
            json.dump({**result, "options": vars(options)}, handle, indent=2)


if __name__ == "__main__":
    main()
