"""The pool's policy without Ray (engine/workers/dispatch.py): dispatch order, the
two-tasks-per-worker limit, the tail rule, guided grouping, solo re-runs,
and the failure ledger's charges and verdicts, on hand-written job costs,
worker loads and queue states whose outcomes are computed by hand below."""
from rayfed_dg.engine.workers.dispatch import Attempt, DispatchPlan, FailureLedger, Verdict


def _sent(step):
    """(worker, [(job, attempt, solo), ...]) of a ``next`` step, or None."""
    return None if step is None else (step[0], [(q.job, q.attempt, q.solo) for q in step[1]])


def _jobs(step):
    return None if step is None else (step[0], [q.job for q in step[1]])


def test_largest_first_keeps_ties_in_the_given_order_and_otherwise_the_given_order_stands():
    cost = {"a": 1.0, "b": 3.0, "c": 3.0, "d": 2.0}
    order = lambda **kw: [q.job for q in DispatchPlan(["a", "b", "c", "d"], 1, 1, **kw).queue]
    assert order(cost=cost) == ["b", "c", "d", "a"]
    assert order(cost=cost, largest_first=False) == ["a", "b", "c", "d"]
    assert order() == ["a", "b", "c", "d"]
    assert all(q.attempt == 0 and not q.solo for q in DispatchPlan([5, 6], 1, 1).queue)


def test_two_tasks_in_flight_per_worker_least_loaded_first_lowest_index_on_ties():
    plan = DispatchPlan(list(range(6)), workers=2, usable=2)  # no costs: no tail rule, no groups
    ready = {0, 1}
    assert [_jobs(plan.next(ready)) for _ in range(5)] == [(0, [0]), (1, [1]), (0, [2]), (1, [3]), None]
    assert plan.load == [2, 2]
    plan.done(1)
    assert _jobs(plan.next(ready)) == (1, [4])
    assert plan.next(ready) is None
    plan.done(0)
    plan.done(0)
    assert _jobs(plan.next({1})) is None  # worker 0 idle but restarting: nothing goes to it
    assert _jobs(plan.next({0, 1})) == (0, [5])
    assert plan.next(ready) is None and plan.queue == []


def test_a_requeued_attempt_goes_to_the_head_of_a_longer_queue():
    plan = DispatchPlan(["a", "b", "c", "d"], workers=1, usable=1)
    assert _jobs(plan.next({0})) == (0, ["a"])
    plan.done(0)
    plan.requeue(Attempt("a", 1))  # a retry goes before b, c and d, not behind any of them
    assert [(q.job, q.attempt) for q in plan.queue] == [("a", 1), ("b", 0), ("c", 0), ("d", 0)]
    assert _sent(plan.next({0})) == (0, [("a", 1, False)])


def test_the_round_tail_goes_to_idle_workers_only():
    # 2 workers, 7 jobs of cost 1: a second task joins a busy worker only while the queue
    # behind it holds at least 2 x its cost (left - g >= 2 g)
    plan = DispatchPlan(list(range(7)), workers=2, usable=2, cost={j: 1.0 for j in range(7)})
    ready = {0, 1}
    assert _jobs(plan.next(ready)) == (0, [0])  # idle workers: no check
    assert _jobs(plan.next(ready)) == (1, [1])
    assert _jobs(plan.next(ready)) == (0, [2])  # left 5: 4 behind it >= 2
    assert _jobs(plan.next(ready)) == (1, [3])  # left 4: 3 >= 2
    assert plan.next(ready) is None  # both full
    plan.done(0)
    assert _jobs(plan.next(ready)) == (0, [4])  # left 3: 2 >= 2, the boundary goes out
    plan.done(0)
    assert plan.next(ready) is None  # left 2: 1 < 2, job 5 waits for an idle worker
    assert [q.job for q in plan.queue] == [5, 6]  # put back in place
    plan.done(1)
    plan.done(1)
    assert _jobs(plan.next(ready)) == (1, [5])  # worker 1 idle
    assert plan.next(ready) is None  # left 1 behind a busy worker
    # larger jobs first: 8 and 4 start; 2 waits though worker 0 has room (1 behind it < 2 x 2)
    plan = DispatchPlan([3, 2, 1, 0], workers=2, usable=2, cost={0: 8.0, 1: 4.0, 2: 2.0, 3: 1.0})
    assert [_jobs(plan.next(ready)) for _ in range(3)] == [(0, [0]), (1, [1]), None]
    # the job held back goes back in place, before every job behind it
    plan = DispatchPlan([4, 3, 2, 1, 0], workers=2, usable=2, cost={0: 8.0, 1: 4.0, 2: 2.0, 3: 1.0, 4: 1.0})
    assert [_jobs(plan.next(ready)) for _ in range(3)] == [(0, [0]), (1, [1]), None]  # left 4: 2 behind 2 < 2 x 2
    assert [q.job for q in plan.queue] == [2, 4, 3]  # 4 and 3 tie: the given order
    # one worker: the rule would only idle it
    plan = DispatchPlan([0, 1], workers=1, usable=1, cost={0: 5.0, 1: 1.0})
    assert [_jobs(plan.next({0})) for _ in range(3)] == [(0, [0]), (0, [1]), None]


