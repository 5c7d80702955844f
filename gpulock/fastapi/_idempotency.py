"""The idempotency store (``X-Request-ID``): the request's ticket, the claim that makes one
worker its owner, the place a retry on another worker follows, and the results kept for
retries that come later.

Keys (see ``gpulock.protocol.keys``): ``gpulock:{pool}:req:<ticket>`` is the claim,
``owner|fingerprint|phase|place`` with a 10 s ttl its owner refreshes;
``gpulock:{pool}:res:<ticket>`` the result, JSON ``{"fp", "result"}`` or ``{"fp",
"response": {"status", "media_type", "body" (base64)}}``, kept ``result_ttl`` seconds;
``gpulock:{pool}:hold:<ticket>`` a follower's 503 on another worker: the owner keeps the
request's place while it exists (its PX is the hold that 503 promised, ``gpulock.http.places``).

Every command goes to the pool's server alone (:meth:`Backend.commands
<gpulock.fastapi._backend.Backend.commands>`; on a Redis Cluster, the pool's shard)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import time
from typing import Any

from fastapi import Response
from gpulock_common.grace import grace_note, grace_outlasts

from gpulock.errors import AcquireTimeout
from gpulock.transport.failure_log import FailureLog
from gpulock.http.places import hold_for
from gpulock.http.disconnect import _is_gone
from ._admission import Slots
from ._backend import Backend
from ._errors import GpuLockHTTPException, HttpErrors
from ._metrics import metrics
from ._retry_after import RetryAfterEstimator
from ._job import Job
from ._settings import Settings


log = logging.getLogger("gpulock.fastapi")

MISSING = object()
"""No result stored (or no claim to follow)."""

CLAIM_TTL_MS = 10_000
_UNLOCK = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def request_ticket(route: str, header_value: str) -> str:
    """The lease request id for an ``X-Request-ID`` header value on a route: any header value
    (any characters; its length was bounded before, ``gpulock.http.access_log.request_id_error``)
    hashes to ``rq.<32 hex>``, which matches the core's pattern ``[A-Za-z0-9._:-]{1,128}``.
    Every worker computes the same ticket for the same value."""
    h = hashlib.sha256(f"{route}\n{header_value}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"rq.{h[:32]}"


class RequestStore:
    """Claims and results of idempotent requests in the pool's Redis.

    Args:
        settings: ``result_ttl``, ``park_timeout``, the timeouts and the header's name.
        backend: the Redis client and the owner (``host:pid``) written into claims.
        slots: this worker's thread slots (a claim publishes the place among them).
        retry: Retry-After for a follower whose wait ran out.
        errors: the 409 and 499 answers.
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        slots: Slots,
        retry: RetryAfterEstimator,
        errors: HttpErrors,
    ):
        self._settings = settings
        self._backend = backend
        self._slots = slots
        self._retry = retry
        self._errors = errors
        # Repeated failures (Redis down) log one line, then a summary.
        self._refresh_log = FailureLog(f"request-claim refresh for pool {backend.pool_name}")

    def _claim_key(self, ticket: str) -> str:
        return self._backend.key(f"req:{ticket}")

    # ---- claims -----------------------------------------------------------------------------
    async def claim(self, ticket: str, fp: str) -> bool:
        """Become the owner of ``ticket`` (fingerprint ``fp``) unless another worker is."""
        value = f"{self._backend.owner}|{fp}|slot|0"
        return bool(
            await self._backend.command(
                "SET", self._claim_key(ticket), value, "NX", "PX", CLAIM_TTL_MS
            )
        )

    async def unclaim(self, ticket: str) -> None:
        """Drop our claim of ``ticket`` (one that another worker took over stays)."""
        await self._backend.command(
            "EVAL", _UNLOCK, 1, self._claim_key(ticket), f"{self._backend.owner}|"
        )

    async def release_claim(self, ticket: str) -> None:
        """:meth:`unclaim` for a finished job, shielded; a failure is logged (the claim
        expires in 10 s; until then retries follow it), a cancellation ignored."""
        try:
            await asyncio.shield(self.unclaim(ticket))
        except Exception as e:  # noqa: BLE001 - the claim expires on its own
            log.warning("gpulock: could not drop the claim of request %s: %s", ticket, e)
        except BaseException:  # cancelled: the claim expires on its own
            pass

    def claim_value(self, job: Job) -> str:
        """``owner|fingerprint|phase|place``: what another worker's retry reads to follow the
        request. The place is the rank in the pool's queue once queued, and while the job
        waits for one of this worker's threads its place among them (the follower adds the
        pool's queue length, as the owner's ``job_position`` does)."""
        pos = self._slots.position(job.slot_future) if job.phase == "slot" else job.position
        return f"{self._backend.owner}|{job.fingerprint}|{job.phase}|{pos}"

    async def set_phase(self, job: Job, phase: str) -> None:
        """Move ``job`` to ``phase`` and publish it in its claim (errors ignored)."""
        job.phase = phase
        if job.ticket is None:
            return
        with contextlib.suppress(Exception):
            await self._backend.command(
                "SET", self._claim_key(job.ticket), self.claim_value(job), "XX", "PX", CLAIM_TTL_MS
            )

    async def publish_slot_place(self, job: Job) -> None:
        """Publish the place of a job still waiting for a thread."""
        if job.phase == "slot" and job.ticket is not None:  # not yet moved on
            await self.set_phase(job, "slot")

    async def refresh(self, jobs: list[Job]) -> None:
        """Keep the claims of ``jobs`` (unfinished, with tickets) alive for another 10 s,
        rewriting the place of those still waiting for a thread. A failure is logged once
        (then a summary), never raised."""
        if not jobs:
            return
        try:
            cmds: list[tuple[Any, ...]] = []
            for j in jobs:  # a thread-slot place moves as the waiters ahead leave: rewrite it
                assert j.ticket is not None
                k = self._claim_key(j.ticket)
                if j.phase == "slot":
                    cmds.append(("SET", k, self.claim_value(j), "XX", "PX", CLAIM_TTL_MS))
                else:
                    cmds.append(("PEXPIRE", k, CLAIM_TTL_MS))
            await self._backend.commands(*cmds)
        except Exception as e:  # noqa: BLE001 - the claims expire in 10 s; say why they were not kept
            self._refresh_log.failed(RuntimeError(f"{len(jobs)} claim(s) not refreshed: {e}"))
        else:
            self._refresh_log.ok()

    # ---- holds (a follower's 503 keeps the owner's place) -------------------------------------
    async def hold(self, ticket: str, seconds: float) -> None:
        """Ask the owner of ``ticket`` to keep its place ``seconds`` more (errors ignored:
        the owner's own hold still runs)."""
        with contextlib.suppress(Exception):
            await self._backend.command(
                "SET", self._backend.key(f"hold:{ticket}"), "1", "PX", max(1, int(seconds * 1000))
            )

    async def held(self, ticket: str) -> bool:
        """Whether a follower's hold on the place of ``ticket`` lives now (EXISTS: a command
        the core's ACL already has).

        Raises: what the Redis client raises."""
        return bool(await self._backend.command("EXISTS", self._backend.key(f"hold:{ticket}")))

    # ---- results ----------------------------------------------------------------------------
    async def get(self, ticket: str, fp: str, request_id: str) -> Any:
        """The stored result of ``ticket``, or :data:`MISSING`.

        Raises: GpuLockHTTPException 409 when it was stored for another fingerprint."""
        raw = await self._backend.command("GET", self._backend.key(f"res:{ticket}"))
        if raw is None:
            return MISSING
        return self._decode(raw, fp, request_id)

    def _decode(self, raw: bytes | str, fp: str, request_id: str) -> Any:
        rec = json.loads(raw)
        if rec.get("fp", "") != fp:
            raise self._errors.conflict(request_id)
        if "response" in rec:
            r = rec["response"]
            return Response(
                base64.b64decode(r["body"]), status_code=r["status"], media_type=r["media_type"]
            )
        return rec["result"]

    async def store(self, job: Job, result: Any) -> None:
        """Keep ``result`` of ``job`` for ``result_ttl`` seconds; one that does not encode as
        JSON is not kept (logged at debug level), a Redis error ignored."""
        try:
            from fastapi.encoders import jsonable_encoder

            if isinstance(result, Response):
                body = bytes(result.body)
                rec = {
                    "fp": job.fingerprint,
                    "response": {
                        "status": result.status_code,
                        "media_type": result.media_type,
                        "body": base64.b64encode(body).decode(),
                    },
                }
            else:
                rec = {"fp": job.fingerprint, "result": jsonable_encoder(result)}
            raw = json.dumps(rec, separators=(",", ":"))
        except Exception as e:
            log.debug("gpulock: result of %s not stored for replay (%s)", job.route, e)
            return
        with contextlib.suppress(Exception):
            await self._backend.command(
                "SET",
                self._backend.key(f"res:{job.ticket}"),
                raw,
                "PX",
                max(1, int(self._settings.result_ttl * 1000)),
            )

    # ---- following another worker's request --------------------------------------------------
    async def follow(
        self,
        ticket: str,
        fp: str,
        request_id: str,
        route: str,
        arrival: float,
        gone: asyncio.Task[bool] | None = None,
    ) -> Any:
        """Another worker owns this request id: wait for its result, reporting its place.
        Returns the result, or :data:`MISSING` when the owner's claim ended without one.

        Raises: GpuLockHTTPException 503 (still queued at ``arrival + acquire_timeout``, with
        Retry-After and X-Queue-Position), 504 (still running ``inference_timeout`` later),
        409 (another fingerprint), 499 (``gone`` ended: this client left)."""
        s = self._settings
        acq_deadline = arrival + s.acquire_timeout
        end = acq_deadline + s.inference_timeout
        delay = 0.02
        claim_key, res_key, queue_key = (
            self._claim_key(ticket),
            self._backend.key(f"res:{ticket}"),
            self._backend.queue_key,
        )
        while True:
            raw, claim, rank, queued = await self._backend.commands(
                ("GET", res_key),
                ("GET", claim_key),
                ("ZRANK", queue_key, ticket),
                ("ZCARD", queue_key),
            )
            if raw is not None:
                return self._decode(raw, fp, request_id)
            if claim is None:
                return MISSING
            claim = claim.decode() if isinstance(claim, bytes) else claim
            _, cfp, phase, pos = (claim.rsplit("|", 3) + ["", "", "0"])[:4]
            if cfp != fp:
                raise self._errors.conflict(request_id)
            now = time.monotonic()
            # The place as its owner counts it (job_position): the rank in the pool's queue,
            # or, while it waits for one of the owner's threads, the pool's queue length now
            # plus its place among the owner's waiters (published in the claim).
            local = int(pos) if phase == "slot" and pos.isdigit() else 0
            if rank is not None:
                position, local = rank + 1, 0
            elif local:
                position = int(queued) + local
            else:
                position = int(pos) if phase == "queued" and pos.isdigit() else 0
            grace = self._backend.grace_left()
            # in the pool's queue in a grace period that outlasts this request's deadline:
            # nothing is granted before it, so answer now, as the owner's own request is
            graced = rank is not None and grace_outlasts(grace, acq_deadline - now)
            if (now >= acq_deadline or graced) and phase in ("slot", "queued"):
                metrics().timeouts.labels(route).inc()
                p = position or int(queued) + 1
                if s.park_timeout > 0:
                    ra, estimate = self._retry.parked(p, local)
                    await self.hold(ticket, hold_for(ra, hold=s.park_timeout, extra=grace))
                else:
                    ra, estimate = self._retry.answer(p)
                headers = {"Retry-After": str(ra)}
                if position:
                    headers["X-Queue-Position"] = str(position)
                raise GpuLockHTTPException.of(
                    AcquireTimeout,
                    f"request {request_id!r} is still queued (position {position or 'unknown'}"
                    + (f": {grace_note(s.pool_name, grace)}" if grace > 0 else "")
                    + f"); it keeps its place: retry with the same {s.request_id_header}",
                    headers,
                    estimated_wait_s=estimate,
                )
            if now >= end:
                metrics().inference_timeouts.labels(route).inc()
                raise GpuLockHTTPException(
                    504,
                    f"request {request_id!r} is still running; retry with the same "
                    f"{s.request_id_header} to collect its result",
                    "inference_timeout",
                )
            if gone is None:
                await asyncio.sleep(delay)
            else:
                await asyncio.wait((gone,), timeout=delay)
                if _is_gone(gone):  # this retry's client left; the owner's request goes on
                    raise self._errors.client_gone(
                        route, "waiting" if phase in ("slot", "queued") else "running"
                    )
            delay = min(delay * 1.5, 0.2)
