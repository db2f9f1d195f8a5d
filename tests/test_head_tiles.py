"""pi's support read from TRL's fused-head tiles (`topr_trl.head_tiles`) against the same support scored on a second
projection of the hidden states (`completion_processed_log_probs`), which tests/test_sampler_support.py holds to
transformers' warpers and to hand values."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM
from trl.trainer.utils import add_fused_lm_head

import topr_trl.head_tiles as head_tiles
from topr_trl import TOPRConfig, TOPRTrainer
from topr_trl.head_tiles import HeadTileSupport, completion_rows
from topr_trl.sampler_support import (
    SamplerProcessing,
    completion_processed_log_probs,
    fused_head_parts,
    head_logits,
    scaled_logits,
)

from .conftest import float32_tolerance, parity_reward, small_config_kwargs


def small_model(family: str, vocabulary: int, positions: int = 64):
    """A two-layer model with random weights: a tied Qwen2, a soft-capped Gemma2, or an untied Qwen2 whose head has
    a bias (TRL adds it to each tile in place)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=vocabulary, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions)
    if family == "gemma2_softcapped":
        return Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=8, final_logit_softcapping=3.0))
    model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=family == "qwen2_tied"))
    if family == "qwen2_head_bias":
        head = torch.nn.Linear(16, vocabulary, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.normal_(0, 1.0)
        model.lm_head = head
    with torch.no_grad():  # logits of a few units, a trained model's scale
        model.get_output_embeddings().weight.mul_(8)
    return model


def scored_both_ways(model, processing, input_ids, attention_mask, logits_to_keep, micro_batch, temperature=1.0,
                     seen=None):
    """(from the tiles, from a second projection, whether every forward was read from the tiles): GRPOTrainer's
    forwards (its labels, `micro_batch` sequences at a time) under `HeadTileSupport` (handed to `seen`, a list)."""
    add_fused_lm_head(model, temperature=temperature)
    backbone, owner = fused_head_parts(model)
    with torch.no_grad(), HeadTileSupport(backbone, owner, processing,
                                          completion_rows(input_ids, attention_mask, logits_to_keep)) as support:
        for start in range(0, input_ids.size(0), micro_batch):
            labels = input_ids[start:start + micro_batch].masked_fill(attention_mask[start:start + micro_batch] == 0,
                                                                      -100)
            labels[:, :-logits_to_keep] = -100
            model(input_ids=input_ids[start:start + micro_batch],
                  attention_mask=attention_mask[start:start + micro_batch], labels=labels, fused_lm_head=True)
    tiles = support.processed()
    if seen is not None:
        seen.append(support)
    mask = attention_mask[:, -logits_to_keep:].bool()
    projected = completion_processed_log_probs(owner, torch.cat(support.captured.hidden), input_ids, attention_mask,
                                               logits_to_keep, processing)[mask]
    return tiles, projected, support.read_from_tiles


def assert_close_but_at_the_cut(tiles, projected, support, processing, attention_mask, logits_to_keep=16, atol=2e-6):
    """`tiles` within `atol` of `projected`, plus, per scored token, what the tokens within rounding of 1 - p weigh
    (`experiments.head_support.movable_at_the_cut`, zero on most rows). A cut there is the float rounding's: the
    band leaves such a row to the sort on its own second projection, and one row's product rounds otherwise than the
    whole batch's (a CPU's kernel for a single row is another), which may keep or remove those tokens. On an Intel CPU
    the head-support smoke's row 167 did (a token of 1.3e-5 of its support)."""
    from experiments.head_support import movable_at_the_cut

    mask = attention_mask[:, -logits_to_keep:].bool()
    hidden = torch.cat(support.captured.hidden)[:, -logits_to_keep - 1:-1][mask]
    with torch.no_grad():
        scaled = scaled_logits(head_logits(support.owner, hidden), processing.temperature)
    _, movable = movable_at_the_cut(scaled, processing.top_p)
    assert bool(((tiles - projected).abs().double() <= atol + movable).all()), (tiles - projected).abs().max()

PROCESSINGS = [SamplerProcessing(top_k=3), SamplerProcessing(top_p=0.9), SamplerProcessing(top_p=0.3),
               SamplerProcessing(temperature=0.7, top_k=5, top_p=0.8), SamplerProcessing(min_p=0.2, engine="vllm"),
               SamplerProcessing(top_k=10, top_p=0.5, min_p=0.1), SamplerProcessing(temperature=0.5)]


@pytest.mark.parametrize("family", ["qwen2_tied", "gemma2_softcapped", "qwen2_head_bias"])
@pytest.mark.parametrize("processing", PROCESSINGS, ids=str)
def test_the_support_read_from_trls_tiles_is_the_second_projections(family, processing):
    """Padded prompts and completions, two forwards (micro-batches of 2 of 3 sequences): every completion token's
    log pi_S(y) from the tiles equals the one from projecting its hidden state again, up to the float32 rounding of
    the two projections (16 products each, then a log-softmax over 97 tokens), and every forward was read from the
    tiles (the kernel's rows and vocabulary chunks as `completion_rows` expects them)."""
    model = small_model(family, vocabulary=97)
    input_ids = torch.randint(0, 97, (3, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # a left-padded prompt
    attention_mask[1, -2:] = 0  # a completion that ended early
    tiles, projected, read = scored_both_ways(model, processing, input_ids, attention_mask, 5, micro_batch=2,
                                              temperature=processing.temperature)
    assert read
    assert tiles.shape == projected.shape == (3 * 5 - 2,)
    torch.testing.assert_close(tiles, projected, **float32_tolerance(projected, roundings=64))


def test_the_tiles_cover_several_vocabulary_chunks_and_token_chunks():
    """A vocabulary past TRL's 32,768-wide chunk (two tiles per token) and more scored positions than its 4,096-row
    token chunk (two token chunks): the candidates merge across tiles and the rows across chunks."""
    model = small_model("qwen2_tied", vocabulary=33_000, positions=2_200)
    input_ids = torch.randint(0, 33_000, (2, 2_100))
    attention_mask = torch.ones_like(input_ids)
    for processing in (SamplerProcessing(top_k=4), SamplerProcessing(top_p=0.9)):
        tiles, projected, read = scored_both_ways(model, processing, input_ids, attention_mask, 64, micro_batch=2)
        assert read and tiles.shape == (128,)
        torch.testing.assert_close(tiles, projected, **float32_tolerance(projected, roundings=64))


def head_lifted(model, scale: float, lift: float, vocabulary: int = 33_000, lifted: slice = slice(32_768, None)):
    """`model` (a tied Qwen2 over `vocabulary` tokens, hidden 16) with an untied head: its output embedding times
    `scale`, and a bias of `lift` on the `lifted` tokens (by default TRL's second vocabulary tile's 232, 0 elsewhere)."""
    head = torch.nn.Linear(16, vocabulary, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * scale)
        head.bias.zero_()
        head.bias[lifted] = lift
    model.config.tie_word_embeddings = False
    model.lm_head = head
    return model


@pytest.mark.parametrize("processing", [SamplerProcessing(top_k=50), SamplerProcessing(top_p=0.5),
                                        SamplerProcessing(top_k=200, top_p=0.9)], ids=str)
def test_a_later_tiles_logits_above_a_rows_smallest_candidate_enter_its_candidates(processing):
    """Peaked rows over two vocabulary tiles, whose second tile (232 tokens) a head bias lifts by 10 so that many of
    each row's largest logits are there: the candidates kept from the first tile's `topk` take the second tile's
    logits above their smallest (a comparison, not a `topk`), with the second projection's values; no row is decided
    on a band or projected again."""
    model = head_lifted(small_model("qwen2_tied", vocabulary=33_000, positions=48), scale=8, lift=10.0)
    input_ids = torch.randint(0, 33_000, (2, 40))
    attention_mask = torch.ones_like(input_ids)
    seen = []
    tiles, projected, read = scored_both_ways(model, processing, input_ids, attention_mask, 16, micro_batch=2,
                                              seen=seen)
    assert read and seen[0].band_rows == 0 and seen[0].projected_rows == 0
    logits = model.lm_head(torch.cat(seen[0].captured.hidden)[:, -17:-1].reshape(-1, 16))
    width = processing.top_k or 1024
    from_second_tile = (logits.topk(width, dim=-1).indices >= 32_768).sum(-1)
    assert bool((from_second_tile > width // 20).all())  # the second tile changes every row's candidates
    torch.testing.assert_close(tiles, projected, **float32_tolerance(projected, roundings=64))


def flat_model(vocabulary: int, positions: int):
    """A tied Qwen2 whose logits are within a few tenths of one another: every top-p nucleus of 0.5 or more holds
    thousands of tokens, past the 1,024 candidates (a random-weight model's rows, a trained model's most uncertain)."""
    model = small_model("qwen2_tied", vocabulary=vocabulary, positions=positions)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.02)
    return model


@pytest.mark.parametrize("processing", [SamplerProcessing(top_p=0.9), SamplerProcessing(top_p=0.95),
                                        SamplerProcessing(temperature=0.7, top_p=0.5)], ids=str)
def test_a_flat_rows_nucleus_is_decided_on_its_band_without_projecting_it_again(processing, monkeypatch):
    """Flat rows over two vocabulary tiles (33,000 tokens): the candidates do not reach p, and each row's nucleus is
    decided from the band of logits kept around where its ascending mass passes 1 - p (estimated on the first tile),
    with the values of the second projection (within the float32 rounding of a sum of 33,000 terms in two orders,
    relative 2^-20 of the row's mass: 1e-6 of the log). At most one row in ten is left to the second projection
    (a cumulative mass within rounding of 1 - p). The band reads a tile 7 rows at a time."""
    monkeypatch.setattr(head_tiles, "rows_at_once", lambda tile: 7)
    model = flat_model(33_000, positions=48)
    input_ids = torch.randint(0, 33_000, (4, 40))
    attention_mask = torch.ones_like(input_ids)
    seen = []
    tiles, projected, read = scored_both_ways(model, processing, input_ids, attention_mask, 16, micro_batch=2,
                                              temperature=processing.temperature, seen=seen)
    assert read and tiles.shape == (64,)
    support = seen[0]
    assert support.band_rows + support.projected_rows == 64 and support.projected_rows <= 6
    assert_close_but_at_the_cut(tiles, projected, support, processing, attention_mask)


@pytest.mark.parametrize("rows_at_once", [7, 64])
def test_the_band_keeps_each_rows_logits_in_its_band_and_its_masses_over_every_tile(rows_at_once):
    """`_NucleusBand` fed 40 rows of 3,000 logits in three tiles (1,300, 1,300, 400 columns), `rows_at_once` rows at
    a time (as `_TileStream` reads a tile), the later tiles' largest logits above the first's (the reference is
    rescaled): for each banded row, its members are exactly the row's logits in [low, high) (sorted, not one lost or
    moved by another tile's), and its whole mass and the mass under the band are those of the whole row (float32
    sums of 3,000 terms: relative 1e-5). Ten rows' last tile holds nearly all their mass: their band is placed anew
    on it, above every earlier logit, the earlier ones all under it. Rows peaked on the first tile are not banded
    and keep no members."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(40, 3_000, generator=generator) * 0.3
    rows[:, 2_600:] += 0.5  # the last tile's logits above the first's largest
    rows[20:30, 2_600:] += 12.0  # the last tile holds nearly all the mass: the band moves up onto it
    rows[30:, 7] = 40.0  # peaked rows: their nucleus is one token
    band = band_fed_in_tiles(rows, rows_at_once)
    assert band.banded[:30].all() and not band.banded[30:].any()
    earlier_largest = rows[:, :2_600].amax(dim=-1)
    assert (band.low[20:30] > earlier_largest[20:30]).all() and (band.low[:20] < earlier_largest[:20]).all()
    assert_the_band_holds_its_rows(band, rows, range(30))


def band_fed_in_tiles(rows: torch.Tensor, rows_at_once: int) -> head_tiles._NucleusBand:
    """A top-p 0.9 `_NucleusBand` fed (N, 3,000) `rows` in three tiles (1,300, 1,300, 400 columns), `rows_at_once`
    rows at a time, as `_TileStream` reads a tile."""
    band = head_tiles._NucleusBand(rows.size(0), 0.9, torch.device("cpu"))
    for lo, hi in [(0, 1_300), (1_300, 2_600), (2_600, 3_000)]:
        for start in range(0, rows.size(0), rows_at_once):
            stop = min(start + rows_at_once, rows.size(0))
            band.read(start, stop, rows[start:stop, lo:hi], column=lo, vocabulary=3_000)
    return band


def assert_the_band_holds_its_rows(band: head_tiles._NucleusBand, rows: torch.Tensor, banded) -> None:
    """Each `banded` row's members are exactly its logits in [low, high), and the band's whole mass and mass under
    the band are the row's (float32 sums of 3,000 terms in two orders: relative 1e-5)."""
    reference = rows.amax(dim=-1)
    torch.testing.assert_close(band.reference, reference, rtol=0, atol=0)
    torch.testing.assert_close(band.mass, (rows - reference[:, None]).exp().sum(-1), rtol=1e-5, atol=0)
    member_rows, members = band.members(torch.tensor(list(banded)))
    for place, row in enumerate(banded):
        low, high = band.low[row], band.high[row]
        inside = rows[row][(rows[row] >= low) & (rows[row] < high)].sort().values
        assert inside.numel() > 10
        torch.testing.assert_close(members[member_rows == place].sort().values, inside, rtol=0, atol=0)
        below = (rows[row][rows[row] < low] - reference[row]).exp().sum()
        torch.testing.assert_close(band.below[row], below, rtol=1e-5, atol=0)


def test_a_later_tile_whose_crossing_may_lie_under_the_earlier_logits_leaves_the_band_where_it_is():
    """Two rows of 3,000 logits, the first two tiles' 2,600 all 0 (mass 2,600; banded, open: every logit a member),
    the last tile's 300 at -0.1 and 100 at v. For v = 5.55 that tile holds over 1 - (1 - p - 0.004) of the mass read
    (it is considered), but its band would start under its -0.1 logits, under earlier members: the band stays, as
    read. For v = 8 it starts at the 8s, above every earlier logit: the band moves there, all 2,900 below it under
    it. Both rows' members and masses are exact."""
    rows = torch.zeros(2, 3_000)
    rows[:, 2_600:2_900] = -0.1
    rows[0, 2_900:] = 5.55
    rows[1, 2_900:] = 8.0
    for rows_at_once in (1, 2):
        band = band_fed_in_tiles(rows, rows_at_once)
        assert band.banded.all() and band.low[0] == -torch.inf and band.low[1] > 7.9
        assert_the_band_holds_its_rows(band, rows, range(2))


def two_sequences_at_top_p(model, p: float = 0.9):
    """(tiles, projected, the `HeadTileSupport`, attention mask): `scored_both_ways` at top-p `p` on 2 sequences of
    40 random tokens of `model`'s 33,000, the last 16 scored, in one forward read from the tiles."""
    input_ids = torch.randint(0, 33_000, (2, 40))
    attention_mask = torch.ones_like(input_ids)
    seen = []
    tiles, projected, read = scored_both_ways(model, SamplerProcessing(top_p=p), input_ids, attention_mask, 16,
                                              micro_batch=2, seen=seen)
    assert read
    return tiles, projected, seen[0], attention_mask


def test_rows_that_take_candidates_among_banded_ones_keep_them_when_a_later_tile_is_read_in_other_chunks(monkeypatch):
    """Under top-p, a head scaled by 5 whose bias lifts the second tile's 232 tokens by 6: 25 of the 32 rows are flat
    (banded) and 7 peaked, taking candidates, whose largest logits lie in the second tile. The first tile is read 5
    rows at a time and the second 32 at once, as a CPU reads a narrower last tile: the rows that take candidates are
    found per chunk of the later tile too: no row is projected again, and every value is the second projection's.
    Keyed by the chunk's first row alone, the second tile took the first chunk's rows for all 32, and the others,
    lacking their largest logits, were projected again."""
    monkeypatch.setattr(head_tiles, "rows_at_once", lambda tile: 5 if tile.size(-1) > 1_000 else 32)
    torch.manual_seed(0)
    model = head_lifted(small_model("qwen2_tied", vocabulary=33_000, positions=48), scale=5, lift=6.0)
    tiles, projected, support, attention_mask = two_sequences_at_top_p(model)
    banded = support.streams[0].band.banded
    assert 0 < int(banded.sum()) < banded.numel()
    # every row decided from the tiles: the peaked rows on their candidates, none sent to a second projection for
    # the candidates it lacked
    assert support.projected_rows == 0 and support.band_rows == int(banded.sum())
    assert_close_but_at_the_cut(tiles, projected, support, SamplerProcessing(top_p=0.9), attention_mask)


def test_a_band_the_later_tiles_move_the_nucleus_out_of_sends_its_rows_to_the_second_projection():
    """A head whose bias lifts the second tile's 232 tokens by 4 (e^4 = 55 times the first tile's tokens' mass each):
    the first tile misplaces where the ascending mass passes 1 - p, the band misses it, and the rows are projected
    again, with the same values as before."""
    model = head_lifted(flat_model(33_000, positions=48), scale=1, lift=4.0)
    tiles, projected, support, attention_mask = two_sequences_at_top_p(model)
    assert support.projected_rows == 32 and support.band_rows == 0
    torch.testing.assert_close(tiles, projected, **float32_tolerance(projected, roundings=64))


def test_a_row_with_a_few_thousand_tokens_above_its_band_keeps_them_all_and_its_crossing_may_move_up():
    """Rows whose first tile estimates between 512 and `OPEN_BAND_TOKENS` logits above the band's low edge, and whose
    second tile (232 tokens, lifted by 6 by a head bias) holds most of their mass, so that the crossing moves far
    above the first tile's estimate: their band is open above, keeps every logit past its low edge, and decides
    every row (none projected again) with the second projection's values. A band closed above would miss them all
    (the test above)."""
    model = head_lifted(small_model("qwen2_tied", vocabulary=33_000, positions=48), scale=4, lift=6.0)
    tiles, projected, support, attention_mask = two_sequences_at_top_p(model)
    band = support.streams[0].band
    assert bool(band.banded.all()) and bool(torch.isinf(band.high).all())
    assert support.band_rows == 32 and support.projected_rows == 0
    assert_close_but_at_the_cut(tiles, projected, support, SamplerProcessing(top_p=0.9), attention_mask)


@pytest.mark.parametrize("processing", [SamplerProcessing(top_p=0.9), SamplerProcessing(temperature=0.7, top_p=0.5)],
                         ids=str)
def test_a_later_tile_that_holds_nearly_all_of_a_rows_mass_takes_its_band(processing):
    """Flat rows over three vocabulary tiles (66,000 tokens), the second tile's 32,768 logits lifted by 12 by a head
    bias: the first tile's band lies far under the crossing, the second tile holds all but e^-12 of each row's mass,
    so the band is placed anew on it (closed: it estimates thousands of logits above its low edge), above every
    logit of the first tile, and the third tile's logits fall under it. Every row is decided on its band, but those
    within rounding of 1 - p (the flat test's one in ten), with the second projection's values; before, every row
    was projected again."""
    model = head_lifted(flat_model(66_000, positions=48), scale=1, lift=12.0, vocabulary=66_000,
                               lifted=slice(32_768, 65_536))
    input_ids = torch.randint(0, 66_000, (2, 40))
    attention_mask = torch.ones_like(input_ids)
    seen = []
    tiles, projected, read = scored_both_ways(model, processing, input_ids, attention_mask, 16, micro_batch=2,
                                              temperature=processing.temperature, seen=seen)
    support = seen[0]
    band = support.streams[0].band
    with torch.no_grad():
        logits = model.lm_head(torch.cat(support.captured.hidden)[:, -17:-1].reshape(-1, 16))
    first_tiles_largest = logits[:, :32_768].amax(dim=-1) / processing.temperature
    assert read and bool(band.banded.all()) and bool(torch.isfinite(band.high).all())
    assert bool((band.low > first_tiles_largest).all())
    assert support.band_rows + support.projected_rows == 32 and support.projected_rows <= 3
    assert_close_but_at_the_cut(tiles, projected, support, processing, attention_mask)


def test_a_first_tile_holding_a_rows_likeliest_token_places_its_band_on_the_rest_of_the_row():
    """Flat rows over three vocabulary tiles (66,000 tokens) and one token of the first tile lifted by 10.25 (about
    30 % of each row's mass). Estimated from the first tile's share alone, the crossing lies far above the row's
    (the lump would stand for twice its mass): 10 of the 32 rows were projected again. With the tile's
    `LUMP_TOKENS` largest apart from its sea, the band reaches down to the crossing, and every row is decided on its
    band (but those within rounding of 1 - p), with the second projection's values."""
    model = head_lifted(flat_model(66_000, positions=48), scale=1, lift=10.25, vocabulary=66_000, lifted=slice(5, 6))
    input_ids = torch.randint(0, 66_000, (2, 40))
    attention_mask = torch.ones_like(input_ids)
    seen = []
    tiles, projected, read = scored_both_ways(model, SamplerProcessing(top_p=0.9), input_ids, attention_mask, 16,
                                              micro_batch=2, seen=seen)
    support = seen[0]
    with torch.no_grad():
        probabilities = model.lm_head(torch.cat(support.captured.hidden)[:, -17:-1].reshape(-1, 16)).softmax(-1)
    assert bool(((probabilities[:, 5] > 0.2) & (probabilities[:, 5] < 0.4)).all())
    assert read and bool(support.streams[0].band.banded.all())
    assert support.band_rows + support.projected_rows == 32 and support.projected_rows <= 3
    assert_close_but_at_the_cut(tiles, projected, support, SamplerProcessing(top_p=0.9), attention_mask)


def test_the_first_tiles_shares_take_its_lumps_apart_from_its_sea():
    """`_first_shares` on a tile of 84 weights of 1 and 16 of 10 (its lumps) from a 300-token vocabulary at top-p
    0.9, by hand: the row's sea is 3 x 84 = 252; the crossing's share of the sea is at least 0.1 x (252 + 160) / 252
    and at most 0.1 x (252 + (3 + 0.5 x 2) x 160) / 252, each +-0.004, times the sea's share of the tile, 84 / 244."""
    band = head_tiles._NucleusBand(1, 0.9, torch.device("cpu"))
    weights = torch.cat([torch.ones(84), torch.full((16,), 10.0)]).unsqueeze(0)
    low, high = band._first_shares(weights, weights.sum(-1), vocabulary=300)
    least, most = 0.1 * 412 / 252, 0.1 * (252 + 4 * 160) / 252
    torch.testing.assert_close(low, torch.tensor([[(least - 0.004) * 84 / 244]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(high, torch.tensor([[(most + 0.004) * 84 / 244]]), rtol=1e-6, atol=0)


def test_rows_whose_band_members_pass_the_limit_alone_are_projected_again(monkeypatch):
    """Flat rows over two full vocabulary tiles (66,000 tokens), read 7 at a time, with `BAND_MEMBERS_LIMIT` at three
    quarters of the members the band keeps: the first tile's members all fit, and of the second tile's chunks those
    past the limit keep none. Only their rows (whose members are then half missing) are projected again; the rest
    are still decided on their band (before, every row of the forward was projected again), all with the second
    projection's values."""
    monkeypatch.setattr(head_tiles, "rows_at_once", lambda tile: 7)
    model = flat_model(66_000, positions=48)
    input_ids = torch.randint(0, 66_000, (4, 40))
    attention_mask = torch.ones_like(input_ids)
    processing = SamplerProcessing(top_p=0.9)
    seen = []
    scored_both_ways(model, processing, input_ids, attention_mask, 16, micro_batch=4, seen=seen)
    monkeypatch.setattr(head_tiles, "BAND_MEMBERS_LIMIT", seen[0].streams[0].band.kept * 3 // 4)
    tiles, projected, read = scored_both_ways(model, processing, input_ids, attention_mask, 16, micro_batch=4,
                                              seen=seen)
    lost = int(seen[1].streams[0].band.lost.sum())
    assert read and 16 <= lost <= 48
    assert seen[1].band_rows >= 64 - lost - 6 and seen[1].projected_rows >= lost
    assert_close_but_at_the_cut(tiles, projected, seen[1], processing, attention_mask)


def test_where_trl_projects_only_the_labelled_rows_they_are_read_in_that_order(monkeypatch):
    """On a Triton device TRL projects only the positions with a label (its `compact` rows). Here TRL's choice is
    turned on while its tiles are still folded in torch: the rows are read in that order, with the same values."""
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    monkeypatch.setattr(head_tiles, "scores_only_labelled_rows", lambda device: True)
    model = small_model("qwen2_tied", vocabulary=97)
    input_ids = torch.randint(0, 97, (3, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, -3:] = 0
    tiles, projected, read = scored_both_ways(model, SamplerProcessing(top_k=3), input_ids, attention_mask, 5, 3)
    assert read
    torch.testing.assert_close(tiles, projected, **float32_tolerance(projected, roundings=64))


def test_without_trls_tiles_the_hidden_states_are_projected_again_and_the_run_says_so(monkeypatch):
    """A forward that does not go through TRL's fused head (the model's own logits) leaves no tiles: every token is
    then scored on a second projection, the same values, and a warning says the time it costs."""
    said = []
    monkeypatch.setattr(head_tiles.logger, "warning_once", said.append)
    model = small_model("qwen2_tied", vocabulary=97)
    input_ids = torch.randint(0, 97, (2, 10))
    attention_mask = torch.ones_like(input_ids)
    backbone, owner = fused_head_parts(model)
    processing = SamplerProcessing(top_k=3)
    with torch.no_grad(), HeadTileSupport(backbone, owner, processing,
                                          completion_rows(input_ids, attention_mask, 4)) as support:
        model(input_ids=input_ids, attention_mask=attention_mask)
    values = support.processed()
    assert not support.read_from_tiles and len(said) == 1 and "again" in said[0]
    projected = completion_processed_log_probs(owner, support.captured.hidden[0], input_ids, attention_mask, 4,
                                               processing).flatten()
    assert torch.equal(values, projected)


def test_the_trainer_reads_the_support_from_the_tiles_and_projects_nothing_again(tiny_model_path, arithmetic_dataset,
                                                                                 tmp_path, monkeypatch, tile_reads):
    """A TOPR step on data two generations old under top_k 3: every loss call reads pi's support from TRL's tiles,
    and no token is projected through the output layer a second time."""
    projections = []
    projected = head_tiles.chunked_processed_log_probs
    monkeypatch.setattr(head_tiles, "chunked_processed_log_probs",
                        lambda *a, **k: projections.append(1) or projected(*a, **k))
    args = TOPRConfig(**small_config_kwargs(tmp_path, top_k=3, max_steps=2, steps_per_generation=2))
    TOPRTrainer(model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset).train()
    assert tile_reads and all(tile_reads) and projections == []
