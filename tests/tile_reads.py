"""A recorder of how pi's support was scored, shared by the `tile_reads` fixture (tests/conftest.py) and
tests/distributed_train.py (a script under `accelerate launch`, where no fixture reaches)."""

from __future__ import annotations

from collections.abc import Callable


def recording_tile_reads(patch: Callable[[object, str, object], None]) -> list[bool]:
    """For each time pi's support is scored (`HeadTileSupport.processed`), whether every forward's tokens were read
    from TRL's fused-head tiles rather than projected again. `patch` installs the recorder (`setattr`, or pytest's
    `monkeypatch.setattr` to undo it after the test)."""
    from topr_trl.head_tiles import HeadTileSupport

    reads = []
    processed = HeadTileSupport.processed

    def recorded(self, *args, **kwargs):
        values = processed(self, *args, **kwargs)
        reads.append(self.read_from_tiles)
        return values

    patch(HeadTileSupport, "processed", recorded)
    return reads
