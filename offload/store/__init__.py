"""The tiered store: named shards in host memory or swap files, moved asynchronously."""

from offload.store.aio import AioSettings, SwapIOError
from offload.store.pool import PinnedPool, PoolExhausted
from offload.store.shard_file import CorruptShard
from offload.store.tiered import ShardLost, State, Tier, TieredStore

__all__ = [
    "AioSettings", "CorruptShard", "PinnedPool", "PoolExhausted", "ShardLost", "State", "SwapIOError", "Tier",
    "TieredStore",
]
