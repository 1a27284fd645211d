"""The tiered store: named shards in host memory or swap files, moved asynchronously."""

from offload.errors import CorruptShard, PoolExhausted, ShardLost, SwapIOError
from offload.store.aio import AioSettings
from offload.store.pool import PinnedPool
from offload.store.tiered import State, Tier, TieredStore, pool_bytes

__all__ = [
    "AioSettings", "CorruptShard", "PinnedPool", "PoolExhausted", "ShardLost", "State", "SwapIOError", "Tier",
    "TieredStore", "pool_bytes",
]
