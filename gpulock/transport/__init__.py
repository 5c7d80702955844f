"""The Redis transport: connecting (URLs, Sentinel, Cluster), sending script calls to the shard
that owns a pool's slot, pub/sub, and turning redis-py's errors into gpulock's own.

Internal: the public API is what ``gpulock`` exports.
"""
