"""The async TCP mesh between an engine's ranks and the collectives the rounds run over it.

Torch-free: the control plane uses it. See ``Mesh`` for forming it, ``Group`` for the
collectives, ``Ranks`` for the fixed groups of the engine's layout.
"""

from tokenspeed_aio.collective.collectives import Group
from tokenspeed_aio.collective.errors import (
    CollectiveError,
    CollectiveOrderError,
    FormationError,
    MeshError,
    PeerLostError,
)
from tokenspeed_aio.collective.formation import base_port_addresses
from tokenspeed_aio.collective.groups import Ranks
from tokenspeed_aio.collective.mesh import DEFAULT_JOB_ID, Mesh
from tokenspeed_aio.collective.reduce import ReduceOp
from tokenspeed_aio.collective.rendezvous import Rendezvous

__all__ = [
    "DEFAULT_JOB_ID",
    "CollectiveError",
    "CollectiveOrderError",
    "FormationError",
    "Group",
    "Mesh",
    "MeshError",
    "PeerLostError",
    "Ranks",
    "ReduceOp",
    "Rendezvous",
    "base_port_addresses",
]
