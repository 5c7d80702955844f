"""A check of the lease broker's, beside schemathesis' own (load it with
``SCHEMATHESIS_HOOKS=tests/schemathesis/broker_hooks.py``).

broker.toml tells ``positive_data_acceptance`` that a schema-valid acquire, renewal or pool
configuration may be answered 422 for a reason of state, or of arithmetic, no static schema
holds: a ttl above its pool's ``max_ttl`` (a bound each pool sets); for an acquire, a
``request_id`` already used for another amount (the idempotency key names another request) or
a ``device`` the pool does not have (each pool has its own count of devices); a holder whose
JSON is over its byte bound (a bound on an encoding's size, which no JSON Schema keyword
states); and for a configuration, a ``capacity`` that is not the sum of the ``devices`` given,
devices whose capacities sum above the largest capacity, a change of the count of devices
while the pool has leases or waiters, or a capacity alone, other than its own, for a pool of
several devices. This check keeps that from hiding anything else: such a 422 must be one of
those refusals; any other 422 to a request the schema allows fails, as it would without the
configuration.
"""

from __future__ import annotations

import re

import schemathesis

# the core's messages for those refusals (lua/acquire.lua)
_STATE = re.compile(
    r"max_ttl|^request id \S+ (holds a lease of|is queued for) another amount(, tenant or device)?$"
)
_DEVICE = re.compile(r"^device \d+ is not a device of the pool: it has \d+ \(0 \.\. \d+\)$")
# and the one bound of a body no JSON Schema keyword can state: the holder's size as JSON
# (service/gpulock_broker/models.py, non-ASCII escaped as json.dumps does by default)
_SIZE = re.compile(r"^(?:Value error, )?holder is \d+ bytes as JSON; at most \d+$")
# a pool's devices: the sum (service/gpulock_broker/models.py) and the pool's state
# (lua/configure.lua)
_DEVICES = re.compile(
    r"^(?:Value error, )?capacity \d+ is not the sum of the devices' capacities|"
    r"^(?:Value error, )?the devices' capacities sum to \d+ bytes, above the largest capacity|"
    r"^the pool has \d+ device\(s\) and leases or waiters: its count of devices changes only|"
    r"^the pool has \d+ devices: give each one a capacity \(devices\), not capacity \d+ alone$"
)
_ACQUIRE = ("POST", "/v1/pools/{pool}/leases")
_ALLOWED = {
    _ACQUIRE: (_STATE, _SIZE, _DEVICE),
    ("PUT", "/v1/pools/{pool}/leases/{lease_id}"): (_STATE, _SIZE),
    ("PUT", "/v1/pools/{pool}"): (_DEVICES,),
}


@schemathesis.check
def refused_only_for_a_state_the_schema_cannot_hold(ctx, response, case):
    op = (case.operation.method.upper(), case.operation.path)
    meta = case.meta
    if response.status_code != 422 or op not in _ALLOWED or meta is None:
        return None
    if not meta.generation.mode.is_positive:
        return None
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    messages = [str(e.get("msg", "")) for e in detail or () if isinstance(e, dict)]
    if not messages or not all(any(p.search(m) for p in _ALLOWED[op]) for m in messages):
        raise AssertionError(
            f"a request the schema allows was refused 422 for another reason than its pool's "
            f"max_ttl or devices, a reused request_id or a capacity that is not the devices' "
            f"sum: {messages or response.text[:300]}"
        )
    return None
