"""The auto model's chooser: it learns each path's speed per load level, in blocks of one path that
are twice the level's size, from generations that ran among their own path, takes the faster one,
still running the other one block in ``explore_every`` (less often when the margin is wide), and
follows a change of speed."""

from __future__ import annotations

from collections import Counter

import pytest

from relay_serve.relay.auto import AutoChooser, AutoSettings, LoadClock, bucket


def test_load_levels_are_the_nearest_powers_of_two_on_a_log_scale():
    loads = (0, 1, 1.4, 1.5, 2, 2.8, 3, 5.6, 5.7, 8, 22.6, 22.7, 31.4, 32, 45, 46, 64, 100)
    assert [bucket(n) for n in loads] == [1, 1, 1, 2, 2, 2, 4, 4, 8, 8, 16, 32, 32, 32, 32, 64, 64, 128]


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_load_clock_gives_each_generation_the_mean_load_of_its_life():
    now = FakeTime()
    clock = LoadClock(now)
    a = clock.enter()  # t=0: a alone
    now.t = 1.0
    b = clock.enter()  # t=1: a and b
    now.t = 3.0
    assert clock.mean_since(b) == pytest.approx(2.0)  # b has only ever run beside a
    clock.leave(b)
    now.t = 4.0
    assert clock.mean_since(a) == pytest.approx((1 * 1 + 2 * 2 + 1 * 1) / 4)
    assert clock.n == 1


def test_a_burst_teaches_the_level_it_ran_under_not_the_one_it_started_at():
    """64 clients start at once: the first ones start with 1, 2, 4 ... in flight but run under 64.
    They teach level 64 only; level 1 then learns from generations that ran alone."""
    now = FakeTime()
    clock, chooser = LoadClock(now), AutoChooser(AutoSettings(min_samples=4, explore_every=20))
    cost = {1: {"relay": 0.010, "large": 0.013}, 64: {"relay": 0.006, "large": 0.005}}  # s per token by level
    burst = [(chooser.choose(clock.n + 1), clock.enter()) for _ in range(64)]
    now.t = 10.0
    for path, mark in burst:
        chooser.record(path, clock.mean_since(mark), cost[64][path] * 100, 100)
    for _, mark in burst:
        clock.leave(mark)
    taught = {level for level, figures in chooser.state().items() if any(f["samples"] for f in figures.values())}
    assert taught == {"64"}
    alone = Counter()
    for _ in range(100):
        path = chooser.choose(clock.n + 1)
        mark = clock.enter()
        now.t += 1.0
        chooser.record(path, clock.mean_since(mark), cost[1][path] * 100, 100)
        clock.leave(mark)
        alone[path] += 1
    assert alone["relay"] > 85  # 4 to learn large, then one in 20


def test_the_load_clock_gives_the_most_in_flight_at_any_moment_of_a_window():
    now = FakeTime()
    clock = LoadClock(now)
    assert clock.peak(30) == 0
    marks = [clock.enter() for _ in range(5)]  # t=0: five at once
    now.t = 10.0
    for mark in marks[:4]:
        clock.leave(mark)
    late = clock.enter()  # t=10: two in flight
    now.t = 20.0
    assert clock.peak(30) == 5 and clock.peak(15) == 5  # five were in flight until t=10
    assert clock.peak(9) == 2
    clock.leave(marks[4])
    clock.leave(late)
    now.t = 45.0
    assert clock.peak(40) == 5 and clock.peak(30) == 2 and clock.peak(20) == 0  # none in flight since t=20
    # against a brute force over random enters and leaves: the count as a step function of time,
    # its most over the window: the count in force at the window's start and after each change inside
    import random

    rng = random.Random(3)
    now, changes, marks = FakeTime(), [], []
    clock = LoadClock(now)
    for _ in range(400):
        now.t += rng.random() * rng.choice((0.0, 1.0))  # some at the same moment
        if marks and rng.random() < 0.45:
            clock.leave(marks.pop(rng.randrange(len(marks))))
        else:
            marks.append(clock.enter())
        changes.append((now.t, len(marks)))
        window = rng.choice((0.5, 3.0, 20.0))
        start = now.t - window
        at_start = next((n for t, n in reversed(changes) if t <= start), 0)
        expected = max([at_start] + [n for t, n in changes if t > start])
        assert clock.peak(window) == expected


