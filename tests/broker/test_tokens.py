"""Loading the broker's tokens: from a file, from the environment (any mapping), and the
messages for what is wrong with them."""

from __future__ import annotations

import json
import types

import pytest
from gpulock_broker.auth import TokenConfigError, load_tokens

DOC = {"tokens": [{"name": "a", "token": "a-token-0123456789abcdef", "pools": ["*"]}]}


def test_from_a_file_and_from_the_environment(tmp_path):
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps(DOC))
    assert [p.name for p in load_tokens(f, env={})] == ["a"]
    assert [p.name for p in load_tokens(env={"GPULOCK_BROKER_TOKENS_FILE": str(f)})] == ["a"]
    # any read-only mapping will do, as os.environ does
    env = types.MappingProxyType({"GPULOCK_BROKER_TOKENS": json.dumps(DOC)})
    assert [p.name for p in load_tokens(env=env)] == ["a"]


def test_bad_json_names_where_and_the_line():
    with pytest.raises(
        TokenConfigError, match=r"\$GPULOCK_BROKER_TOKENS: not valid JSON \(.* at line 2\)"
    ):
        load_tokens(env={"GPULOCK_BROKER_TOKENS": '{"tokens":\n [,]}'})


def test_nothing_configured_or_unreadable(tmp_path):
    with pytest.raises(TokenConfigError, match="no broker tokens configured"):
        load_tokens(env={})
    with pytest.raises(TokenConfigError, match="cannot read tokens file"):
        load_tokens(tmp_path / "missing.json", env={})
