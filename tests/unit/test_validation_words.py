"""Validation errors in users' words (``gpulock_common.validation``), on the request models of
the service and the broker with any JSON body: every path an error names is a place in the body
the client sent (``input[0][1]``), never one of pydantic's internals (the union member it tried,
``list[function-before[integral(), int]]``, or ``[key]``), and the one-line message says it so."""

from __future__ import annotations

import pytest
from gpulock_broker.models import LeaseRequest, PoolConfigRequest
from gpulock_common.validation import describe, param_of, path_text, plain_errors
from gpulock_service.inputs import EmbeddingRequest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
FIELDS = {
    EmbeddingRequest: ["input", "model", "encoding_format", "dimensions", "truncate", "user"],
    LeaseRequest: ["amount", "ttl", "holder", "request_id", "priority", "device", "queue"],
    PoolConfigRequest: ["capacity", "quotas", "devices", "max_waiters", "policy"],
}


def _errors(model: type[BaseModel], body: object) -> list[dict] | None:
    """FastAPI's errors for ``body`` (locations under ``body``), or None when it is valid."""
    try:
        model.model_validate(body)
    except ValidationError as e:
        return [{**x, "loc": ("body", *x["loc"])} for x in e.errors()]
    except ValueError:  # a model's own check outside pydantic's errors
        return None
    return None


def _in_body(loc: list, body: object, missing: bool) -> bool:
    cur = body
    for k, part in enumerate(loc[1:]):
        if isinstance(part, int) and isinstance(cur, list) and 0 <= part < len(cur):
            cur = cur[part]
        elif isinstance(part, str) and isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return missing and k == len(loc) - 2
    return True


@pytest.mark.parametrize("model", list(FIELDS), ids=lambda m: m.__name__)
@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_every_path_named_is_in_the_body_sent(model, data):
    body = data.draw(
        st.dictionaries(st.sampled_from(FIELDS[model]), JSON, max_size=4) | JSON, label="body"
    )
    errors = _errors(model, body)
    if errors is None:
        return
    plain = plain_errors(errors, body)
    assert plain, errors  # something is always said
    for e in plain:
        assert e["loc"][0] == "body" and _in_body(e["loc"], body, e["type"] == "missing"), (
            e,
            body,
        )
        assert not e["msg"].startswith("Value error, ")
    msg = describe(plain)
    for e in plain:
        assert f"{path_text(e['loc'])}: " in msg
    keys = list(body) if isinstance(body, dict) else []
    assert param_of(plain) in (None, "body", *FIELDS[model], *keys)


def test_a_union_says_the_member_that_matched_furthest():
    body = {"input": [[1, "two"]]}
    plain = plain_errors(_errors(EmbeddingRequest, body) or [], body)
    assert describe(plain) == 'input[0][1]: Input should be a valid integer (got "two")'
    body = {"input": 5}
    assert describe(plain_errors(_errors(EmbeddingRequest, body) or [], body)) == (
        "input: Input should be a valid string or a valid list (got 5)"
    )
    body = {"amount": 1, "holder": {"job": [1]}}
    assert describe(plain_errors(_errors(LeaseRequest, body) or [], body)) == (
        "holder.job: Input should be a valid string, a valid integer, a valid number or a "
        "valid boolean (got [1])"
    )
    body = {"quotas": {"team a": "1GiB"}}
    said = describe(plain_errors(_errors(PoolConfigRequest, body) or [], body))
    assert said.startswith('quotas["team a"]: String should match pattern'), said
    assert describe([{"loc": ["body", "amount"], "type": "missing", "msg": "Field required"}]) == (
        "amount: Field required"
    )
    assert path_text(["query", "limit"]) == "limit (query)" and path_text(["body"]) == "body"


def test_a_message_that_names_the_value_does_not_say_it_twice():
    """gpulock's own checks end in ", got <value>" (a policy, a priority): the broker's 422,
    and so the SDK's and the CLI's messages, say the value once."""
    body = {"capacity": "4GiB", "policy": "lifo"}
    said = describe(plain_errors(_errors(PoolConfigRequest, body) or [], body))
    assert said == "policy: policy must be 'fifo' or 'backfill', got 'lifo'", said
    assert said.count("lifo") == 1
    body = {"amount": 1, "priority": 500}
    said = describe(plain_errors(_errors(LeaseRequest, body) or [], body))
    assert said.endswith("got 500") and said.count("500") == 1, said
    body = {"capacity": "lots"}  # a size's message ends in "; got 'lots'"
    said = describe(plain_errors(_errors(PoolConfigRequest, body) or [], body))
    assert said.endswith("got 'lots'") and said.count("lots") == 1, said
