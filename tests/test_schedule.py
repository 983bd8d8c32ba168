"""The concurrency rule (engine/running/schedule.py) against hand-computed schedules."""
from __future__ import annotations

import pytest

from rayfed_dg.engine.running.schedule import FedJob, grow, plan, simulate


def job(key, *clients, rounds=1):
    return FedJob(key, tuple(float(c) for c in clients), rounds)


def test_round_time_packs_largest_first_on_the_least_loaded_worker():
    j = job("a", 2, 5, 3, 2)
    # 5 | 3, then 2 -> the 3 (5 | 5), then 2 -> the first (7 | 5)
    assert j.round_time(2) == 7.0
    assert j.round_time(1) == 12.0
    assert j.round_time(4) == 5.0 and j.round_time(9) == 5.0  # more workers than clients idle
    assert (j.max_workers, j.work) == (4, 12.0)
    assert job("b", 1, 1, 2).round_time(2) == 2.0  # in the given order it would be 1 + 2 on one worker


def test_list_scheduling_longest_first_hand_schedule():
    jobs = [job("c", 3), job("a", 4), job("b", 3)]
    p = plan(jobs, 2, width=1)
    assert p.order == ["a", "b", "c"]  # longest first, the key breaking the tie
    s = simulate(jobs, 2, width=1)
    # a on one worker 0-4, b on the other 0-3, c starts when b ends: 3-6
    assert s.start == {"a": 0.0, "b": 0.0, "c": 3.0}
    assert s.end == {"a": 4.0, "b": 3.0, "c": 6.0}
    assert (s.makespan, s.ideal, s.most_running) == (6.0, 5.0, 2)


def test_width_is_the_one_with_the_shortest_simulated_makespan():
    one = [job("x", 1, 1, 1, rounds=2)]
    assert plan(one, 3).width == {"x": 3}  # alone: every client on its own worker, 1 per round
    assert simulate(one, 3).makespan == 2.0
    two = [job(i, 1, 1, 1, rounds=2) for i in range(2)]
    # on 6 workers: both at once on 3 each (1 per round) -> 2; on 1 each, the other 4 join for round 2 -> 3 + 1
    assert simulate(two, 6, width=3).makespan == 2.0
    assert simulate(two, 6, width=1).makespan == 4.0
    assert plan(two, 6).width == {0: 3, 1: 3}
    four = [job(i, 1, 1, 1, rounds=2) for i in range(4)]
    # on 4 workers: one worker each, all at once -> 6; on 3 each, one at a time (a start needs 3 free) -> 8
    assert simulate(four, 4, width=1).makespan == 6.0
    assert simulate(four, 4, width=3).makespan == 8.0
    assert plan(four, 4).width == {i: 1 for i in range(4)}


def test_max_running_and_engine_num_workers_bound_the_plan():
    jobs = [job(i, 1, 1) for i in range(3)]
    s = simulate(jobs, 8, max_running=1)
    assert s.most_running == 1 and s.makespan == 3.0  # one after another, each on 2 workers
    assert plan(jobs, 8, width=1).width == {0: 1, 1: 1, 2: 1}


def test_grow_gives_free_workers_to_the_longest_remaining_federation_that_gains():
    long, short, full = job("long", 1, 1, 1), job("short", 1, 1, 1), job("full", 1, 1)
    running = {"long": (long, 1, 5), "short": (short, 1, 1), "full": (full, 2, 9)}
    # long: 5 rounds x 3 left; short: 1 x 3; full already has a worker per client
    assert grow(running, 1) == {"long": 1}
    # then long's 5 x 2 = 10 still leads short's 3: both extra workers to it (3 clients: 3 workers)
    assert grow(running, 2) == {"long": 2}
    assert grow(running, 4) == {"long": 2, "short": 2}
    assert grow({"last": (long, 1, 0)}, 3) == {}  # no round left to start: nothing to serve


def test_grown_workers_serve_from_the_next_round():
    jobs = [job("a", 1, 1, rounds=2), job("b", 1, 1, rounds=4)]
    s = simulate(jobs, 2, width=1)
    # each on one worker (rounds of 2); a ends at 4, b's worker count doubles for its rounds 3 and 4
    assert s.widths == {"b": [1, 1, 2, 2], "a": [1, 1]}
    assert s.makespan == 6.0


def test_a_federation_in_its_last_round_gets_no_worker():
    jobs = [job("a", 1), job("b", 4, 4), job("c", 1, 1, rounds=3)]
    s = simulate(jobs, 3, width=1)
    # a frees its worker at 1, while b's only round (8) runs: c gets it for its rounds 2 and 3 (1 each, not 2)
    assert s.widths["c"] == [1, 2, 2] and s.end["c"] == 4.0
    assert s.widths["b"] == [1] and s.end["b"] == 8.0


def test_a_cluster_without_a_worker_is_refused():
    with pytest.raises(ValueError, match="slots=0"):
        plan([job("a", 1)], 0)


