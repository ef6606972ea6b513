"""Shard partition and the collectives of the vocab-parallel loss."""

from .collectives import all_gather_rows, all_reduce_async, all_reduce_deterministic_, combine_stats, reduce_scatter_rows
from .shard import group_rank, group_size, resolve_shard, vocab_shard

__all__ = [
    "all_gather_rows",
    "all_reduce_async",
    "all_reduce_deterministic_",
    "combine_stats",
    "group_rank",
    "group_size",
    "reduce_scatter_rows",
    "resolve_shard",
    "vocab_shard",
]
