"""KV page bookkeeping (no torch): the page pool and the per-request block tables."""

from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.block_pool import BlockPool, OutOfBlocksError

__all__ = ["BlockManager", "BlockPool", "OutOfBlocksError"]