def test_small_jobs_are_grouped_to_a_sixteenth_of_the_share_and_half_of_what_is_queued():
    # one worker: a group holds at most total / 16 = 2 and half the queued cost
    cost = {"A": 16.0, **{f"b{i}": 1.0 for i in range(16)}}
    plan = DispatchPlan(list(cost), workers=1, usable=1, cost=cost, grouped=True)
    assert plan.grouping and plan.group_cost == 2.0
    groups = []
    while (step := plan.next({0})) is not None:
        groups.append(_jobs(step)[1])
        plan.done(0)
    # left 16, 14, ..., 4: limit 2 (pairs); left 2: limit 1; left 1: limit 0.5 (a job larger goes alone)
    assert groups == [["A"]] + [[f"b{i}", f"b{i + 1}"] for i in range(0, 14, 2)] + [["b14"], ["b15"]]
    # without submit_many, or without costs: one job a task
    plan = DispatchPlan(list(cost), workers=1, usable=1, cost=cost)
    assert not plan.grouping and _jobs(plan.next({0})) == (0, ["A"]) and _jobs(plan.next({0})) == (0, ["b0"])
    assert not DispatchPlan(list(cost), 1, 1, grouped=True).grouping
    # 256 jobs of 1/128 behind one of 30 (total 32, share limit 2): half of what is left, at most 64 jobs
    cost = {"B": 30.0, **{i: 1 / 128 for i in range(256)}}
    plan = DispatchPlan(list(cost), workers=1, usable=1, cost=cost, grouped=True)
    sizes = []
    while (step := plan.next({0})) is not None:
        sizes.append(len(step[1]))
        plan.done(0)
    # left 2 -> 1 (128 fit), 1.5 -> .75 (96), 1 -> .5 (64), then 32, 16, 8, 4, 2, 1 and the last one
    assert sizes == [1, 64, 64, 64, 32, 16, 8, 4, 2, 1, 1]


def test_with_several_workers_groups_hold_a_sixteenth_of_each_share_and_a_quarter_of_what_is_queued():
    # 2 usable workers, total 64: a group holds at most 64 / (16 x 2) = 2 and left / (2 x 2); each task comes
    # back before the next goes out (no tail rule)
    cost = {"A": 32.0, **{i: 1.0 for i in range(32)}}
    plan = DispatchPlan(list(cost), workers=2, usable=2, cost=cost, grouped=True)
    assert plan.group_cost == 2.0
    sizes = []
    while (step := plan.next({0, 1})) is not None:
        sizes.append(len(step[1]))
        plan.done(step[0])
    # left 32, 30, ..., 8: pairs (jobs 0-25); left 6, 5, 4, 3, 2, 1: limits 1.5 to 0.25, one job each
    assert sizes == [1] + [2] * 13 + [1] * 6
    # no usable worker yet at the map's start: the share is one worker's, as with one
    assert DispatchPlan(list(cost), 2, 0, cost=cost, grouped=True).group_cost == 4.0
    # a share below one cost unit still groups (total 8, one worker: 0.5), and without grouping small jobs go alone
    cost = {i: 0.125 for i in range(64)}
    plan = DispatchPlan(list(cost), workers=1, usable=1, cost=cost, grouped=True)
    assert plan.grouping and plan.group_cost == 0.5 and len(plan.next({0})[1]) == 4
    plan = DispatchPlan(list(cost), workers=1, usable=1, cost=cost)
    assert not plan.grouping and len(plan.next({0})[1]) == 1
    # a group's running cost adds the jobs it took, in order (not the queue's last job)
    cost = {"A": 14.75, "p": 0.25, "q": 0.25, "r": 0.25, "z": 1.0}
    plan = DispatchPlan(list(cost), workers=1, usable=1, cost=cost, grouped=True, largest_first=False)
    assert _jobs(plan.next({0})) == (0, ["A"])
    plan.done(0)
    assert _jobs(plan.next({0})) == (0, ["p", "q", "r"])  # limit min(16.5 / 16, 1.75 / 2) = 0.875


def test_a_solo_job_waits_for_an_idle_worker_holds_the_queue_and_travels_alone():
    plan = DispatchPlan([0, 1, 2, 3], workers=2, usable=2)
    ready = {0, 1}
    assert [_jobs(plan.next(ready)) for _ in range(4)] == [(0, [0]), (1, [1]), (0, [2]), (1, [3])]
    plan.done(1)  # a task of worker 1 came back: the ledger asks for a solo re-run of job 1 and job 3's retry
    plan.requeue(Attempt(3, 1))
    plan.requeue(Attempt(1, 0, solo=True))
    assert plan.next(ready) is None  # worker 1 has room for job 3, but the solo head holds the queue
    plan.done(1)
    assert _sent(plan.next(ready)) == (1, [(1, 0, True)])
    assert plan.next(ready) is None  # worker 1 runs a solo job: nothing joins it; worker 0 is full
    plan.done(0)
    assert _sent(plan.next(ready)) == (0, [(3, 1, False)])
    plan.done(1)
    assert plan.solo_on == set() and plan.load == [2, 0]
    # with grouping (total 64: groups up to 4, half the queued cost): a solo job goes alone and ends the group
    # before it; without it, x, y, z would travel together (0.75 <= 1.5 / 2)
    small = ["x", "y", "z", "w", "v", "u"]
    cost = {"B": 62.5, **{j: 0.25 for j in small}}

    def groups(solo):
        plan = DispatchPlan(list(cost), workers=1, usable=1, cost=cost, grouped=True)
        plan.queue = [Attempt(j, 0, solo=j == solo) for j in small]
        out = []
        while (step := plan.next({0})) is not None:
            out.append(_jobs(step)[1])
            plan.done(0)
        return out

    assert groups(solo=None) == [["x", "y", "z"], ["w"], ["v"], ["u"]]  # limits .75, .375, .25, .125
    assert groups(solo="y") == [["x"], ["y"], ["z", "w"], ["v"], ["u"]]  # limits .75, .625, .5, .25, .125


