"""The commands that look after a state's queues: ``list``, ``keys --json``, ``status --json`` and
``--watch``, ``set-interval``; run as users run them, ``python -m ratequeue`` in a subprocess."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ratequeue
from ratequeue.cli.interval import _waiting_tickets, _whole_again
from ratequeue.core.operation import Terms, operation
from ratequeue.core.protocol import NEVER, Record
from ratequeue.state import open_state

from .ops import stored_fields
from .test_cli import HEADER, TIMEOUT, Cli, write_state


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path)


@pytest.fixture
def state_url(tmp_path: Path) -> str:
    return (tmp_path / "state.json").as_uri()


def _record(url: str, name: str) -> Record | None:
    with open_state(url) as state:
        return state.read(name).record


#: the fields of a queue in the JSON of status, list and the watch (docs/cli.md)
QUEUE_FIELDS = [
    "name",
    "exists",
    "interval",
    "interval_us",
    "effective_interval",
    "burst",
    "tickets",
    "pos",
    "unstarted",
    "last_start_age",
    "paused",
    "paused_for",
    "held_for",
    "running",
    "max_running",
    "fair",
    "tenants",
    "now_us",
]


@pytest.fixture
def queues(state_url: str) -> Iterator[str]:
    """A state with four queues: a group's two keys (burst 3), a capped queue with a job running and a
    ticket not started, and a paused one; the URL."""
    # max_late=None: on a loaded host a late wake-up would give the first turn up for a new
    # ticket (G7), and the counts the tests read would differ
    group = ratequeue.LimiterGroup(state_url, name="tenants", rate="100/s", burst=3, max_late=None)
    for key in ("acme", "globex"):
        group[key].acquire()
    group.close()
    capped = ratequeue.Limiter(state_url, name="api", interval=0.1, max_running=3, lease=60, max_late=None)
    turn = capped.acquire()
    with open_state(state_url) as state:
        state.execute(operation("take", "api", Terms.checked(100_000, 1, 0, 3, 60 * 1_000_000)))
        ratequeue.Limiter(state, name="reports", interval=2, max_late=None).acquire()
        state.execute(operation("set_paused", "reports", Terms.checked(2_000_000), paused=True))
    yield state_url
    capped.release(turn)
    capped.close()


def test_list_shows_every_queue_with_its_fields(cli: Cli, queues: str) -> None:
    result = cli("list", queues)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "NAME",
        "INTERVAL",
        "BURST",
        "TICKETS",
        "POS",
        "UNSTARTED",
        "LAST",
        "START",
        "PAUSED",
        "HELD",
        "RUNNING",
    ]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert sorted(rows) == ["api", "reports", "tenants:acme", "tenants:globex"]
    # interval, burst, tickets, pos, unstarted, last start (n.nnn s ago), paused, held, running
    assert rows["api"][:6] == ["0.1", "s", "1", "2", "1", "1"], lines
    assert re.fullmatch(r"\d+\.\d{3}", rows["api"][6]), lines
    assert rows["api"][-3:] == ["no", "-", "1/3"], lines
    assert rows["reports"][:6] == ["2", "s", "1", "1", "1", "0"], lines
    assert rows["reports"][-2:] == ["-", "-"], lines
    assert re.fullmatch(r"yes\(\d+\.\ds\)", rows["reports"][-3]), lines  # paused, and for how long
    assert rows["tenants:acme"][:6] == ["0.01", "s", "3", "1", "1", "0"], lines
    assert "4 queue(s)" in result.stderr

    group = cli("list", queues, "--prefix", "tenants:")
    assert group.returncode == 0, group.stdout + group.stderr
    assert [line.split()[0] for line in group.stdout.splitlines()[1:]] == ["tenants:acme", "tenants:globex"]


def test_list_json(cli: Cli, queues: str) -> None:
    result = cli("list", queues, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    listed = json.loads(result.stdout)
    assert listed["state"] == queues
    assert listed["prefix"] == ""
    assert listed["unreadable"] == []
    rows = {row["name"]: row for row in listed["queues"]}
    assert sorted(rows) == ["api", "reports", "tenants:acme", "tenants:globex"]
    assert all(list(row) == QUEUE_FIELDS for row in rows.values())
    api = rows["api"]
    assert (api["interval"], api["interval_us"], api["burst"]) == (0.1, 100_000, 1)
    assert (api["tickets"], api["pos"], api["unstarted"]) == (2, 1, 1)
    assert (api["running"], api["max_running"], api["paused"]) == (1, 3, False)
    assert 0 <= api["last_start_age"] < 60
    assert rows["reports"]["paused"] is True
    assert rows["reports"]["running"] is None
    assert rows["tenants:acme"]["burst"] == 3
    prefixed = json.loads(cli("list", queues, "--prefix", "tenants:", "--json").stdout)
    assert [row["name"] for row in prefixed["queues"]] == ["tenants:acme", "tenants:globex"]


def test_list_of_an_empty_state(cli: Cli, state_url: str) -> None:
    result = cli("list", state_url, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["queues"] == []


def test_keys_json(cli: Cli, queues: str) -> None:
    result = cli("keys", queues, "tenants:", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout) == {
        "state": queues,
        "prefix": "tenants:",
        "names": ["tenants:acme", "tenants:globex"],
        "unreadable": [],
    }


def test_status_json(cli: Cli, queues: str) -> None:
    result = cli("status", queues, "api", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    status = json.loads(result.stdout)
    assert list(status) == ["state", *QUEUE_FIELDS]
    assert status["state"] == queues
    assert status["name"] == "api"
    assert status["exists"] is True
    assert (status["tickets"], status["pos"], status["unstarted"], status["running"]) == (2, 1, 1, 1)
    with open_state(queues) as state:
        now = state.read("api").now
    assert status["now_us"] <= now

    missing = json.loads(cli("status", queues, "nothing", "--json").stdout)
    assert missing["exists"] is False
    assert missing["interval"] is None
    assert missing["paused"] is False


def test_status_count_needs_watch(cli: Cli, state_url: str) -> None:
    result = cli("status", state_url, "q", "--count", "2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--watch" in result.stderr


@pytest.fixture
def busy(state_url: str) -> Iterator[str]:
    """Queue ``busy`` (interval 10 ms) acquired on by a thread of this process until the test ends."""
    stop = threading.Event()
    started = threading.Event()

    def acquire() -> None:
        limiter = ratequeue.Limiter(state_url, name="busy", interval=0.01)
        try:
            while not stop.is_set():
                limiter.acquire()
                started.set()
        finally:
            limiter.close()

    thread = threading.Thread(target=acquire, daemon=True)
    thread.start()
    assert started.wait(TIMEOUT)
    yield "busy"
    stop.set()
    thread.join(TIMEOUT)


def test_watch_json_shows_the_rate_observed_between_refreshes(cli: Cli, state_url: str, busy: str) -> None:
    result = cli("status", state_url, busy, "--watch", "--count", "3", "--every", "0.05", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    refreshes = [json.loads(line) for line in result.stdout.splitlines()]
    assert [refresh["refresh"] for refresh in refreshes] == [1, 2, 3]
    assert all(list(refresh)[: len(QUEUE_FIELDS) + 1] == ["state", *QUEUE_FIELDS] for refresh in refreshes)
    assert refreshes[0]["rate"] is None  # one refresh: nothing to compare yet
    last = refreshes[-1]
    assert last["rate"] > 0
    assert last["rate_window"] > 0
    assert refreshes[0]["pos"] < last["pos"]
    # the rate is the starts seen between the first refresh and the last, over the time between them
    assert last["rate"] * last["rate_window"] == pytest.approx(last["pos"] - refreshes[0]["pos"])
    assert 1 / last["rate"] >= 0.01 * 0.5  # no faster than the interval allows, give or take a refresh


def test_watch_piped_prints_one_line_per_refresh(cli: Cli, state_url: str, busy: str) -> None:
    result = cli("status", state_url, busy, "--watch", "--count", "2", "--every", "0.05")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3, result.stdout
    assert lines.pop(0) == f"watching queue 'busy' in {state_url} every 0.05 s (Ctrl-C ends)"
    assert re.match(r"^\d\d:\d\d:\d\d busy: pos \d+, rate - ", lines[0]), lines
    assert re.match(
        r"^\d\d:\d\d:\d\d busy: pos \d+, rate \d+\.\d\d/s .*\(observed by the watcher\)", lines[1]
    )
    assert "\x1b[" not in result.stdout  # no terminal codes in a pipe


@pytest.mark.skipif(
    sys.platform == "win32", reason="a process group and SIGINT, as a POSIX terminal sends them"
)
def test_watch_ends_with_status_0_on_ctrl_c(cli: Cli, state_url: str) -> None:
    watch = cli.popen("status", state_url, "q", "--watch", "--every", "0.05")
    try:
        assert watch.stdout is not None
        assert watch.stdout.readline().startswith("watching queue 'q'")
        first = watch.stdout.readline()
        assert first.endswith(" q: no record\n"), first
        os.killpg(watch.pid, signal.SIGINT)
        out, err = watch.communicate(timeout=TIMEOUT)
    finally:
        if watch.poll() is None:
            os.killpg(watch.pid, signal.SIGKILL)
            watch.communicate()
    assert watch.returncode == 0, out + err
    assert "Traceback" not in err, err


def test_set_interval_refuses_a_queue_with_a_ticket_not_started(cli: Cli, state_url: str) -> None:
    # the ticket's slot is 5 s after the start: its holder may still be waiting for it for 10 s
    ratequeue.Limiter(state_url, name="q", interval=5).acquire()
    with open_state(state_url) as state:
        state.execute(operation("take", "q", Terms.checked(5_000_000)))
    before = _record(state_url, "q")
    result = cli("set-interval", state_url, "q", "0.1")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "1 ticket number(s) handed out and not started" in result.stderr
    assert "Traceback" not in result.stderr
    assert _record(state_url, "q") == before  # nothing changed, not even paused


def test_set_interval_refuses_a_queue_with_a_running_job(cli: Cli, state_url: str) -> None:
    limiter = ratequeue.Limiter(state_url, name="q", interval=0.05, max_running=2, lease=30)
    turn = limiter.acquire()
    try:
        before = _record(state_url, "q")
        result = cli("set-interval", state_url, "q", "0.1")
        assert result.returncode == 2, result.stdout + result.stderr
        assert "1 running job(s) (live leases)" in result.stderr
        assert _record(state_url, "q") == before
    finally:
        limiter.release(turn)
        limiter.close()


def test_set_interval_keeps_the_other_terms(cli: Cli, state_url: str) -> None:
    limiter = ratequeue.Limiter(state_url, name="q", interval=0.01, burst=2, max_running=3, lease=30)
    limiter.release(limiter.acquire())
    limiter.close()
    assert cli("pause", state_url, "q").returncode == 0
    result = cli("set-interval", state_url, "q", "0.02")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-2] == (
        f"set the interval of queue 'q' in {state_url} to 0.02 s (was 0.01 s); "
        f"kept: burst 2, max_running 3, paused everywhere"
    ), result.stdout
    assert "ConfigurationError" in result.stdout.splitlines()[-1]
    record = _record(state_url, "q")
    assert record is not None
    assert (record.interval, record.burst, record.max_running, record.paused) == (20_000, 2, 3, True)

    assert cli("resume", state_url, "q").returncode == 0
    again = cli("set-interval", state_url, "q", "0.03", "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout.splitlines()[-1]) == {
        "state": state_url,
        "name": "q",
        "changed": True,
        "old_interval": 0.02,
        "interval": 0.03,
        "burst": 2,
        "max_running": 3,
        "paused": False,
        "waited": pytest.approx(0, abs=1),
    }
    record = _record(state_url, "q")
    assert record is not None
    assert (record.interval, record.burst, record.paused) == (30_000, 2, False)
    # a shard with the new interval uses it; one with the old is told
    limiter = ratequeue.Limiter(state_url, name="q", interval=0.03, burst=2, max_running=3)
    limiter.release(limiter.acquire())
    limiter.close()
    old = ratequeue.Limiter(state_url, name="q", interval=0.02, burst=2, max_running=3)
    with pytest.raises(
        ratequeue.ConfigurationError, match=r"has interval 0\.03 s in this state, not 0\.02 s"
    ):
        old.acquire()
    old.close()


def test_set_interval_of_the_same_interval_or_a_missing_queue(cli: Cli, state_url: str) -> None:
    ratequeue.Limiter(state_url, name="q", interval=0.05).acquire()
    before = _record(state_url, "q")
    same = cli("set-interval", state_url, "q", "0.05")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "nothing changed" in same.stdout
    assert _record(state_url, "q") == before
    missing = cli("set-interval", state_url, "nothing", "0.05")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "has no record" in missing.stderr
    assert _record(state_url, "nothing") is None


@pytest.mark.parametrize(("old", "new"), [(0.3, 0.1), (0.1, 0.3)], ids=["shorter", "longer"])
def test_set_interval_waits_until_the_last_start_is_an_interval_ago(
    cli: Cli, state_url: str, old: float, new: float
) -> None:
    """The first start at the new interval comes at least max(old, new) after the last at the old one."""
    last = _one_start(state_url, old)
    result = cli("set-interval", state_url, "q", str(new))
    assert result.returncode == 0, result.stdout + result.stderr
    first = _one_start(state_url, new)
    assert first - last >= max(old, new) * 1_000_000


def _one_start(url: str, interval: float) -> int:
    """Acquire once on queue ``q`` with ``interval``; the start (state clock, us)."""
    limiter = ratequeue.Limiter(url, name="q", interval=interval)
    try:
        return limiter.acquire().start_us
    finally:
        limiter.close()


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def test_set_interval_json_says_on_stderr_what_it_waits_for(cli: Cli, state_url: str) -> None:
    _one_start(state_url, 2.5)  # longer than this command takes to start, even on a busy host: it waits
    result = cli("set-interval", state_url, "q", "0.1", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    (done,) = _json_lines(result.stdout)
    assert done["changed"] is True
    assert done["waited"] > 0
    assert re.fullmatch(
        r"waiting \d+\.\d{3} s until queue 'q' is whole again under the longer interval \(2\.5 s\) "
        r"on the state clock, its last start included\n",
        result.stderr,
    )


def test_list_shows_the_readable_queues_and_names_a_bad_record(
    cli: Cli, tmp_path: Path, state_url: str
) -> None:
    good, bad = stored_fields(4, 3, 1_000_000, 20_000), stored_fields(13, "x", None, 20_000)
    write_state(tmp_path / "state.json", HEADER, {"bad": bad, "good": good})
    result = cli("list", state_url)
    assert result.returncode == 2, result.stdout + result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["NAME", "good"]
    assert f"ratequeue: error: record at {tmp_path / 'state.json'}#bad" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_set_interval_with_a_burst_waits_until_the_burst_is_whole_again(cli: Cli, state_url: str) -> None:
    """Any four consecutive starts of a queue with burst 2 span two intervals, across the change too."""
    old = ratequeue.Limiter(state_url, name="q", interval=0.2, burst=2)
    before = [old.acquire().start_us for _ in range(2)]  # at once: the burst
    old.close()
    result = cli("set-interval", state_url, "q", "0.1")
    assert result.returncode == 0, result.stdout + result.stderr
    new = ratequeue.Limiter(state_url, name="q", interval=0.1, burst=2)
    after = [new.acquire().start_us for _ in range(2)]  # at once: the new record's whole burst
    new.close()
    starts = before + after
    assert starts == sorted(starts)
    assert starts[3] - starts[0] >= 2 * 200_000
    assert starts[2] - starts[1] >= 200_000


def test_the_command_a_mismatch_names_works_as_pasted(cli: Cli, state_url: str) -> None:
    """Changing ``interval`` in code fails with a command; run as printed, it changes the stored interval."""
    ratequeue.Limiter(state_url, name="api", interval=0.01).acquire()
    # max_late=None: a late wake-up under load would give ticket 1 up and shift the numbers
    changed = ratequeue.Limiter(state_url, name="api", interval=0.02, max_late=None)
    with pytest.raises(ratequeue.errors.TermsMismatch) as raised:
        changed.acquire()
    command = shlex.split(raised.value.way_out.rpartition("run: ")[2])
    assert command[:2] == ["ratequeue", "set-interval"]
    result = cli(*command[1:])
    assert result.returncode == 0, result.stdout + result.stderr
    assert changed.acquire().ticket == 1, "the changed code now runs, on a fresh record"
    changed.close()
    record = _record(state_url, "api")
    assert record is not None
    assert record.interval == 20_000


def test_tickets_of_gone_holders_and_the_units_of_a_cost_do_not_count_as_waiting() -> None:
    """A start of cost 3 holds 3 ticket numbers, none waiting; unstarted ones wait until take passes them."""
    second = 1_000_000
    # acquire(cost=3) at 10 s on a queue of burst 3, interval 1 s: ticket 4 is next, pos 1
    record = Record(ticket=4, pos=1, at=10 * second, interval=second, burst=3, due=10 * second)
    assert _waiting_tickets(record, 10 * second) == 2, "their slots (11 s, 12 s) may still have holders"
    assert _waiting_tickets(record, 13 * second - 1) == 2
    assert _waiting_tickets(record, 13 * second) == 0, "take passes them now: nobody waits for them"
    assert _waiting_tickets(record._replace(ticket=2), 10 * second) == 0


def test_a_record_is_whole_again_after_its_burst_units_under_the_longer_interval() -> None:
    second = 1_000_000
    one = Record(ticket=2, pos=1, at=10 * second, interval=second, due=10 * second)
    assert _whole_again(one, second) == 11 * second
    assert _whole_again(one, 3 * second) == 13 * second
    # two starts at once on burst 2 (the second a microsecond later): two units in use
    two = Record(ticket=3, pos=2, at=10 * second + 1, interval=second, burst=2, due=11 * second)
    assert _whole_again(two, second) == 12 * second + 1
    assert _whole_again(two, 3 * second) == 16 * second + 1
    assert _whole_again(Record(ticket=1, pos=0, at=NEVER, interval=second, due=NEVER), second) == NEVER


def _set_interval_waiting(cli: Cli, state_url: str) -> subprocess.Popen[str]:
    """``set-interval q 0.1`` on a queue whose last start at 2 s makes it wait; returned once it says so."""
    _one_start(state_url, 2)
    command = cli.popen("set-interval", state_url, "q", "0.1")
    assert command.stdout is not None
    line = command.stdout.readline()
    assert line.startswith("waiting "), line
    record = _record(state_url, "q")
    assert record is not None
    assert record.paused, "paused while it waits"
    return command


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_set_interval_ended_by_a_signal_lifts_its_pause(cli: Cli, state_url: str, signum: int) -> None:
    command = _set_interval_waiting(cli, state_url)
    try:
        os.killpg(command.pid, signum)
        out, err = command.communicate(timeout=TIMEOUT)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.communicate()
    assert command.returncode == (130 if signum == signal.SIGINT else 128 + signum), out + err
    assert "Traceback" not in err, err
    record = _record(state_url, "q")
    assert record is not None
    assert (record.interval, record.paused) == (2_000_000, False), "as it was: nothing changed, not paused"


def test_set_interval_changes_nothing_when_the_queue_is_resumed_while_it_waits(
    cli: Cli, state_url: str
) -> None:
    command = _set_interval_waiting(cli, state_url)
    try:
        assert cli("resume", state_url, "q").returncode == 0
        out, err = command.communicate(timeout=TIMEOUT)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.communicate()
    assert command.returncode == 2, out + err
    assert "changed while set-interval waited" in err, err
    record = _record(state_url, "q")
    assert record is not None
    assert (record.interval, record.paused) == (2_000_000, False)


def test_set_interval_killed_with_sigkill_leaves_no_pause(cli: Cli, state_url: str) -> None:
    """SIGKILL gives the command no way out: its guard, in a session of its own, lifts the pause."""
    command = _set_interval_waiting(cli, state_url)
    os.killpg(command.pid, signal.SIGKILL)
    command.communicate(timeout=TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    record = _record(state_url, "q")
    while record is not None and record.paused and time.monotonic() < deadline:
        time.sleep(0.05)  # the guard, another process, reads the record once its stdin ends
        record = _record(state_url, "q")
    assert record is not None
    assert (record.interval, record.paused) == (2_000_000, False), "as it was: nothing changed, not paused"


def test_set_interval_done_ends_its_guard(cli: Cli, state_url: str) -> None:
    _one_start(state_url, 0.2)
    result = cli("set-interval", state_url, "q", "0.1")
    assert result.returncode == 0, result.stdout + result.stderr
    guard = "ratequeue.cli.guard import main"
    guards = subprocess.run(["pgrep", "-f", guard], capture_output=True, text=True)
    assert guards.stdout == "", "the guard ended with the command"
