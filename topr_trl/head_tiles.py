"""pi's support read from the logits TRL's fused head projects anyway, instead of projecting them a second time.

TRL 1.16's fused head (`add_fused_lm_head`, `ChunkedLogProbFunction`) never holds a row's logits whole: it projects
`torch.mm(hidden_chunk, weight_chunk.T, out=tile)` one [tokens, vocabulary chunk] tile at a time and folds each tile
into its log-probs. Scoring pi on mu's support needs, per token, the largest logits, the sampled token's logit and
(top-p alone) the row's total mass: all three fold over vocabulary chunks as the log-probs do. `HeadTileSupport`
reads each tile as TRL's kernel produces it, through a `TorchFunctionMode` that is active only between the end of
the backbone's forward and the start of the next (the head's part of each forward), and keeps those three per token.
The second projection through the output layer, the support's largest cost on a CPU (0.42 of its 0.55 s in a loss
call at the Qwen2.5-0.5B shape, docs/benchmarks.md), is gone; what remains is the candidates' `topk` on the first
tile and a comparison on the later ones. A tile is read a few rows at a time (`rows_at_once`).

Under top-p alone a flat row's nucleus runs past any candidate set (most of a random-weight model's rows, a trained
model's most uncertain ones). For such a row, marked on its first vocabulary tile, the tiles keep instead the logits
in a band of values around where its ascending mass passes 1 - p (open above where that keeps at most 4,096 of
them), and its mass under the band (`_NucleusBand`): at the end the band's tokens fall into value bins, the bin
where the ascending mass passes 1 - p alone is sorted, and the nucleus is cut as the sorted rule cuts it
(`nucleus_from_band`). Rows neither decides (a band the later tiles moved the crossing out of, a cumulative mass
within rounding of 1 - p where the cut may move a token heavier than `TOP_P_NEGLIGIBLE` of the support, ties past
the candidates) are projected again, alone, and decided on their whole vocabulary (`chunked_processed_log_probs`,
whose top-p sorts only such rows). Where the tiles are not the ones expected (another head, a
TRL that projects otherwise), every row is projected again and the run says so once: the values are the same either
way, up to the float32 rounding of two tilings of one product (tests/test_head_tiles.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from transformers.utils import logging
from trl.kernels import chunked_logprob

from .sampler_support import (
    NUCLEUS_BAND_SHARE,
    SUPPORT_CANDIDATES,
    CapturedBackbone,
    SamplerProcessing,
    candidate_width,
    chunked_processed_log_probs,
    head_transform,
    mass_weights,
    needs_whole_row_mass,
    normaliser_of_candidates,
    nucleus_band_applies,
    nucleus_from_band,
    padded_by_row,
    scaled_logits,
    share_band,
)


logger = logging.get_logger(__name__)


class CallRows(NamedTuple):
    """The tokens one forward of the head scores, as TRL's kernel orders them: `grid_index` (N,) the position of each
    wanted token in the flattened (B * L', H) hidden grid the head projects (L' = L - 1 when the labels are shifted),
    `tokens` (N,) its label, `kernel_rows` (N,) its row in the kernel (None: the kernel's rows are exactly these, in
    order), `kernel_row_count` how many rows the kernel projects, and `shifted` whether the grid is hidden[:, :-1]."""

    grid_index: torch.Tensor
    tokens: torch.Tensor
    kernel_rows: torch.Tensor | None
    kernel_row_count: int
    shifted: bool


def scores_only_labelled_rows(device: torch.device) -> bool:
    """MIRROR of TRL 1.16's choice in `add_fused_lm_head` (trl/trainer/utils.py: `compact = _use_triton(device)`):
    on Triton devices the kernel projects only the positions with a label, elsewhere every position of the grid."""
    return chunked_logprob._use_triton(device)


def completion_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
                    ) -> Callable[[int, torch.Tensor], CallRows]:
    """`CallRows` of GRPOTrainer's forwards over `input_ids[start:start + B]`: MIRROR of the labels
    `GRPOTrainer._get_per_token_logps_and_entropies` (trl/trainer/grpo_trainer.py) passes to the fused head (padding
    and every position before the last `logits_to_keep` at -100, shifted by one)."""

    def rows(start: int, hidden: torch.Tensor) -> CallRows:
        batch = hidden.size(0)
        ids, mask = input_ids[start:start + batch], attention_mask[start:start + batch]
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        labels = labels[:, 1:].reshape(-1).to(hidden.device)
        labelled = labels != -100
        grid_index = labelled.nonzero().squeeze(-1)
        compact = scores_only_labelled_rows(hidden.device)
        return CallRows(grid_index, labels[grid_index], None if compact else grid_index,
                        grid_index.numel() if compact else labels.numel(), shifted=True)

    return rows


def packed_rows(shift_labels: torch.Tensor, token_index: torch.Tensor) -> Callable[[int, torch.Tensor], CallRows]:
    """`CallRows` of AsyncGRPOTrainer's packed forward: the head scores the packed row's `shift_labels` unshifted,
    and the trained tokens are the grid positions `token_index`, ascending. A trained token without a label (which
    the kernel would not project where it scores only labelled rows) sends the forward to the second projection."""

    def rows(start: int, hidden: torch.Tensor) -> CallRows:
        labels = shift_labels.reshape(-1).to(hidden.device)
        grid_index = token_index.to(hidden.device)
        labelled = labels != -100
        if not scores_only_labelled_rows(hidden.device):
            return CallRows(grid_index, labels[grid_index], grid_index, labels.numel(), shifted=False)
        if not bool(labelled[grid_index].all()):
            return CallRows(grid_index, labels[grid_index], grid_index, -1, shifted=False)
        return CallRows(grid_index, labels[grid_index], (labelled.cumsum(0) - 1)[grid_index], int(labelled.sum()),
                        shifted=False)

    return rows


BAND_MEMBERS_LIMIT = 2**25
"""The most logits `_NucleusBand` keeps for one forward (128 MB in float32), a quarter of one of TRL's 4,096 x 32,768
tiles; the rows whose members would pass it are projected again."""


LUMP_TOKENS = 16
"""The largest logits of a row's first vocabulary tile that `_NucleusBand` counts as its lumps: a few tokens that
hold a large share of the row's mass (a trained model's likeliest), where the rest of the tile (its sea) samples the
row's many small tokens. A lump is in one tile only, so the first tile's share of the row's mass says little about
the lumps' share: the band's edges treat the two apart."""


LATER_LUMPS = 0.5
"""How much more lump mass than their share (the first tile's lumps times the later tiles' size over its) the band's
upper edge allows the later tiles to hold: 0.5 is one and a half times that share. On a random-weight
Qwen2.5-0.5B's 256 rows at `--logit_scale 4` (likeliest tokens of 1-12 % of the mass), top-p 0.95: the crossing
falls in the band on 210 rows with the lumps not apart, 232 / 249 / 255 with them apart and 0 / 0.5 / 1, for 3,700
/ 6,700 / 8,100 / 9,300 members per row (docs/benchmarks.md)."""


OPEN_BAND_TOKENS = 4096
"""A banded row estimated (on its first tile) to have at most this many logits above its band's low edge keeps them
all, the band open above (16 KB per row): the later tiles may move its crossing up anywhere."""


ROWS_AT_ONCE = 512
"""How many of a tile's wanted rows `_TileStream` reads at once on an accelerator: the temporaries (the rows' weights
in the band, and on a first tile their int64 bins) stay at 512 x 32,768 values, an eighth of TRL's tile."""


