"""Lower tiers of the prefix cache: evicted pages spill to host memory or a disk file (one node) and
committed pages go to the remote tier, a Redis/Valkey store shared by the fleet; a prefix lookup that runs out of device
pages continues there and copies the pages back (service/tiers/cache.py)."""
