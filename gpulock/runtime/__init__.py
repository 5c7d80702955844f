"""A pool object's runtime: the background work that keeps its leases and waiters alive
(heartbeat, waiters' refresh, grant notices, recovery after Redis lost its data) and the places
kept for remote holders.

Internal: the public API is what ``gpulock`` exports.
"""
