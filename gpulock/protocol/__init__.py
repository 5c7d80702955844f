"""The protocol: what gpulock asks of Redis and what the answers mean, with no I/O.

Acquire requests and their checks (``args``, ``request``), the decoded replies (``replies``,
``lease``), the key layout (``keys``), the flows a driver runs (``flow``, ``steps``) and the
retry policy (``retry``). Internal: the public API is what ``gpulock`` exports.
"""
