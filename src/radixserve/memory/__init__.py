from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.kv_pool import KVPool

__all__ = ["SlotAllocator", "KVPool"]