@pytest.mark.parametrize("window", [30.0, None])
def test_a_burst_after_a_burst_is_chosen_at_the_level_it_will_run_under(window: float | None):
    """Chosen by the most in flight of late: a second burst of 64 runs level 64's block from its first
    generation, which its start count (1, 2, 3, ...) would have put at levels 1-32. By default "of
    late" is the first burst's life (8 s): it ended 1 s before."""
    now = FakeTime()
    clock, chooser = LoadClock(now), AutoChooser(AutoSettings(min_samples=4, load_window_s=window))
    first = [clock.enter() for _ in range(64)]
    now.t = 8.0
    for mark in first:
        clock.leave(mark)
    now.t = 9.0
    levels = []
    for _ in range(64):
        load = chooser.load_ahead(clock)
        levels.append(bucket(load))
        chooser.choose(load)
        clock.enter()
    assert set(levels) == {64}
    assert set(chooser.levels) == {64} and chooser.levels[64].started == {"relay": 64, "large": 0}
    now.t = 30.0  # a burst's life after the second began; the most in flight over the last 8 s: the 64 of it
    assert clock.peak(chooser.load_window_s(clock)) == 64


def run(chooser: AutoChooser, load: int, n: int, s_per_token: dict[str, float]) -> Counter:
    """``n`` generations at ``load``, each path taking its ``s_per_token`` for 100 tokens."""
    chosen = Counter()
    for _ in range(n):
        path = chooser.choose(load)
        chosen[path] += 1
        chooser.record(path, load, s_per_token[path] * 100, 100)
    return chosen


def test_it_tries_both_then_takes_the_faster_path_per_load_level():
    chooser = AutoChooser(AutoSettings(min_samples=4, explore_every=20))
    low = run(chooser, 1, 200, {"relay": 0.010, "large": 0.013})  # relay faster when the engines are idle
    # blocks of 2: relay, large, relay, large (4 of each learnt), then 96 blocks of relay; the margin,
    # ln 1.3 = 0.26, is over 4 x explore_margin (0.05): one block in 20 x 4 = 80 explores the large path
    assert low == {"relay": 200 - 6, "large": 4 + 2}
    close = run(chooser, 2, 400, {"relay": 0.0100, "large": 0.0103})  # a margin of 0.03: one block in 20
    # blocks of 4: relay, large (4 of each learnt), then 98 blocks: the 20th, 40th, 60th and 80th explore
    assert close == {"relay": 4 + 94 * 4, "large": 4 + 4 * 4}
    high = run(chooser, 32, 64 * 100, {"relay": 0.006, "large": 0.005})  # large faster under load
    # blocks of 64: relay, large, then 98 of large; margin ln 1.2 = 0.18: one block in 20 x 3.65 = 73 explores
    assert high == {"relay": 2 * 64, "large": 98 * 64}
    state = chooser.state()
    assert state["1"]["relay"]["ms_per_token"] == pytest.approx(10.0) and state["32"]["large"][
        "ms_per_token"
    ] == pytest.approx(5.0)


def test_it_follows_a_path_that_became_slower():
    chooser = AutoChooser(AutoSettings(min_samples=2, explore_every=5, window=4))
    before = run(chooser, 8, 50, {"relay": 0.010, "large": 0.020})
    later = run(chooser, 8, 200, {"relay": 0.030, "large": 0.020})  # relay's engines got slower
    # blocks of 16, one in 5 explores: the rest of a relay block, then mostly large
    assert before["relay"] > before["large"] and later["large"] > 0.65 * 200


