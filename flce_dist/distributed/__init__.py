"""Everything that crosses ranks: the shard partition and its cross-rank check (``shard.py``), the
loss's collectives and the integrations' autograd collectives (``collectives.py``), DTensor layouts
(``dtensor.py``) and group helpers (``groups.py``). Kernels never import this package."""

from .collectives import (
    CopyToGroup,
    GatherVocab,
    ReduceFromGroup,
    all_gather_rows,
    all_gather_rows_uneven,
    all_reduce_async,
    all_reduce_deterministic_,
    combine_stats,
    reduce_scatter_rows,
)
from .groups import group_rank, group_size
from .shard import resolve_call, resolve_shard, shard_sizes, vocab_shard

__all__ = [
    "CopyToGroup",
    "GatherVocab",
    "ReduceFromGroup",
    "all_gather_rows",
    "all_gather_rows_uneven",
    "all_reduce_async",
    "all_reduce_deterministic_",
    "combine_stats",
    "group_rank",
    "group_size",
    "reduce_scatter_rows",
    "resolve_call",
    "resolve_shard",
    "shard_sizes",
    "vocab_shard",
]