# ------------------------------------------------------------ costs from a run's config, and the edges


def test_a_federations_cost_comes_from_its_config_and_partition(tiny_ds):
    """fed_job on a real config and split, as the driver calls it: samples stepped per client of a round."""
    from conftest import tiny_cfg

    from rayfed_dg.engine.running.plan import split_for
    from rayfed_dg.engine.running.schedule import fed_job

    def cost(*sets):
        cfg = tiny_cfg("partition.strategy=single_domain", "partition.num_clients=3", *sets)
        split = split_for(cfg, tiny_ds, "texture")
        return split, fed_job("k", cfg, split)

    _, steps = cost("training.local_steps=3", "training.batch_size=16", "training.rounds=4")
    assert steps.round_clients == (48.0, 48.0, 48.0) and steps.rounds == 4  # 3 steps x 16, whatever the sizes
    split, epochs = cost("training.local_steps=null", "training.local_epochs=2")
    sizes = [float(s) for s in split.client_sizes()]
    assert len(set(sizes)) > 1  # unequal clients: the mean below differs from any one of them
    assert epochs.round_clients == tuple(2 * s for s in sizes)
    _, two = cost("training.local_steps=null", "training.local_epochs=2", "training.clients_per_round=2")
    assert two.round_clients == (2 * sum(sizes) / 3,) * 2  # k sampled of n: k clients of mean size


def test_grow_ranks_by_rounds_left_times_round_time():
    # a: 1 round of 12 (12 left); b: 4 rounds of 2.5 (10): a ratio would pick b here, a sum a in the next line
    a, b = job("a", 6, 6), job("b", 1.25, 1.25)
    assert grow({"a": (a, 1, 1), "b": (b, 1, 4)}, 1) == {"a": 1}
    assert grow({"a": (a, 1, 1), "b": (b, 1, 6)}, 1) == {"b": 1}  # 6 x 2.5 = 15 > 12
    twin = job("t", 1, 1)
    assert grow({"x": (twin, 1, 1), "y": (twin, 1, 1)}, 1) == {"x": 1}  # a tie: the first key
    small = job("s", 0.25, 0.25)
    assert grow({"s": (small, 1, 1)}, 1) == {"s": 1}  # any gain counts, however little remains


def test_grow_adds_a_worker_only_where_the_next_one_shortens_a_round():
    # [4, 1, 1] on 2 workers: 4 | 2, on 3: 4 | 1 | 1: no gain, no worker
    assert grow({"a": (job("a", 4, 1, 1), 2, 3)}, 1) == {}
    # [3, 3, 3, 3]: 6 on 2 workers and on 3, 3 only on 4: one more worker alone gains nothing
    assert grow({"q": (job("q", 3, 3, 3, 3), 2, 3)}, 1) == {}
    assert grow({"q": (job("q", 3, 3, 3, 3), 2, 3)}, 2) == {}


def test_free_workers_wait_while_a_federation_waits_to_start():
    # one at a time (max_running 1) on 2 slots at width 1: a keeps its one worker while b waits; b, alone, grows
    s = simulate([job("a", 1, 1, rounds=2), job("b", 1, 1, rounds=2)], 2, max_running=1, width=1)
    assert s.widths == {"a": [1, 1], "b": [1, 2]}


def test_a_wide_federation_first_in_line_is_not_skipped_for_a_narrow_one():
    # c (2 workers) starts; a needs 2 of the 1 left and waits, though b behind it needs 1: the order holds
    jobs = [job("c", 5, 5), job("a", 4, 4), job("b", 3)]
    s = simulate(jobs, 3, width=2)
    assert s.start == {"c": 0.0, "a": 5.0, "b": 5.0}


def test_longest_work_first_whatever_the_keys():
    assert plan([job("a", 1), job("b", 5), job("c", 3)], 1).order == ["b", "c", "a"]


def test_schedule_ratio_is_makespan_over_the_ideal():
    from rayfed_dg.engine.running.schedule import Schedule

    assert Schedule(6.0, 4.0).ratio == 1.5
    assert Schedule(1.5, 0.5).ratio == 3.0  # an ideal below one second still divides
    assert Schedule(0.0, 0.0).ratio == 1.0  # no work: nothing to waste


def test_edges_no_federation_one_slot_one_client():
    empty = simulate([], 2)
    assert (empty.makespan, empty.most_running, empty.start) == (0.0, 0, {})
    jobs = [job("a", 2, 1, rounds=2), job("b", 3)]
    s = simulate(jobs, 1)  # one worker: one federation after the other, every client in turn
    assert (s.makespan, s.most_running) == (9.0, 1)
    assert job("one", 5).max_workers == 1 and job("none").max_workers == 1
    assert job("two", 2, 3).round_time(0) == 5.0  # no worker counts as one, not as none
    j = job("f", 1, 2)
    with pytest.raises(AttributeError):  # frozen: round_time's sorted cache can never go stale
        j.round_clients = (9.0,)