CPU_ELEMENTS_AT_ONCE = 2**20
"""How many logits `_TileStream` reads at once on a CPU (4 MB of float32, 32 rows of a 32,768-token tile): the band's
passes over a tile then run in cache instead of streaming 64 MB temporaries through memory, which took its reading
from 0.46 to 0.18 s per 256 flat rows at the Qwen2.5-0.5B head (docs/benchmarks.md)."""


def rows_at_once(tile: torch.Tensor) -> int:
    """How many wanted rows of `tile` `_TileStream` reads at once (`CPU_ELEMENTS_AT_ONCE`, `ROWS_AT_ONCE`)."""
    if tile.device.type == "cpu":
        return max(1, CPU_ELEMENTS_AT_ONCE // max(1, tile.size(-1)))
    return ROWS_AT_ONCE


class _NucleusBand:
    """Under top-p alone, each wanted token's whole mass, and what decides a flat row's nucleus without projecting
    it again: the scaled logits in a band of values around where its ascending mass passes 1 - p (`share_band` on
    its first vocabulary tile, +-`NUCLEUS_BAND_SHARE`) and the mass under the band. Masses are in units of
    exp(`reference`), the largest logit read so far (rescaled as a larger one comes, as an online logsumexp). A row
    whose first tile puts its nucleus within the candidates gets no band (`banded` False: a peaked row's band would
    be its long tail) and takes the candidates; a banded row takes none. A banded row with at most
    `OPEN_BAND_TOKENS` logits above the band's low edge keeps them all (`high` inf). A later tile that holds nearly
    all the mass read so far (a likeliest token far above the first tile's logits) takes the band where its own
    crossing lies above every earlier logit (`_move_up`). Where the later tiles move a row's crossing out of its
    band otherwise (`nucleus_from_band` leaves it undecided), it is projected again."""

    def __init__(self, wanted: int, p: float, device: torch.device):
        self.p = p
        self.reference = torch.full((wanted,), -torch.inf, device=device)
        self.low = torch.full((wanted,), torch.inf, device=device)
        self.high = torch.full((wanted,), torch.inf, device=device)
        self.banded = torch.zeros(wanted, dtype=torch.bool, device=device)
        self.below = torch.zeros(wanted, device=device)
        self.mass = torch.zeros(wanted, device=device)
        # The members, in the order read (each chunk of rows row-major); per chunk its first row, and per row of it
        # how many of its members the chunk holds.
        self.values: list[torch.Tensor] = []
        self.first_rows: list[int] = []
        self.counts: list[torch.Tensor] = []
        self.kept = 0
        self.lost = torch.zeros(wanted, dtype=torch.bool, device=device)  # rows with members past the limit
        self.moved = torch.zeros(wanted, dtype=torch.bool, device=device)  # rows whose band `_move_up` placed anew

    def read(self, lo: int, hi: int, scaled: torch.Tensor, column: int, vocabulary: int) -> None:
        """Rows lo:hi of the vocabulary tile at `column` (its scaled logits)."""
        earlier_reference = self.reference[lo:hi].clone()
        reference = torch.maximum(earlier_reference, scaled.amax(dim=-1))
        rescale = (earlier_reference - reference).exp()
        self.mass[lo:hi] *= rescale
        self.below[lo:hi] *= rescale
        self.reference[lo:hi] = reference
        weights = mass_weights(scaled, reference.unsqueeze(-1))
        tile_mass = weights.sum(dim=-1)
        if column == 0:
            low, high, estimated = self._edges(scaled, *self._first_shares(weights, tile_mass, vocabulary), vocabulary)
            # a row whose nucleus the first tile puts within the candidates takes them, no band
            banded = estimated > SUPPORT_CANDIDATES / 2
            self.banded[lo:hi] = banded
            self.low[lo:hi] = torch.where(banded, low, torch.inf)
            self.high[lo:hi] = high
        else:
            self._move_up(lo, hi, scaled, earlier_reference, tile_mass, vocabulary - column)
        self.mass[lo:hi] += tile_mass
        # Masks multiply and combine as uint8: a CPU's bool `masked_fill_` and `&` take 4 and 20 times as long as a
        # product and an `&` of the same bytes as uint8 (1 M logits: 2.4 against 0.6 ms, 0.65 against 0.03 ms).
        under = (scaled < self.low[lo:hi].unsqueeze(-1)).view(torch.uint8)
        self.below[lo:hi] += weights.mul_(under).sum(dim=-1)
        inside = (scaled < self.high[lo:hi].unsqueeze(-1)).view(torch.uint8) & (1 - under)
        row, token = inside.nonzero(as_tuple=True)  # row-major: each row's members in a run
        counts = torch.bincount(row, minlength=hi - lo)
        if self.kept + row.numel() > BAND_MEMBERS_LIMIT:  # these rows' members are not kept: they are undecided
            self.lost[lo:hi] |= counts > 0
            return
        self.kept += row.numel()
        self.values.append(scaled[row, token])
        self.first_rows.append(lo)
        self.counts.append(counts)

    def _first_shares(self, weights: torch.Tensor, tile_mass: torch.Tensor, vocabulary: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(low, high) (N, 1): the shares of each row's first tile's mass between which the row's crossing is
        expected, +-`NUCLEUS_BAND_SHARE`. The tile's `LUMP_TOKENS` largest weights are its lumps, the rest its sea,
        which stands for the row's (the vocabulary's size over the tile's times as much). The crossing lies where
        the row's sea under it is 1 - p of the row's mass: at least that of the sea and this tile's lumps (no later
        tile holds any), and at most with the later tiles holding `LATER_LUMPS` + 1 times their share of lumps."""
        many = vocabulary / weights.size(-1)
        lumps = weights.topk(min(LUMP_TOKENS, weights.size(-1)), dim=-1).values.sum(dim=-1)
        tile_sea = tile_mass - lumps
        sea = many * tile_sea
        least = (1 - self.p) * (sea + lumps) / sea
        most = (1 - self.p) * (sea + (many + LATER_LUMPS * (many - 1)) * lumps) / sea
        in_tile = tile_sea / tile_mass  # a share of the sea as one of the tile
        low = torch.where(tile_sea > 0, (least - NUCLEUS_BAND_SHARE) * in_tile, 1 - self.p - NUCLEUS_BAND_SHARE)
        high = torch.where(tile_sea > 0, (most + NUCLEUS_BAND_SHARE) * in_tile, 1 - self.p + NUCLEUS_BAND_SHARE)
        return low.clamp(0, 1).unsqueeze(-1), high.clamp(0, 1).unsqueeze(-1)

    @staticmethod
    def _edges(scaled: torch.Tensor, low_share: float | torch.Tensor, high_share: float | torch.Tensor,
               remaining: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(low, high, estimated) (N,): a band around where each row's ascending mass passes `low_share` and
        `high_share` of it (`share_band`), open above (high inf) where the `remaining` vocabulary (this tile's and
        the later ones') is estimated from this tile to hold at most `OPEN_BAND_TOKENS` logits above the low edge,
        and that estimate."""
        low, high = share_band(scaled, low_share, high_share)
        estimated = (scaled >= low.unsqueeze(-1)).sum(-1) * (remaining / scaled.size(-1))
        return low, torch.where(estimated > OPEN_BAND_TOKENS, high, torch.inf), estimated

    def _move_up(self, lo: int, hi: int, scaled: torch.Tensor, earlier_reference: torch.Tensor,
                 tile_mass: torch.Tensor, remaining: int) -> None:
        """A banded row of which this later tile holds so much of the mass read so far (a few logits far above the
        earlier tiles': a trained model's likeliest token) that its crossing may lie above every earlier logit: its
        band is placed anew on this tile, the earlier tiles' whole mass taken as under it. Where this tile's band
        does start above every earlier logit, the mass under it is exact and the earlier members lie under it
        (`members` leaves them out); elsewhere the band stays."""
        earlier = self.mass[lo:hi]  # the earlier tiles' mass, in this tile's units
        read = earlier + tile_mass

        def share_of_tile(share: float) -> torch.Tensor:  # a share of the mass read so far, as one of this tile's
            return (share * read - earlier) / tile_mass

        low_share = share_of_tile(1 - self.p - NUCLEUS_BAND_SHARE)
        rows = (self.banded[lo:hi] & (low_share > 0)).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return
        high_share = share_of_tile(1 - self.p + NUCLEUS_BAND_SHARE)
        low, high, _ = self._edges(scaled[rows], low_share[rows].unsqueeze(-1), high_share[rows].unsqueeze(-1),
                                   remaining)
        moved = low > earlier_reference[rows]
        target = rows[moved] + lo
        self.low[target], self.high[target], self.below[target] = low[moved], high[moved], earlier[rows[moved]]
        self.moved[target] = True

    @property
    def total(self) -> torch.Tensor:
        """The logsumexp of each wanted token's whole scaled row."""
        return self.reference + self.mass.log()

    def members(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, value) (K,) each: the band's scaled logits of the wanted tokens `index`, each with its place in
        `index`, in the order read."""
        device = self.mass.device
        position = torch.full_like(self.mass, -1, dtype=torch.int32)  # int32: 4 bytes a member, as its value
        position[index] = torch.arange(index.numel(), device=device, dtype=torch.int32)
        values = torch.cat(self.values)
        # each member's wanted token, all chunks at once: the chunks' rows are known here, their members' count is
        # `kept`, so nothing waits on the device (a loop over the chunks waited twice per chunk)
        chunk_rows = torch.cat([torch.arange(lo, lo + counts.numel(), dtype=torch.int32)
                                for lo, counts in zip(self.first_rows, self.counts, strict=True)]).to(device)
        member_rows = chunk_rows.repeat_interleave(torch.cat(self.counts), output_size=values.numel())
        places = position[member_rows]
        if bool((position < 0).any() | self.moved.any()):
            # rows not asked for; a band placed anew on a later tile (`_move_up`) starts above every earlier member (a
            # row's other members are at or above its low edge, which only `_move_up` changes)
            kept = (places >= 0) & (values >= self.low[member_rows])
            places, values = places[kept], values[kept]
        return places, values

    def normalisers(self, index: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`nucleus_from_band` for the wanted tokens `index` (their sampled tokens' scaled logits `chosen`)."""
        if not self.values:
            return torch.zeros_like(chosen), torch.ones_like(chosen, dtype=torch.bool)
        normaliser, undecided = nucleus_from_band(*self.members(index), self.below[index], self.mass[index],
                                                  self.reference[index], chosen, self.p)
        return normaliser, undecided | self.lost[index]


class _TileStream:
    """What one forward's tiles leave per wanted token: its largest `width` logits (as projected, descending once
    complete; -inf for a row decided on its band), its own logit, and (top-p) the logsumexp of its whole scaled row
    (`whole_row_total`)."""

    def __init__(self, rows: CallRows, processing: SamplerProcessing, width_of: Callable[[int], int]):
        self.rows, self.processing, self.width_of = rows, processing, width_of
        self.top: torch.Tensor | None = None
        self.chosen: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.band: _NucleusBand | None = None
        self.row, self.column, self.broken = 0, 0, False
        self.vocabulary = 0
        # per chunk of rows (lo, hi): the rows that take candidates (None: every row), found once `banded` is decided
        # (on the first vocabulary tile) and read again by the later tiles chunked alike, without asking the device
        # (a narrower last tile is read more rows at a time on a CPU, in chunks of its own)
        self.unbanded: dict[tuple[int, int], torch.Tensor | None] = {}

    def read(self, tile: torch.Tensor, bias: torch.Tensor | None, vocabulary: int,
             transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        n, w = tile.shape
        self.vocabulary = vocabulary
        if self.column + w > vocabulary or self.row + n > self.rows.kernel_row_count:
            self.broken = True
        if self.broken:
            return
        if self.top is None:
            wanted = self.rows.tokens.numel()
            self.top = tile.new_full((wanted, self.width_of(vocabulary)), -torch.inf)
            self.chosen = torch.zeros(wanted, dtype=torch.float32, device=tile.device)
            if nucleus_band_applies(self.processing):
                self.band = _NucleusBand(wanted, self.processing.top_p, tile.device)
            elif needs_whole_row_mass(self.processing):
                self.total = torch.full((wanted,), -torch.inf, dtype=torch.float32, device=tile.device)
        if self.rows.kernel_rows is None:
            lo, hi, local = self.row, self.row + n, None
        else:
            lo, hi = torch.searchsorted(self.rows.kernel_rows,
                                        torch.tensor([self.row, self.row + n], device=tile.device)).tolist()
            local = self.rows.kernel_rows[lo:hi] - self.row  # the wanted rows' places in the tile, ascending
        self._read_chosen(lo, hi, tile, local, bias)
        at_once = rows_at_once(tile)
        chunks = [(start, min(start + at_once, hi)) for start in range(lo, hi, at_once)]  # a few rows at a time
        if local is not None and chunks:  # each chunk's first and last row in the tile, with one device sync
            ends = local[torch.tensor([[start - lo, stop - 1 - lo] for start, stop in chunks],
                                      device=local.device)].tolist()
        for number, (start, stop) in enumerate(chunks):
            if local is None:
                logits = tile[start - lo:stop - lo]
            else:
                first, last = ends[number]
                contiguous = last - first == stop - start - 1  # a view of the tile, not a copy
                logits = tile[first:last + 1] if contiguous else tile[local[start - lo:stop - lo]]
            self._read_rows(start, stop, logits, bias, vocabulary, transform)
        self.column += w
        if self.column == vocabulary:
            self.row, self.column = self.row + n, 0

    def _read_chosen(self, lo: int, hi: int, tile: torch.Tensor, local: torch.Tensor | None,
                     bias: torch.Tensor | None) -> None:
        """The sampled tokens' own logits, for the wanted tokens lo:hi (their rows of the tile: `local`, None: in
        order) whose token lies in this tile: all of the tile's rows at once, a few kernels per tile rather than per
        chunk of rows (on an accelerator each launch costs the host some microseconds while the device waits)."""
        w = tile.size(-1)
        token = self.rows.tokens[lo:hi] - self.column
        inside = (token >= 0) & (token < w)
        token = token.clamp(0, w - 1)
        rows = torch.arange(hi - lo, device=tile.device) if local is None else local
        own = tile[rows, token]
        if bias is not None:  # TRL adds the bias to the tile in place after the product, in the tile's dtype
            own = own + bias[self.column + token].to(tile.dtype)
        self.chosen[lo:hi] = torch.where(inside, own.float(), self.chosen[lo:hi])

    def _read_rows(self, lo: int, hi: int, logits: torch.Tensor, bias: torch.Tensor | None, vocabulary: int,
                   transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Wanted tokens lo:hi, whose rows of the tile are `logits`."""
        w = logits.size(-1)
        if bias is not None:  # TRL adds the bias to the tile in place after the product, in the tile's dtype
            logits = logits + bias[self.column:self.column + w].to(logits.dtype)
        if self.band is not None or self.total is not None:
            scaled = scaled_logits(transform(logits), self.processing.temperature)
            if self.band is not None:
                self.band.read(lo, hi, scaled, self.column, vocabulary)
            else:
                self.total[lo:hi] = torch.logaddexp(self.total[lo:hi], scaled.logsumexp(dim=-1))
        self._keep_candidates(lo, hi, logits)

    def _keep_candidates(self, lo: int, hi: int, logits: torch.Tensor) -> None:
        """Merge the largest logits of rows lo:hi of this tile into `top`, but for rows decided on their band. On a
        later vocabulary tile only a row's logits above its smallest candidate so far can enter: they are picked by a
        comparison (on a peaked row, a few hundred of 32,768), not by a `topk` of the whole tile's row."""
        rows = None
        if self.band is not None:
            if (lo, hi) not in self.unbanded:
                banded = self.band.banded[lo:hi]
                self.unbanded[lo, hi] = (~banded).nonzero().squeeze(-1) if bool(banded.any()) else None
            rows = self.unbanded[lo, hi]
        if rows is not None:
            if rows.numel() == 0:
                return
            logits = logits[rows]
        width = self.top.size(-1)
        target = slice(lo, hi) if rows is None else rows + lo
        current = self.top[target]
        if self.column == 0:
            entering = logits.topk(min(width, logits.size(-1)), dim=-1).values
        else:
            row, column = (logits > current[:, -1:]).nonzero(as_tuple=True)
            if row.numel() == 0:
                return
            entering = padded_by_row(row, logits[row, column], current.size(0), -torch.inf)
        self.top[target] = torch.cat([current, entering], dim=-1).topk(width, dim=-1).values

    @property
    def whole_row_total(self) -> torch.Tensor | None:
        """The logsumexp of each wanted token's whole scaled row, where top-p needs it (else None)."""
        return self.band.total if self.band is not None else self.total

    @property
    def complete(self) -> bool:
        return not self.broken and self.row == self.rows.kernel_row_count and self.column == 0 and (
            self.top is not None or self.rows.tokens.numel() == 0)


class _HeadTileMode(TorchFunctionMode):
    """Hands each `torch.mm(hidden_chunk, weight_chunk.T, out=tile)` of the head's part of a forward to its reader."""

    def __init__(self, reader: HeadTileSupport):
        super().__init__()
        self.reader = reader

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.mm and kwargs.get("out") is not None and len(args) == 2:
            self.reader.read_tile(args[0], args[1], kwargs["out"])
        return result


class HeadTileSupport:
    """For the block it wraps: the backbone's hidden states of each forward (`captured`, as `captured_outputs` gives
    them), and pi's processed log-probs on mu's support for the tokens `rows_of_call(start, hidden)` names, read from
    TRL's fused head's tiles (`processed`). `start` counts the sequences of the earlier forwards of the block."""

    def __init__(self, backbone: torch.nn.Module, owner: torch.nn.Module, processing: SamplerProcessing,
                 rows_of_call: Callable[[int, torch.Tensor], CallRows]):
        self.backbone, self.owner, self.processing, self.rows_of_call = backbone, owner, processing, rows_of_call
        self.captured = CapturedBackbone([], [])
        self.streams: list[_TileStream] = []
        self.transform = head_transform(owner)
        self.band_rows = 0  # undecided rows decided on their nucleus band
        self.projected_rows = 0  # rows projected through the output layer again
        self._mode: _HeadTileMode | None = None
        self._handles = []

    def __enter__(self) -> HeadTileSupport:
        self._handles = [self.backbone.register_forward_pre_hook(lambda *_: self._leave_head()),
                         self.backbone.register_forward_hook(self._enter_head)]
        return self

    def __exit__(self, *exc) -> None:
        self._leave_head()
        for handle in self._handles:
            handle.remove()

    def _enter_head(self, _module, _inputs, output) -> None:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        hidden = hidden.detach()
        device = hidden.device.type
        start = sum(earlier.size(0) for earlier in self.captured.hidden)
        self.captured.hidden.append(hidden)
        self.captured.autocast_dtypes.append(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                                             else None)
        self.streams.append(_TileStream(self.rows_of_call(start, hidden), self.processing, self._width))
        self._leave_head()
        self._mode = _HeadTileMode(self)
        self._mode.__enter__()

    def _width(self, vocabulary: int) -> int:
        return candidate_width(self.processing, SUPPORT_CANDIDATES, vocabulary)

    def _leave_head(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def read_tile(self, hidden_chunk: torch.Tensor, weight_chunk: torch.Tensor, tile: torch.Tensor) -> None:
        head = self.owner.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if hasattr(weight, "full_tensor"):  # FSDP2's DTensor: TRL projects the gathered head
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None else None
        vocabulary, size = weight.shape
        if (hidden_chunk.dim() != 2 or weight_chunk.dim() != 2 or hidden_chunk.size(1) != size
                or weight_chunk.size(0) != size or tile.shape != (hidden_chunk.size(0), weight_chunk.size(1))):
            return  # not the head's product
        with torch.no_grad():
            self.streams[-1].read(tile, bias.detach() if bias is not None else None, vocabulary, self.transform)

    @property
    def read_from_tiles(self) -> bool:
        """Whether every forward's tokens were read from TRL's tiles (else they were projected again)."""
        return all(stream.complete for stream in self.streams)

    def processed(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """log pi_S(y) of every wanted token of every forward, in order (N,): from the tiles, and for the rows they
        leave undecided, or every row of a forward whose tiles were not TRL's expected ones, from the hidden states
        projected again in `dtype` (`CapturedBackbone.head_dtype`)."""
        values = [self._processed_call(stream, hidden, dtype)
                  for stream, hidden in zip(self.streams, self.captured.hidden, strict=True)]
        if not self.read_from_tiles:
            logger.warning_once("pi's support was scored by projecting the hidden states through the output layer "
                                "again: TRL's fused head did not project the tiles expected (the values are the same, "
                                "the time is one more projection per loss call).")
        if not values:
            return torch.zeros(0)
        return torch.cat([value.to(values[0].device) for value in values])

    def _processed_call(self, stream: _TileStream, hidden: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        rows = stream.rows
        grid = (hidden[:, :-1] if rows.shifted else hidden).reshape(-1, hidden.size(-1))

        def projected(index: torch.Tensor, candidates: int | None = None) -> torch.Tensor:
            self.projected_rows += index.numel()
            return chunked_processed_log_probs(self.owner, grid[rows.grid_index[index].to(grid.device)],
                                               rows.tokens[index], self.processing, dtype,
                                               candidates).to(rows.tokens.device)

        if rows.tokens.numel() == 0:
            return torch.zeros(0, device=rows.tokens.device)
        if not stream.complete:
            return projected(torch.arange(rows.tokens.numel(), device=rows.tokens.device))
        temperature = self.processing.temperature
        values = scaled_logits(self.transform(stream.top), temperature)
        chosen = scaled_logits(self.transform(stream.chosen), temperature)
        normaliser, undecided = normaliser_of_candidates(values, chosen, stream.whole_row_total,
                                                         stream.top.size(-1) >= stream.vocabulary, self.processing)
        if stream.band is not None:
            undecided |= stream.band.banded  # no candidates kept
        result = chosen - normaliser
        # The rows the tiles' candidates leave undecided (a flat row under top-p) are decided on their band where
        # they have one, else on their whole vocabulary projected again.
        index = undecided.nonzero().squeeze(-1)
        if index.numel() and stream.band is not None:
            from_band, still = stream.band.normalisers(index, chosen[index])
            result[index] = torch.where(still, result[index], chosen[index] - from_band)
            self.band_rows += int((~still).sum())
            index = index[still]
        if index.numel():
            result[index] = projected(index, candidates=0)
        return result
