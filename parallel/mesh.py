"""Parallel degrees -> one named DeviceMesh ("pp", "dp", "fsdp", "tp"), with an explicit device type."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fedpar.parallel.config import ParallelConfig

# Outermost to innermost: TP ranks are neighbours (fastest links), PP is the slowest dimension.
MESH_DIMS = ("pp", "dp", "fsdp", "tp")


@dataclass(frozen=True)
class ParallelMesh:
    """The world mesh plus this rank's coordinates in it."""

    mesh: DeviceMesh
    config: ParallelConfig

    def coord(self, dim: str) -> int:
        """This rank's index along mesh dimension ``dim``."""
        return self.mesh.get_local_rank(dim)

    @property
    def data_parallel_rank(self) -> int:
        """Which distinct batch shard this rank consumes (same for ranks of one TP/PP group)."""
        return self.coord("dp") * self.config.fsdp + self.coord("fsdp")

    @property
    def data_parallel_size(self) -> int:
        """How many distinct batch shards one step consumes."""
        return self.config.data_parallel_size

    def __getitem__(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh over ``dims`` (e.g. ``"tp"`` or ``("dp", "fsdp")``)."""
        return self.mesh[dims]


def build_mesh(config: ParallelConfig, device_type: str) -> ParallelMesh:
    """Create the 4-D mesh (on ``"cuda"`` or ``"cpu"``) for resolved degrees; size-1 dimensions are kept."""
    shape = tuple(getattr(config, d) for d in MESH_DIMS)
    return ParallelMesh(init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS), config)
