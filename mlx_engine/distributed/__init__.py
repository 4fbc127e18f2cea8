"""Sharded kits: one model split over the processes of an ``mx.distributed`` group
(docs/distributed.md).

Every rank calls ``load_sharded_model`` with the same arguments. Rank 0 gets a
``ShardedModelKit``, a ``ModelKit`` that the whole API accepts (generators,
stats, cancellation, prompt cache, draft models, prompt lookup, the auto
router); the other ranks get a ``Follower`` whose ``serve()`` mirrors rank 0's
forward passes until rank 0 unloads the kit (protocol.py). The draft model and
prompt lookup run on rank 0 only: the followers see verify passes, not drafts.

The implementation, one job per module: ``load.py`` (loading every rank's
shard), ``connect.py`` (the control channel at load), ``kit.py`` (rank 0's kit),
``follower.py`` (the other ranks), ``health.py`` (failures and the engine
thread), ``protocol.py`` (mirrored passes), ``control.py`` (the control channel),
``sharding.py`` (splitting the weights).
"""

from .follower import Follower
from .kit import ShardedModelKit, ShardInfo
from .load import load_sharded_model
from .protocol import FollowerExit

__all__ = ["Follower", "FollowerExit", "ShardInfo", "ShardedModelKit", "load_sharded_model"]
