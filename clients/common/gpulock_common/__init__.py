"""gpulock-common: what the gpulock core and the gpulock-client SDK share.

Two distributions raise gpulock's errors and keep a lease's local validity clock: ``gpulock``
(the core: Redis, Lua, the FastAPI integration, the broker) and ``gpulock-client`` (the SDK for
the broker's HTTP lease API, which depends on httpx only). Both depend on this one
(``gpulock-common>=0.6.0``), which depends on nothing outside the standard library, so the SDK
pulls in neither redis, torch nor FastAPI, and the two sides hold one copy of:

- :mod:`gpulock_common.errors`: the exception tree (``GpuLockError`` and its subclasses).
  ``gpulock.errors`` and ``gpulock_client`` re-export these classes, so
  ``gpulock.errors.LeaseLost is gpulock_client.LeaseLost``.
- :mod:`gpulock_common.wire`: the error table, each error's HTTP status and code declared once
  (the broker and the FastAPI integration answer from it; the SDK and the CLI read replies
  back into the classes with it).
- :mod:`gpulock_common.lease`: Chubby's rule for the local validity deadline (the clock-drift
  bound and safety margin), a lease's local state (active, lost or released; ``check`` raising
  ``LeaseLost``; ``mark_lost`` firing the ``on_lost`` callbacks once), and the lease object's
  read-only surface.
- :mod:`gpulock_common.units`: ``format_size``, the byte formatter the error messages use, and
  ``MAX_BYTES``; :mod:`gpulock_common.sizes`: ``parse_size``, the one parser of a size
  ("4GiB") into bytes.
- :mod:`gpulock_common.validation`: validation errors in users' words (``input[0][1]: ...``,
  no pydantic internals), for the servers' 400/422 and the SDK's and CLI's messages.
- :mod:`gpulock_common.options`: the vocabulary of an acquire and of a pool's settings
  (bounds, defaults, queue policies and placements, the one check of each value, and
  ``AcquireOptions``, ``PoolSettings``), which the Lua scripts enforce too.
- :mod:`gpulock_common.aio`: asyncio helpers that never lose a cancellation (``wait_for``,
  ``stop_tasks``), which both sides' background loops stop with.
- :mod:`gpulock_common.driver`: the one driver loop of a step machine (``drive``, ``adrive``):
  every step vocabulary of both sides (the core's flows, script loading, cluster routing,
  pub/sub; the SDK's procedures) is carried out by it, each shell writing only a step's I/O.

- :mod:`gpulock_common.queue`: ``QueuePlace``, the int an ``on_queued`` callback receives (the
  1-based position) with the estimated wait and the queue's length.
- :mod:`gpulock_common.tracing`: OpenTelemetry's span and attribute names every surface uses,
  and the calls they make (a span, W3C context in and out), which cost nothing when the
  optional OpenTelemetry API is absent or unconfigured.
- :mod:`gpulock_common.traces`: the ``gpulock.acquire`` and ``gpulock.lease`` spans, one design
  for the core and the SDK (the outcome of an error and its wire code, the lease span's
  renewals, resizes, release and loss), built only while a tracer provider records.

Nothing here does I/O.
"""

__version__ = "0.6.0"