def test_a_run_is_alone_only_while_no_other_job_is_on_its_worker():
    ledger = FailureLedger(retries=1)
    (a,) = ledger.start(0, [Attempt("a", 0)])
    assert a.alone and (a.worker, a.job, a.attempt) == (0, "a", 0)
    (b,) = ledger.start(0, [Attempt("b", 2)])
    assert not a.alone and not b.alone  # both shared worker 0
    ledger.finish([b])
    assert not a.alone  # it shared its worker once: that stays
    (c,) = ledger.start(0, [Attempt("c", 0)])
    assert not c.alone  # a is still there
    ledger.finish([a, c])
    (d,) = ledger.start(0, [Attempt("d", 0)])
    (e,) = ledger.start(1, [Attempt("e", 0)])
    assert d.alone and e.alone  # workers apart
    f, g = ledger.start(2, [Attempt("f", 0), Attempt("g", 0)])
    assert not f.alone and not g.alone  # a group shares its task


def test_own_faults_are_charged_retried_with_the_next_attempt_and_dropped_past_the_budget():
    ledger = FailureLedger(retries=2)
    verdicts = []
    for attempt in range(3):
        (run,) = ledger.start(0, [Attempt("j", attempt)])
        ledger.finish([run])
        verdicts.append(ledger.charge(run, f"boom {attempt}"))
    assert verdicts == [Verdict("j", Attempt("j", 1)), Verdict("j", Attempt("j", 2)), Verdict("j", None, "boom 2")]
    assert ledger.retried == 2 and ledger.charged == {"j": 2} and ledger.reruns == 0
    assert ledger.dropped == [("j", "boom 2")]
    ledger = FailureLedger(retries=0)
    (run,) = ledger.start(0, [Attempt(7, 0)])
    assert ledger.charge(run, "oom") == Verdict(7, None, "oom") and ledger.retried == 0 and ledger.charged == {}


def test_a_worker_death_charges_only_a_job_alone_on_a_worker_whose_process_was_replaced():
    ledger = FailureLedger(retries=1)
    (a,) = ledger.start(0, [Attempt("a", 0)])
    b, c = ledger.start(1, [Attempt("b", 1), Attempt("c", 0)])
    # worker 1 died with a group on it: both re-run alone, same attempt, uncharged
    ledger.finish([b, c])
    assert ledger.worker_died([b, c], "died", in_pool=True) == [Verdict("b", Attempt("b", 1, solo=True)),
                                                                Verdict("c", Attempt("c", 0, solo=True))]
    assert ledger.reruns == 2 and ledger.retried == 0 and not ledger.awaiting
    # worker 0 died with a alone on it: no verdict until the worker answers a ping
    ledger.finish([a])
    assert ledger.worker_died([a], "died", in_pool=True) == [] and ledger.awaiting
    assert ledger.answered(1, died=True) == []  # nothing waited on worker 1
    assert ledger.answered(0, died=True) == [Verdict("a", Attempt("a", 1))]  # a new pid: a's fault, charged
    assert not ledger.awaiting and ledger.retried == 1 and ledger.charged == {"a": 1} and ledger.reruns == 2
    # the same answer with the old pid: the process never died, the job re-runs uncharged
    (a,) = ledger.start(0, [Attempt("a", 1)])
    ledger.finish([a])
    ledger.worker_died([a], "unreachable", in_pool=True)
    assert ledger.answered(0, died=False) == [Verdict("a", Attempt("a", 1, solo=True))] and ledger.reruns == 3
    # charged past the budget (a worker that left the pool answers died): dropped with the death's reason
    ledger.worker_died([a], "died again", in_pool=True)
    assert ledger.answered(0, died=True) == [Verdict("a", None, "died again")]
    assert ledger.dropped == [("a", "died again")] and ledger.retried == 1
    # a lone job on a worker already out of the pool: not its fault, re-run uncharged
    (d,) = ledger.start(2, [Attempt("d", 0)])
    ledger.finish([d])
    assert ledger.worker_died([d], "gone", in_pool=False) == [Verdict("d", Attempt("d", 0, solo=True))]
    assert not ledger.awaiting and ledger.reruns == 4
