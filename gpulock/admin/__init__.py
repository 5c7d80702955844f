"""Pool administration: listing the pools a Redis holds (also while a cluster shard is down),
deleting one, and a pool's recent history.

Internal: used by the CLI, the lease broker and the dashboard.
"""
