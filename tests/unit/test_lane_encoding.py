"""The lane's command encoding (gpulock/transport/lane.py) equals redis-py's own for every kind of
word: ASCII text (the one-step path), text beyond ASCII, bytes and ints (the general path),
and a command's head encoded once plus its arguments (gpulock/transport/script_calls.py). No server."""

from __future__ import annotations

import redis
from hypothesis import given
from hypothesis import strategies as st

from gpulock.transport.dialect import Dialect
from gpulock.transport.lane import encode
from gpulock.transport.script_calls import _Heads
from gpulock.transport.scripts import scripts


def _redis_py(words) -> bytes:
    return b"".join(redis.Connection().pack_command(*words))


WORD = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(max_codepoint=127), max_size=40),
    st.binary(max_size=40),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)


@given(st.sampled_from(["FCALL", "EVALSHA", "ECHO"]), st.lists(WORD, max_size=12))
def test_encode_equals_redis_py(command, args):
    # (redis-py reads its first word as a command name, which may hold spaces; ours never do)
    words = [command, *args]
    assert encode(words) == _redis_py(words)


@given(st.lists(st.text(max_size=30), max_size=10), st.booleans())
def test_a_head_encoded_once_plus_its_arguments_is_the_whole_command(args, functions):
    heads = _Heads([f"gpulock:{{p}}:{k}" for k in "abcdefgh"], Dialect(functions))
    for op in ("acquire", "release"):
        sc = scripts()[op]
        assert heads.packed(sc, args) == _redis_py(heads.words(sc, args))
        assert heads.packed(sc, args) == encode(heads.words(sc, args))  # the cached head twice
