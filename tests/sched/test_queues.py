import pytest

from kvforge.engine.request import Request
from kvforge.sampling_params import SamplingParams
from kvforge.sched.queues import available_policies, create_request_queue


def make_request(request_id, priority=0, arrival=0.0):
    return Request(request_id, [1, 2], SamplingParams(), priority=priority, arrival_time=arrival)


def ids(queue):
    return [r.request_id for r in queue]


def test_registry_knows_fcfs_and_priority_and_rejects_unknown():
    assert {"fcfs", "priority"} <= set(available_policies())
    with pytest.raises(ValueError, match="'lifo'"):
        create_request_queue("lifo")


def test_fcfs_order_prepend_and_remove():
    q = create_request_queue("fcfs")
    assert not q and len(q) == 0
    a, b, c, d = (make_request(x) for x in "abcd")
    for r in (a, b, c):
        q.add(r)
    q.prepend(d)
    assert ids(q) == ["d", "a", "b", "c"] and len(q) == 4 and q
    q.remove(b)
    assert q.peek() is d and q.pop() is d
    assert ids(q) == ["a", "c"]
    with pytest.raises(ValueError, match="'b'"):
        q.remove(b)


def test_empty_queue_peek_pop_raise():
    for policy in ("fcfs", "priority"):
        q = create_request_queue(policy)
        with pytest.raises(IndexError):
            q.peek()
        with pytest.raises(IndexError):
            q.pop()


def test_priority_orders_by_value_then_arrival_then_insertion():
    q = create_request_queue("priority")
    q.add(make_request("late-low", priority=5, arrival=1.0))
    q.add(make_request("early-low", priority=5, arrival=0.0))
    q.add(make_request("high", priority=-1, arrival=9.0))
    q.add(make_request("tie-1", priority=0, arrival=3.0))
    q.add(make_request("tie-2", priority=0, arrival=3.0))
    assert ids(q) == ["high", "tie-1", "tie-2", "early-low", "late-low"]
    assert q.pop().request_id == "high"
    q.remove(next(r for r in q if r.request_id == "tie-2"))
    assert ids(q) == ["tie-1", "early-low", "late-low"]


def test_priority_prepend_puts_preempted_back_at_its_key():
    q = create_request_queue("priority")
    old = make_request("old", priority=1, arrival=0.0)
    q.add(make_request("new", priority=1, arrival=5.0))
    q.add(make_request("urgent", priority=0, arrival=7.0))
    q.prepend(old)
    assert ids(q) == ["urgent", "old", "new"]


def test_preemption_victims():
    running = [make_request("a", 0, 0.0), make_request("b", 3, 1.0),
               make_request("c", 3, 0.5), make_request("d", 1, 2.0)]
    assert create_request_queue("fcfs").select_preemption_victim(running).request_id == "d"
    # lowest priority (largest value), then latest arrival
    assert create_request_queue("priority").select_preemption_victim(running).request_id == "b"
    with pytest.raises(ValueError):
        create_request_queue("fcfs").select_preemption_victim([])
