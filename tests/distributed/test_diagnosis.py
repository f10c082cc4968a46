"""The timeout diagnosis as a pure function of Redis's answers (no Redis needed)."""

from __future__ import annotations

from asyncgraph.distributed._diagnosis import commands, explain

NOW = [b"1700000000", b"0"]  # TIME: 1,700,000,000,000 ms
LIVE = b"1700000009000"
GONE = b"1699999990000"


def test_it_asks_where_the_task_is_once_it_was_sent() -> None:
    assert len(commands("q", None)) == 5
    asked = commands("q", b"5-0")
    assert asked[-2][:3] == ["XPENDING", "asyncgraph:{q}:tasks", "workers"]
    assert asked[-1] == ["XRANGE", "asyncgraph:{q}:tasks", b"5-0", b"5-0"]


def test_no_live_worker_counts_what_silent_workers_hold_apart_from_what_waits() -> None:
    replies = [NOW, [b"w-stopped", GONE], 9, [], [7, b"1-0", b"7-0", [[b"w-stopped", b"7"]]]]
    text = explain(replies, queue="q", task_id="a", client_id="c" * 32, signed=False)
    assert "no worker of queue 'q' is alive" in text
    assert "2 task(s) waiting" in text
    assert "7 held by silent worker(s) w-stopped (no heartbeat: stopped, stuck or dead" in text


def test_a_task_held_by_a_silent_worker_while_others_live_says_so() -> None:
    replies = [
        NOW,
        [b"w-live", LIVE, b"w-stopped", GONE],
        1,
        [],
        [1, b"1-0", b"1-0", [[b"w-stopped", b"1"]]],
        [[b"1-0", b"w-stopped", 12000, 1]],
        [[b"1-0", [b"m", b"x"]]],
    ]
    text = explain(replies, queue="q", task_id="a", client_id="c" * 32, signed=True)
    assert text.startswith(
        "task a is being processed by worker w-stopped (silent: no heartbeat; stopped, "
        "stuck or dead) (delivered 1 time(s), lease renewed 12000 ms ago): 1 worker(s) alive"
    )
    assert "0 task(s) waiting, 1 held by silent worker(s) w-stopped" in text


def test_dead_letters_of_this_client_name_the_secret_problem() -> None:
    me = "c" * 32
    dead = [
        (b"1-0", [b"reason", b"forged", b"error", b"bad signature", b"client", me.encode()]),
        (b"2-0", [b"reason", b"forged", b"error", b"bad signature", b"client", b"d" * 32]),
    ]
    replies = [NOW, [b"w", LIVE], 0, dead, [0, None, None, None]]
    text = explain(replies, queue="q", task_id="a", client_id=me, signed=False)
    assert "1 task(s) of this client were dead-lettered as unsigned or forged" in text
    assert "this client has no secret" in text


def test_a_worker_keeps_a_task_past_its_clients_deadline_for_the_diagnosis() -> None:
    from asyncgraph.distributed.worker._admission import EXPIRY_GRACE_MS, task_deadline

    # A task sent at Redis time 10,000 ms that its client waits 1 s for, read at once.
    now = 50.0
    left = task_deadline(10_000 + 1000, 10_000, now) - now
    # The client gives up after 1 s, then diagnoses and cancels: the worker holds on.
    assert EXPIRY_GRACE_MS >= 500
    assert left == 1 + EXPIRY_GRACE_MS / 1000
