"""KV events: what enters and leaves the prefix cache, published in vLLM's wire format over ZeroMQ so
that cache-aware routers (llm-d's KV-cache indexer, Dynamo's KV router) index kvpool nodes unchanged.

wire.py: the msgspec structs, declared as vLLM 0.32 declares them; listener.py: the CacheListener that
turns the allocator's calls into queued events (on the event loop: no encoding there); publisher.py:
the bounded queue, the publisher thread and the PUB socket; replay.py: the replay buffer (bounded in
batches and bytes) and the ROUTER socket that serves it without losing a batch unseen.
"""
