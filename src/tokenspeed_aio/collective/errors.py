"""Errors of the collective mesh.

Two families, because the round handles them differently:

- ``CollectiveError`` is *agreed*: every rank of the group raises the same one from the same
  call (a rank-local error that went into the exchange, or a reduction over values that do not
  reduce). The exchange itself completed, so the group stays usable.
- ``MeshError`` and its subclasses are *not* agreed: the mesh could not be formed, a peer is
  gone, or the ranks' call orders differ. Ranks may see different ones; the group that raised
  it is unusable afterwards, and the engine has to stop.
"""

from __future__ import annotations


class CollectiveError(Exception):
    """Raised identically on every rank of a group when a rank contributed an error.

    ``errors`` lists every (rank, message) contributed to the call, in rank order; ``rank`` and
    ``message`` are the first of them.
    """

    def __init__(self, op: str, group: tuple[int, ...], errors: list[tuple[int, str]]):
        self.op = op
        self.group = group
        self.errors = errors
        self.rank, self.message = errors[0]
        detail = "; ".join(f"rank {rank}: {message}" for rank, message in errors)
        super().__init__(f"{op} over ranks {list(group)} failed: {detail}")


class MeshError(Exception):
    """The mesh failed: it could not form, was closed, or a collective could not complete."""


class FormationError(MeshError):
    """The mesh could not form: a handshake was rejected or a peer did not appear in time."""


class PeerLostError(MeshError):
    """A peer this rank waited on closed its connection or did not answer within the timeout."""

    def __init__(self, message: str, *, peer: int, op: str, elapsed: float):
        super().__init__(message)
        self.peer = peer
        self.op = op
        self.elapsed = elapsed


class CollectiveOrderError(MeshError):
    """The ranks of a group entered different collectives at the same point of their sequence."""
