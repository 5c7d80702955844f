"""The listing's plan (gpulock.admin.listing.Plan): what it asks of a cluster's nodes and how it
folds their answers into a partial listing, without I/O."""

from __future__ import annotations

import pytest
import redis

from gpulock.admin.listing import Listing, Plan, Unreachable, answering_url, parse_slots, uncovered

A, B, C, D = ("10.0.0.1", 6379), ("10.0.0.2", 6379), ("10.0.0.3", 6379), ("10.0.0.4", 6379)


def slots_reply(*entries: tuple[int, int, tuple[str, int]]) -> list:
    """A ``CLUSTER SLOTS`` reply as redis-py returns it (bytes hosts, node ids)."""
    return [[lo, hi, [h.encode(), p, b"id"]] for lo, hi, (h, p) in entries]


THREE = slots_reply((0, 5460, A), (5461, 10922, B), (10923, 16383, C))


def test_every_master_answers():
    plan = Plan([A, B, C], [], 2.0)
    asks = plan.start()
    assert [(a.addr, a.slots, a.scan) for a in asks] == [(x, True, True) for x in (A, B, C)]
    assert plan.answered(A, THREE, {"p1"}) == []  # the map names no master left to ask
    plan.answered(B, THREE, {"p2"})
    assert not plan.done
    plan.answered(C, THREE, set())
    assert plan.done
    r = plan.result()
    assert r.names == ["p1", "p2"] and r.unreachable == [] and not r.partial
    assert r.masters == {
        "10.0.0.1:6379": ((0, 5460),),
        "10.0.0.2:6379": ((5461, 10922),),
        "10.0.0.3:6379": ((10923, 16383),),
    }


def test_a_refusing_and_a_silent_master_are_named_with_their_slots():
    plan = Plan([A, B, C], [], 2.0)
    plan.start()
    plan.answered(A, THREE, {"p1"})
    plan.failed(B, redis.ConnectionError("Error 111 connecting to 10.0.0.2:6379."))
    assert not plan.done  # C has not answered: the driver waits until the timeout
    r = plan.result()
    assert r.names == ["p1"] and r.partial
    assert [u.to_dict() for u in r.unreachable] == [
        {
            "node": "10.0.0.2:6379",
            "slots": [[5461, 10922]],
            "error": "Error 111 connecting to 10.0.0.2:6379.",
        },
        {"node": "10.0.0.3:6379", "slots": [[10923, 16383]], "error": "no answer within 2 s"},
    ]


def test_a_read_timeout_is_said_as_the_bound():
    plan = Plan([A], [], 1.5)
    plan.start()
    plan.answered(A, slots_reply((0, 8191, A), (8192, 16383, B)), set())
    plan.failed(B, redis.TimeoutError("Timeout reading from socket"))
    assert plan.done
    assert plan.result().unreachable[0].error == "no answer within 1.5 s"


def test_a_master_the_client_did_not_know_is_scanned_once_the_map_is_in():
    plan = Plan([A, B], [], 2.0)
    plan.start()
    plan.failed(B, redis.ConnectionError("refused"))  # the old master, replaced by D
    asks = plan.answered(A, slots_reply((0, 8191, A), (8192, 16383, D)), {"p1"})
    assert [(a.addr, a.slots, a.scan) for a in asks] == [(D, False, True)]
    plan.answered(D, None, {"p4"})
    assert plan.done
    r = plan.result()
    assert r.names == ["p1", "p4"] and r.unreachable == []  # B is no master any more


def test_names_come_only_from_masters_of_the_map():
    plan = Plan([A, B], [], 2.0)
    plan.start()
    plan.answered(A, slots_reply((0, 16383, A)), {"p1"})
    plan.answered(B, slots_reply((0, 16383, A)), {"stale"})  # a replica now
    assert plan.result().names == ["p1"]


def test_no_primary_answers_then_the_other_nodes_are_asked():
    plan = Plan([A], [B, A], 2.0)
    assert [a.addr for a in plan.start()] == [A]
    asks = plan.failed(A, redis.ConnectionError("refused"))
    assert [(a.addr, a.slots) for a in asks] == [(B, True)]
    assert plan.failed(B, redis.ConnectionError("refused")) == []
    assert plan.done
    with pytest.raises(redis.ConnectionError, match="asked 10.0.0.1:6379, 10.0.0.2:6379"):
        plan.result()


def test_a_client_that_knows_no_primary_starts_with_its_seeds():
    plan = Plan([], [A, B], 2.0)
    assert [a.addr for a in plan.start()] == [A, B]


def test_slots_no_master_serves_are_named():
    plan = Plan([A], [], 2.0)
    plan.start()
    plan.answered(A, slots_reply((0, 99, A), (200, 16383, A)), set())
    (gap,) = plan.result().unreachable
    assert gap == Unreachable(None, ((100, 199),), "no master serves these slots")


def test_parse_slots_joins_ranges_remaps_and_fills_an_empty_host():
    reply = [[0, 9, [b"", 7000, b"id"]], [10, 19, [b"", 7000, b"id"]], [30, 39, [b"h", 7001]]]
    got = parse_slots(reply, ("seed", 7000), lambda h, p: (h.upper(), p))
    assert got == {("SEED", 7000): ((0, 19),), ("H", 7001): ((30, 39),)}
    assert uncovered([(0, 19), (30, 39)]) == [(20, 29), (40, 16383)]


def test_unreachable_round_trips_and_reads_for_people():
    u = Unreachable("10.0.0.2:6379", ((0, 5), (7, 7)), "no answer within 2 s")
    assert Unreachable.from_dict(u.to_dict()) == u
    assert u.describe() == "10.0.0.2:6379 (slots 0-5, 7): no answer within 2 s"


def test_a_pool_lost_after_the_listing_names_its_shard_once():
    listing = Listing(["a", "b"], [], {"10.0.0.1:6379": ((0, 16383),)})
    listing.lost("a", OSError("gone"))
    listing.lost("b", OSError("gone again"))
    assert listing.unreachable == [Unreachable("10.0.0.1:6379", ((0, 16383),), "gone")]
    with pytest.raises(OSError, match="down"):
        Listing(["a"]).lost("a", OSError("down"))  # a lone server: nothing to list without it


def test_answering_url_keeps_credentials_and_options_and_drops_the_down_masters():
    listing = Listing(
        [],
        [Unreachable("10.0.0.2:6379", ((5461, 10922),), "down")],
        {"10.0.0.1:6379": (), "10.0.0.2:6379": (), "::1:7000": ()},
    )
    url = "rediss+cluster://u:p%40ss@10.0.0.2:6379,10.0.0.1:6379/0?max_connections=4"
    assert answering_url(url, listing) == (
        "rediss+cluster://u:p%40ss@10.0.0.1:6379,[::1]:7000/0?max_connections=4"
    )
    assert answering_url(url, Listing([])) == url  # nothing answered: as given
