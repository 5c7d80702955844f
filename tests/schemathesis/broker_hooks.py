"""A check of the lease broker's, beside schemathesis' own (load it with
``SCHEMATHESIS_HOOKS=tests/schemathesis/broker_hooks.py``).

broker.toml tells ``positive_data_acceptance`` that a schema-valid acquire or renewal may be
answered 422 for a reason of state no static schema holds: a ttl above its pool's ``max_ttl``
(a bound each pool sets), or, for an acquire, a ``request_id`` already used for another amount
(the idempotency key names another request); and a holder whose JSON is over its byte bound (a
bound on an encoding's size, which no JSON Schema keyword states). This check keeps that from
hiding anything else: such a 422 must be one of those refusals; any other 422 to a request the schema allows fails, as
it would without the configuration.
"""

from __future__ import annotations

import re

import schemathesis

# the core's messages for those refusals (lua/acquire.lua)
_STATE = re.compile(
    r"max_ttl|^request id \S+ (holds a lease of|is queued for) another amount( or tenant)?$"
)
# and the one bound of a body no JSON Schema keyword can state: the holder's size as JSON
# (service/gpulock_broker/models.py, non-ASCII escaped as json.dumps does by default)
_SIZE = re.compile(r"^Value error, holder is \d+ bytes as JSON; at most \d+$")
_TTL_BOUNDED = {("POST", "/v1/pools/{pool}/leases"), ("PUT", "/v1/pools/{pool}/leases/{lease_id}")}


@schemathesis.check
def refused_only_for_the_pools_max_ttl(ctx, response, case):
    op = (case.operation.method.upper(), case.operation.path)
    meta = case.meta
    if response.status_code != 422 or op not in _TTL_BOUNDED or meta is None:
        return None
    if not meta.generation.mode.is_positive:
        return None
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    messages = [str(e.get("msg", "")) for e in detail or () if isinstance(e, dict)]
    if not messages or not all(_STATE.search(m) or _SIZE.match(m) for m in messages):
        raise AssertionError(
            f"a request the schema allows was refused 422 for another reason than its pool's "
            f"max_ttl or a reused request_id: {messages or response.text[:300]}"
        )
    return None
