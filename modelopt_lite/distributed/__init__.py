"""Floor 1: multi-process helpers, no-ops in a single process: FSDP2 weight-access windows, collectives
that keep quantizer state identical on every rank, and agreement on failure (no rank left hanging)."""

from .comm import (
    RankFailedError,
    all_ranks_succeed,
    all_reduce_max,
    all_reduce_sum,
    broadcast_json,
    broadcast_tensors,
    check_same_on_all_ranks,
    is_distributed,
    naming_lost_rank,
    rank,
    record_ranks,
    set_collective_timeout,
    world_size,
)
from .offload import has_offloaded_weights
from .window import is_sharded, shard_frozen, unsharded_class, weight_access

__all__ = [
    "RankFailedError",
    "all_ranks_succeed",
    "all_reduce_max",
    "all_reduce_sum",
    "broadcast_json",
    "broadcast_tensors",
    "check_same_on_all_ranks",
    "has_offloaded_weights",
    "is_distributed",
    "is_sharded",
    "naming_lost_rank",
    "rank",
    "record_ranks",
    "set_collective_timeout",
    "shard_frozen",
    "unsharded_class",
    "weight_access",
    "world_size",
]