def test_failed_or_empty_generations_teach_nothing():
    chooser = AutoChooser()
    chooser.record("relay", 1, 0.0, 0)
    chooser.record("large", 1, 1.0, 0)
    assert chooser.state() == {}
    assert [chooser.choose(1) for _ in range(4)] == [
        "relay",
        "relay",
        "large",
        "large",
    ]  # still learning: both in blocks of 2, relay first


def test_a_level_runs_blocks_of_one_path_twice_its_size():
    chooser = AutoChooser(AutoSettings(min_samples=4))
    burst = [chooser.choose(8) for _ in range(32)]  # all start before any finished
    assert burst == ["relay"] * 16 + ["large"] * 16


def test_generations_that_ran_among_the_other_path_teach_nothing():
    chooser = AutoChooser(AutoSettings(min_purity=0.75))
    chooser.record("relay", 8, 1.0, 100, purity=0.5)
    assert chooser.state() == {}
    chooser.record("relay", 8, 1.0, 100, purity=0.8)
    assert chooser.state()["8"]["relay"]["samples"] == 1


def test_the_load_clock_gives_the_share_of_a_generations_life_on_its_own_path():
    now = FakeTime()
    clock = LoadClock(now)
    r = clock.enter("relay")  # t=0..2: r alone; t=2..4: r and a large one
    now.t = 2.0
    large = clock.enter("large")
    now.t = 4.0
    assert clock.share_since(r) == pytest.approx((2 * 1 + 2 * 1) / (2 * 1 + 2 * 2))
    assert clock.mean_since(r) == pytest.approx(1.5)
    clock.leave(large)
    clock.leave(r)
    assert clock.n == 0


def test_relay_that_is_faster_alone_but_slower_for_all_is_not_chosen():
    """A relay generation among large ones is faster than they are (the small model's tokens), but
    its handoffs slow every generation down: with every generation relayed, each is slower than
    with none. 32 in flight, a generation's cost set by the share of relay among them; chosen
    one generation at a time, judged by what each costs beside the others, relay would win."""
    chooser = AutoChooser(AutoSettings(min_samples=4, explore_every=20))

    def cost(path: str, relay_share: float) -> float:  # seconds per token
        return (0.004 if path == "relay" else 0.005) + 0.003 * relay_share

    in_flight: list[str] = [chooser.choose(32) for _ in range(32)]
    chosen = Counter()
    for step in range(4000):
        done = in_flight.pop(0)
        share = in_flight.count("relay") / len(in_flight)
        purity = share if done == "relay" else 1 - share
        chooser.record(done, 32, cost(done, share) * 100, 100, purity=purity)
        path = chooser.choose(32)
        in_flight.append(path)
        if step >= 1000:
            chosen[path] += 1
    assert cost("relay", 1.0) > cost("large", 0.0) and cost("relay", 0.0) < cost("large", 0.0)
    assert chosen["large"] > 0.9 * sum(chosen.values())


def test_a_machine_whose_speed_drifts_does_not_turn_the_comparison_of_the_paths_around():
    """Relay is 10% faster than the large path at every moment, at level 8. Both are learnt; after a
    pause the whole machine runs a round 20% slower (another process, a slow minute), then two at
    full speed. Comparing each path's own last figures, relay's from the slow round (12 ms a token)
    against the large path's from before it (11) turns to the large path, whose figure then comes
    from the fast rounds (11) against relay's from the slow one: the large path for good, but for
    the explore blocks (the bench at 8 relayed a slow round, then ran the large path while relay was
    3-13% faster). Compared only with generations of the same time, relay stays faster."""
    now = FakeTime()
    chooser = AutoChooser(AutoSettings(), clock=now)  # min_samples 8, window 32, blocks of 16 at level 8
    speed = {"relay": 0.010, "large": 0.011}  # s per token when the machine runs at full speed

    def serve(blocks: int, slowdown: float) -> list[set[str]]:
        """Blocks of 8 clients: each block's 16 generations start before the first of them ends."""
        ran = []
        for _ in range(blocks):
            paths = [chooser.choose(8) for _ in range(16)]
            for path in paths:
                seconds = speed[path] * slowdown * 100
                now.t += seconds / 8  # 8 in flight: one ends every eighth of a life
                chooser.record(path, 8, seconds, 100)
            ran.append(set(paths))
        return ran

    assert serve(4, 1.0) == [{"relay"}, {"large"}, {"relay"}, {"relay"}]  # one block of each to learn
    now.t += 600.0  # the bench runs the other modes' rounds
    rounds = serve(2, 1.2)
    now.t += 600.0
    rounds += serve(2, 1.0)
    now.t += 600.0
    rounds += serve(2, 1.0)
    assert rounds == [{"relay"}] * 6
    level = chooser.state()["8"]
    assert level["relay"]["over_other"] == pytest.approx(10 / 11, rel=0.01)
    assert level["relay"]["pairs"] + level["large"]["pairs"] == 32 and level["large"]["over_other"] == pytest.approx(
        11 / 10, rel=0.01
    )


