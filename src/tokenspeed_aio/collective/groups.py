"""The fixed rank groups of one rank, from the engine's parallel layout."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    """The fixed groups ``rank`` belongs to, for ``tp * dp`` ranks (build with ``Ranks.build``).

    Rank ``r`` is TP rank ``r % tp`` of DP replica ``r // tp``; with tp=2, dp=2::

                      tp_rank 0   tp_rank 1
        replica 0       rank 0      rank 1      <- a replica: one scheduler, one frontend
        replica 1       rank 2      rank 3         owner (its first rank)
                          ^-- a DP column: one rank per replica

    Every group is a tuple of global ranks in ascending order, the same on every member, so
    ``mesh.group(ranks.replica)`` names the same group everywhere. Pipeline and EP groups join
    as further properties of this layout (a pipeline stage index between replica and TP rank).
    """

    rank: int
    tp: int
    dp: int

    @classmethod
    def build(cls, rank: int, world_size: int, tp: int, dp: int) -> Ranks:
        """The groups of ``rank``; raises ValueError unless ``world_size == tp * dp``."""
        if tp < 1 or dp < 1:
            raise ValueError(f"tp and dp must be at least 1, got tp={tp}, dp={dp}")
        if world_size != tp * dp:
            raise ValueError(f"world_size {world_size} != tp {tp} * dp {dp}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
        return cls(rank, tp, dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        """Which replica this rank belongs to."""
        return self.rank // self.tp

    @property
    def replica(self) -> tuple[int, ...]:
        """The attention-TP group: the ranks that run this replica's scheduler together."""
        first = self.dp_rank * self.tp
        return tuple(range(first, first + self.tp))

    @property
    def replica_leader(self) -> int:
        """The replica's first rank: it owns the frontend connection and relays each round."""
        return self.dp_rank * self.tp

    @property
    def dp_column(self) -> tuple[int, ...]:
        """One rank per replica, at this rank's TP position."""
        return tuple(range(self.tp_rank, self.world_size, self.tp))

    @property
    def world(self) -> tuple[int, ...]:
        """The attention-DP world: every rank (where the replicas agree to forward in step)."""
        return tuple(range(self.world_size))

    @property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """Every replica's ranks, in DP order."""
        return tuple(tuple(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.dp))
