"""Methods under ring attention: a block plan cut into (query shard, key shard) parts (``ring``)
and the work each rank gets from a static plan, with a balancing token order (``balance``)."""
from .ring import RingParts, ring_attend, ring_methods, ring_refusal, ring_shards, shard_part

__all__ = ["RingParts", "ring_attend", "ring_methods", "ring_refusal", "ring_shards", "shard_part"]