def test_a_path_is_judged_by_its_seconds_over_its_tokens_not_by_the_mean_of_its_generations_ratios():
    """Relay's short generations are slow per token (the first token's wait counts over few tokens),
    its long ones fast; the large model's all alike. Per token of output relay is faster: 2.5 s for
    210 tokens against 3.15 s; the mean of its generations' ratios (30 ms against 15) says the
    opposite."""
    chooser = AutoChooser(AutoSettings(min_samples=4, explore_every=20))
    chosen = Counter()
    for i in range(400):
        path = chooser.choose(1)
        chosen[path] += 1
        if path == "relay":
            tokens, seconds = (10, 0.5) if i % 2 else (200, 2.0)
        else:
            tokens, seconds = (10, 0.15) if i % 2 else (200, 3.0)
        chooser.record(path, 1, seconds, tokens)
    assert chosen["relay"] > 0.85 * 400


def closed_loop(clients: int, life_s: float, until: float, now: FakeTime, clock: LoadClock, chooser: AutoChooser):
    """``clients`` that each start a generation of ``life_s`` as soon as their last one ends, from
    ``now.t`` (staggered over one life) to ``until``; the levels their generations were chosen at."""
    import heapq

    ends: list[tuple[float, int, object]] = []
    levels = []
    start = now.t
    for k in range(clients):
        heapq.heappush(ends, (start + k * life_s / clients, -1, None))  # a client's first start
    while ends:
        t, _, mark = heapq.heappop(ends)
        now.t = t
        if mark is not None:
            clock.leave(mark)
        if t < until:
            load = chooser.load_ahead(clock)
            levels.append(bucket(load))
            chooser.choose(load)
            heapq.heappush(ends, (t + life_s, len(levels), clock.enter()))
    return levels


def test_a_generation_is_chosen_at_the_load_of_the_last_generations_life_not_of_a_fixed_window():
    """Eight clients stop; one client starts as the last of theirs ends. By default the load looked
    back over is the generations' mean life (2 s), so the single client runs at level 1 from its
    third generation; a fixed 30 s window chose nearly all of its first twenty at level 8 (the bench
    measured auto at concurrency 1 on the large model's path after the rounds at 8)."""
    for window, above_1 in ((None, (0, 2)), (30.0, (18, 20))):
        now = FakeTime()
        clock, chooser = LoadClock(now), AutoChooser(AutoSettings(load_window_s=window))
        busy = closed_loop(8, 2.0, 20.0, now, clock, chooser)
        assert busy[8:] and set(busy[8:]) == {8}  # every one after the first eight ran under eight
        assert clock.n == 0 and clock.mean_life_s == pytest.approx(2.0)
        alone = closed_loop(1, 1.5, now.t + 30.0, now, clock, chooser)
        assert len(alone) == 20 and alone[-1] == (8 if window else 1)
        assert above_1[0] <= sum(level > 1 for level in alone) <= above_1[1], (window, alone)
