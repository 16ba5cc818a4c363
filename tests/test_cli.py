"""The command line, run as users run it: ``python -m ratequeue`` in a subprocess.

Every run gets ``RATEQUEUE_STATE_FILE`` pointing into ``tmp_path`` (and a
``HOME`` and ``XDG_CACHE_HOME`` of its own), so nothing touches the real
per-user state file. The demo's tests are here; ``list``, ``status --json``
and ``--watch`` and ``set-interval`` are in ``test_cli_admin.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ratequeue
from ratequeue.state import open_state
from ratequeue.state.file import FileState

from . import servers
from .ops import stored_fields

#: the directory holding the ``ratequeue`` package this test run imports; the
#: subprocesses import the same one, whatever is installed
SOURCE_ROOT = Path(ratequeue.__file__).resolve().parents[1]

#: seconds a CLI run may take before the test fails (a demo of 15 starts needs ~2 s)
TIMEOUT = 60


class Cli:
    """Runs ``python -m ratequeue`` with a private default state file."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.default_state = tmp_path / "default" / "state.json"
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.env = {
            **os.environ,
            "RATEQUEUE_STATE_FILE": str(self.default_state),
            "HOME": str(self.home),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")])),
        }

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ratequeue", *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=self.env,
            cwd=self.tmp_path,
            check=False,
        )

    def popen(self, *args: str, **options: Any) -> subprocess.Popen[str]:
        """Start ``python -m ratequeue ARGS`` in a process group of its own (as a shell's job is)."""
        return subprocess.Popen(
            [sys.executable, "-m", "ratequeue", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=self.tmp_path,
            start_new_session=True,
            **options,
        )


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path)


@pytest.fixture
def state_url(tmp_path: Path) -> str:
    return (tmp_path / "state.json").as_uri()


def _summary(out: str, begins: str = "summary:") -> str:
    """The one line of the demo's summary that begins with ``begins`` (stripped)."""
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith(begins)]
    assert len(lines) == 1, out
    return lines[0]


def _state_gaps(out: str) -> str:
    return _summary(out, "state-clock gaps:")


def _wait_until_gone(pgid: int) -> None:
    """Wait until no process of group ``pgid`` is left, zombies included; fail after TIMEOUT seconds.

    The demo's workers and the multiprocessing resource tracker it starts
    are all in the group of the demo's own process.
    """
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            ps = ["ps", "-o", "pid,stat,args", "-g", str(pgid)]
            left = subprocess.run(ps, capture_output=True, text=True, check=False)
            os.killpg(pgid, signal.SIGKILL)
            pytest.fail(f"processes of group {pgid} still there after {TIMEOUT} s:\n{left.stdout}")
        time.sleep(0.05)  # a poll's pace: the loop ends on the condition, or on the deadline


def _stop_group(process: subprocess.Popen[str]) -> None:
    """After a test: kill what is left of ``process``'s group, if the test failed before it ended."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _demo(cli: Cli, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return cli("demo", "--processes", "3", "--jobs", "5", "--interval", "0.02", "--url", url, *extra)


@pytest.mark.processes
def test_demo_runs_every_start_with_no_gap_under_the_interval(cli: Cli, state_url: str) -> None:
    result = _demo(cli, state_url, "--name", "cli-demo")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = _summary(result.stdout)
    assert summary.startswith("summary: 15/15 starts"), summary
    assert "under the interval: 0" in _state_gaps(result.stdout)
    assert _summary(result.stdout, "result:") == "result: ok"
    # one live line per start, from each of the three processes
    progress = re.findall(r"^\[\s*\d+/15\] process (\d)  ticket", result.stdout, re.MULTILINE)
    assert sorted(progress) == sorted(["1", "2", "3"] * 5), result.stdout
    assert state_url in result.stdout
    assert not cli.default_state.exists()


@pytest.mark.processes
def test_demo_quiet_prints_only_the_header_and_summary(cli: Cli, state_url: str) -> None:
    result = _demo(cli, state_url, "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "15/15 starts" in _summary(result.stdout)
    assert not re.search(r"^\[", result.stdout, re.MULTILINE), result.stdout


@pytest.mark.processes
def test_demo_with_the_default_state_uses_the_private_file(cli: Cli) -> None:
    result = cli("demo", "--processes", "2", "--jobs", "2", "--interval", "0.02", "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "under the interval: 0" in _state_gaps(result.stdout)
    assert cli.default_state.is_file()
    assert cli.default_state.as_uri() in result.stdout
    assert list(cli.home.iterdir()) == []  # nothing written under HOME


def test_demo_refuses_the_memory_state(cli: Cli) -> None:
    result = cli("demo", "--processes", "2", "--jobs", "2", "--url", "memory://")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "memory://" in result.stderr
    assert "share" in result.stderr  # says why: the processes need a state they share
    assert result.stderr.startswith("ratequeue: error:")
    assert "Traceback" not in result.stderr
    assert "summary:" not in result.stdout


@pytest.mark.parametrize("interval", ["0", "nan", "-0.5", "inf", "-inf"])
def test_demo_refuses_a_bad_interval_before_touching_the_state(
    cli: Cli, tmp_path: Path, state_url: str, interval: str
) -> None:
    # --interval=VALUE: argparse would take a bare "-inf" for an option
    result = cli("demo", f"--interval={interval}", "--url", state_url)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "interval" in result.stderr
    assert interval in result.stderr  # names the value given
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "state.json").exists()


def test_demo_refuses_a_non_number_interval(cli: Cli, state_url: str) -> None:
    result = cli("demo", "--interval", "fast", "--url", state_url)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--interval" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.processes
def test_status_before_and_after_a_demo(cli: Cli, state_url: str) -> None:
    before = cli("status", state_url, "q")
    assert before.returncode == 0, before.stdout + before.stderr
    assert re.search(r"^record:\s+none", before.stdout, re.MULTILINE), before.stdout

    demo = _demo(cli, state_url, "--name", "q", "--quiet")
    assert demo.returncode == 0, demo.stdout + demo.stderr

    after = cli("status", state_url, "q")
    assert after.returncode == 0, after.stdout + after.stderr
    assert re.search(r"^interval:\s+0\.02 s$", after.stdout, re.MULTILINE), after.stdout
    tickets = re.search(
        r"^tickets:\s+(\d+) handed out, (\d+) is the latest started$", after.stdout, re.MULTILINE
    )
    assert tickets, after.stdout
    handed_out, latest = int(tickets[1]), int(tickets[2])
    # 15 starts; a ticket passed by a late wake-up is replaced by a new one
    assert handed_out >= 15
    # every demo process finished, so the last ticket handed out is the last started
    assert latest == handed_out
    assert re.search(r"^\w+:\s+0 ticket\(s\) handed out and not started$", after.stdout, re.MULTILINE), (
        after.stdout
    )
    assert re.search(r"^last start: \d+\.\d{3} s ago", after.stdout, re.MULTILINE), after.stdout


def test_status_of_the_default_state(cli: Cli) -> None:
    result = cli("status", "default", "q")
    assert result.returncode == 0, result.stdout + result.stderr
    assert cli.default_state.as_uri() in result.stdout
    assert list(cli.home.iterdir()) == []


@pytest.mark.processes
def test_reset_removes_the_record(cli: Cli, state_url: str) -> None:
    demo = _demo(cli, state_url, "--name", "q", "--quiet")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "handed out" in cli("status", state_url, "q").stdout

    reset = cli("reset", state_url, "q")
    assert reset.returncode == 0, reset.stdout + reset.stderr
    assert reset.stdout.startswith("reset queue 'q'"), reset.stdout

    status = cli("status", state_url, "q")
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(r"^record:\s+none", status.stdout, re.MULTILINE), status.stdout

    again = cli("reset", state_url, "q")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.startswith("no record for queue 'q'"), again.stdout


#: the header of a file state at ``tmp_path / "state.json"`` (its records are in ``state.json.d``)
HEADER = b'{"format": "ratequeue-state", "records": "state.json.d", "version": 2}\n'


def write_state(path: Path, header: bytes, records: dict[str, Any]) -> None:
    """Write a file state at ``path`` by hand: its ``header``'s bytes, and a file per record's fields."""
    path.write_bytes(header)
    state = FileState(path)
    if records:
        state.records.mkdir(mode=0o700)
    for name, fields in records.items():
        state.record_files(name)[0].write_text(json.dumps({"name": name, "record": fields}))


def state_files(path: Path) -> dict[str, bytes]:
    """The bytes of the file state at ``path``: its header's and its record files'."""
    return {file.name: file.read_bytes() for file in [path, *path.with_name(f"{path.name}.d").glob("*.json")]}


def test_reset_leaves_other_queues_alone(cli: Cli, tmp_path: Path, state_url: str) -> None:
    write_state(
        tmp_path / "state.json",
        HEADER,
        {"a": stored_fields(4, 3, 1_000_000, 20_000), "b": stored_fields(8, 7, 2_000_000, 50_000)},
    )
    assert cli("reset", state_url, "a").returncode == 0
    assert re.search(r"^record:\s+none", cli("status", state_url, "a").stdout, re.MULTILINE)
    kept = cli("status", state_url, "b")
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert re.search(r"^tickets:\s+7 handed out, 7 is the latest started$", kept.stdout, re.MULTILINE)
    assert re.search(r"^interval:\s+0\.05 s$", kept.stdout, re.MULTILINE)


#: file states the commands refuse: the bytes of the header, and the stored record of queue q (or none)
CORRUPTIONS: dict[str, tuple[bytes, Any]] = {
    "empty": (b"", None),
    "not-json": (b'{"format": "ratequeue-state", "version": 2, ', None),
    "binary": (bytes(range(256)), None),
    "not-a-state": (b'{"hello": "world"}\n', None),
    "other-version": (b'{"format": "ratequeue-state", "version": 99}', None),
    "bad-record": (HEADER, stored_fields(1, 5, None, 20_000)),
    "record-not-object": (HEADER, [1, 2]),
}


@pytest.mark.parametrize(("header", "record"), CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_status_of_a_corrupted_state_fails_and_leaves_it_unchanged(
    cli: Cli, tmp_path: Path, state_url: str, header: bytes, record: Any
) -> None:
    path = tmp_path / "state.json"
    write_state(path, header, {} if record is None else {"q": record})
    before = state_files(path)
    result = cli("status", state_url, "q")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("ratequeue: error:"), result.stderr
    assert str(path) in result.stderr  # says which file
    assert "Traceback" not in result.stderr
    assert state_files(path) == before


@pytest.mark.parametrize(
    "content", [CORRUPTIONS["not-json"][0], CORRUPTIONS["not-a-state"][0]], ids=["not-json", "not-a-state"]
)
def test_demo_on_a_corrupted_state_fails_and_leaves_it_unchanged(
    cli: Cli, tmp_path: Path, state_url: str, content: bytes
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    result = _demo(cli, state_url)
    assert result.returncode == 2, result.stdout + result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.stderr
    assert path.read_bytes() == content


def test_unknown_url_scheme_is_a_clear_error(cli: Cli) -> None:
    result = cli("status", "ftp://example.com/x", "q")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "ftp://example.com/x" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["empty", "not-json", "not-a-state", "other-version"])
def test_reset_of_a_corrupted_file_fails_and_leaves_it_unchanged(
    cli: Cli, tmp_path: Path, state_url: str, name: str
) -> None:
    # docs/file-state.md: a bad file is never overwritten, not even by reset; move it aside
    path = tmp_path / "state.json"
    path.write_bytes(CORRUPTIONS[name][0])
    result = cli("reset", state_url, "q")
    assert result.returncode == 2, result.stdout + result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.stderr
    assert path.read_bytes() == CORRUPTIONS[name][0]


def test_reset_recovers_one_bad_record_and_keeps_the_others(cli: Cli, tmp_path: Path, state_url: str) -> None:
    path = tmp_path / "state.json"
    write_state(
        path,
        HEADER,
        {"bad": stored_fields(13, "x", None, 20_000), "good": stored_fields(4, 3, 1_000_000, 20_000)},
    )
    bad = cli("status", state_url, "bad")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert f"{path}#bad" in bad.stderr  # names the file and the record
    assert cli("status", state_url, "good").returncode == 0  # the other queue keeps working

    reset = cli("reset", state_url, "bad")
    assert reset.returncode == 0, reset.stdout + reset.stderr
    fixed = cli("status", state_url, "bad")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert re.search(r"^record:\s+none", fixed.stdout, re.MULTILINE), fixed.stdout
    good = cli("status", state_url, "good")
    assert re.search(r"^tickets:\s+3 handed out, 3 is the latest started$", good.stdout, re.MULTILINE)


SECRET = "s3cretPW"

#: state URLs holding SECRET that the command refuses, and what its message still says
REFUSED_WITH_A_SECRET = {
    "redis-port-not-a-number": (f"redis://:{SECRET}@host:notaport/0", "notaport"),
    "redis-unclosed-bracket": (f"redis://:{SECRET}@[::1", "IPv6"),
    "unknown-scheme": (f"ftp://u:{SECRET}@host/x", "unknown state URL scheme"),
    "memory-query-password": (f"memory://?password={SECRET}", "memory URL"),
    "mongodb-bad-port": (f"mongodb://u:{SECRET}@host:notaport", "MongoDB URL"),
    "mongodb-bad-database": (f"mongodb://u:{SECRET}@host/?database=a/b", "database='a/b'"),
}


@pytest.mark.parametrize(("url", "said"), REFUSED_WITH_A_SECRET.values(), ids=REFUSED_WITH_A_SECRET.keys())
@pytest.mark.parametrize("command", ["status", "reset", "demo"])
def test_a_refused_url_is_named_without_its_password(cli: Cli, command: str, url: str, said: str) -> None:
    args = ["demo", "--url", url] if command == "demo" else [command, url, "q"]
    result = cli(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("ratequeue: error:"), result.stderr
    assert said in result.stderr
    assert "Traceback" not in result.stderr
    assert SECRET not in result.stdout + result.stderr


@pytest.fixture
def redis_user(redis_server: servers.Server) -> Iterator[str]:
    """A Redis user with the password SECRET on the test server; its name."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.acl_setuser("rq-cli", enabled=True, passwords=[f"+{SECRET}"], keys=["*"], commands=["+@all"])
    yield "rq-cli"
    client.acl_deluser("rq-cli")
    client.close()


@pytest.mark.parametrize("where", ["query", "userinfo"])
def test_status_and_reset_show_a_password_url_redacted(
    cli: Cli, redis_server: servers.Server, redis_user: str, where: str
) -> None:
    host = f"127.0.0.1:{redis_server.port}"
    url = (
        f"redis://{host}/0?username={redis_user}&password={SECRET}&prefix=cli-test:"
        if where == "query"
        else f"redis://{redis_user}:{SECRET}@{host}/0?prefix=cli-test:"
    )
    ratequeue.Limiter(url, name="q", interval=0.05).acquire()
    for args in (
        ["status", url, "q"],
        ["status", url, "q", "--json"],
        ["status", url, "q", "--watch", "--count", "1"],
        ["status", url, "q", "--watch", "--count", "1", "--json"],
        ["list", url],
        ["list", url, "--json"],
        ["keys", url, "--json"],
        ["set-interval", url, "q", "0.05"],
        ["reset", url, "q"],
    ):
        result = cli(*args)
        assert result.returncode == 0, result.stdout + result.stderr
        assert host in result.stdout + result.stderr, result.stdout
        assert "***" in result.stdout + result.stderr, result.stdout
        assert SECRET not in result.stdout + result.stderr
    refused = cli("set-interval", url, "q", "0.1")  # no record any more: the error names the state
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "***" in refused.stderr
    assert SECRET not in refused.stdout + refused.stderr


@pytest.mark.processes
def test_demo_shows_a_password_url_redacted(cli: Cli, redis_server: servers.Server, redis_user: str) -> None:
    url = f"redis://127.0.0.1:{redis_server.port}/0?username={redis_user}&password={SECRET}&prefix=cli-demo:"
    result = _demo(cli, url, "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "password=***" in result.stdout
    assert SECRET not in result.stdout + result.stderr


def test_keys_lists_a_groups_live_keys_and_status_shows_the_burst(cli: Cli, state_url: str) -> None:
    import ratequeue

    group = ratequeue.LimiterGroup(state_url, name="tenants", rate="100/s", burst=3)
    for key in ("acme", "globex"):
        group[key].acquire()
    ratequeue.Limiter(state_url, name="other", interval=0.1).acquire()
    group.close()
    listed = cli("keys", state_url, "tenants:")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert listed.stdout.splitlines() == ["tenants:acme", "tenants:globex"]
    assert "2 queue(s)" in listed.stderr
    everything = cli("keys", state_url)
    assert everything.stdout.splitlines() == ["other", "tenants:acme", "tenants:globex"]
    status = cli("status", state_url, "tenants:acme")
    assert re.search(r"^burst:\s+3$", status.stdout, re.MULTILINE), status.stdout


def test_pause_and_resume_a_queue_everywhere(cli: Cli, state_url: str) -> None:
    """``pause`` creates a missing record with --interval and --burst; ``status`` shows the flag."""
    missing = cli("pause", state_url, "q")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "--interval" in missing.stderr
    assert "Traceback" not in missing.stderr
    assert re.search(r"^record:\s+none", cli("status", state_url, "q").stdout, re.MULTILINE)

    paused = cli("pause", state_url, "q", "--interval", "0.05", "--burst", "2")
    assert paused.returncode == 0, paused.stdout + paused.stderr
    assert paused.stdout.startswith(f"paused queue 'q' everywhere in {state_url}"), paused.stdout
    assert re.search(r"^state clock: \d+ us$", paused.stdout, re.MULTILINE), paused.stdout
    status = cli("status", state_url, "q").stdout
    assert re.search(r"^interval:\s+0\.05 s$", status, re.MULTILINE), status
    assert re.search(r"^burst:\s+2$", status, re.MULTILINE), status
    paused = r"^paused everywhere: yes, for [\d.]+ s \(until resumed\)$"  # and since when
    assert re.search(paused, status, re.MULTILINE), status

    limiter = ratequeue.Limiter(state_url, name="q", interval=0.05, burst=2)
    assert limiter.try_acquire() is None, "paused everywhere: no turn"
    assert limiter.status().paused_everywhere
    assert not limiter.paused

    again = cli("pause", state_url, "q")  # the stored terms: no --interval needed
    assert again.returncode == 0, again.stdout + again.stderr
    assert "was paused already" in again.stdout

    resumed = cli("resume", state_url, "q")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stdout.startswith(f"resumed queue 'q' everywhere in {state_url}"), resumed.stdout
    assert re.search(r"^paused everywhere: no$", cli("status", state_url, "q").stdout, re.MULTILINE)
    assert "was not paused" in cli("resume", state_url, "q").stdout
    # this shard was told to wait a second on (a paused queue's recheck): its turn comes by then
    assert limiter.acquire(timeout=3).start_us <= limiter.status().now * 1e6
    assert not limiter.status().paused_everywhere
    limiter.close()


def test_pause_and_status_of_a_queue_with_a_cap_on_running_jobs(cli: Cli, state_url: str) -> None:
    """``pause`` and ``resume`` keep a stored max_running; ``status`` shows the jobs running."""
    limiter = ratequeue.Limiter(state_url, name="capped", interval=0.01, max_running=3, lease=30)
    turn = limiter.acquire()
    status = cli("status", state_url, "capped").stdout
    assert re.search(r"^running:\s+1 of at most 3 \(live leases\)$", status, re.MULTILINE), status
    paused = cli("pause", state_url, "capped")
    assert paused.returncode == 0, paused.stdout + paused.stderr
    assert limiter.try_acquire() is None, "paused everywhere: no turn"
    resumed = cli("resume", state_url, "capped")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    limiter.release(turn)
    status = cli("status", state_url, "capped").stdout
    assert re.search(r"^running:\s+0 of at most 3", status, re.MULTILINE), status
    limiter.close()


def test_pause_refuses_terms_other_than_the_stored_ones(cli: Cli, state_url: str) -> None:
    ratequeue.Limiter(state_url, name="q", interval=0.1).acquire()
    wrong = cli("pause", state_url, "q", "--interval", "0.2")
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    assert "interval 0.1 s" in wrong.stderr, wrong.stderr
    assert re.search(r"^paused everywhere: no$", cli("status", state_url, "q").stdout, re.MULTILINE)
    right = cli("pause", state_url, "q", "--interval", "0.1")
    assert right.returncode == 0, right.stdout + right.stderr


def test_resume_of_a_queue_without_a_record_creates_none(cli: Cli, state_url: str) -> None:
    result = cli("resume", state_url, "q")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no record for queue 'q'" in result.stdout
    assert "not paused" in result.stdout
    assert re.search(r"^record:\s+none", cli("status", state_url, "q").stdout, re.MULTILINE)


#: a live line of the demo: place, process, ticket, state-clock gap and begin gap (ms, or "-")
LIVE_LINE = re.compile(
    r"^\[\s*(\d+)/(\d+)\] process (\d+)  ticket\s+(\d+)  state-clock gap\s+([\d.]+|-) ms"
    r"  begin gap\s+([\d.]+|-) ms",
    re.MULTILINE,
)


def _quick_demo(cli: Cli, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return cli("demo", "--processes", "2", "--jobs", "3", "--interval", "0.02", "--url", url, *extra)


@pytest.mark.processes
def test_demo_shows_state_clock_gaps_and_begin_gaps(cli: Cli, state_url: str) -> None:
    result = _quick_demo(cli, state_url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("2 processes x 3 starts, one start every 20 ms"), result.stdout
    lines = LIVE_LINE.findall(result.stdout)
    assert len(lines) == 6, result.stdout
    # the first start has no gap before it; every later one has both, the state's one never under 20 ms
    assert [line[4] == "-" and line[5] == "-" for line in lines] == [True] + [False] * 5, result.stdout
    assert all(float(line[4]) >= 20.0 for line in lines[1:]), result.stdout
    assert all(float(line[5]) > 0 for line in lines[1:]), result.stdout
    state = re.fullmatch(
        r"state-clock gaps: smallest ([\d.]+) ms, median ([\d.]+) ms, under the interval: 0",
        _state_gaps(result.stdout),
    )
    assert state, result.stdout
    assert float(state[1]) >= 20.0
    begins = re.match(
        r"begin gaps:\s+smallest ([\d.]+) ms, median ([\d.]+) ms; \d+ a little under the interval "
        r"\(a process woke a few µs late: normal\), (none|\d+) under 19\.700 ms \(interval - max_late",
        _summary(result.stdout, "begin gaps:"),
    )
    assert begins, result.stdout
    assert 0 < float(begins[1]) <= float(begins[2])
    # a line is flagged as its begin gap was when it was shown, against interval - max_late (G7), to
    # the microsecond (19.6996 shows as 19.700)
    flagged = [line for line in result.stdout.splitlines() if "(BEGIN GAP UNDER INTERVAL - MAX_LATE)" in line]
    for line in result.stdout.splitlines()[2:7]:
        shown = float(line.split("begin gap")[1].split()[0])
        assert shown <= 19.7 if line in flagged else shown >= 19.7, line
    # the summary counts the gaps as they are in the end
    past = 0 if begins[3] == "none" else int(begins[3])
    if "(reported after a later start)" not in result.stdout:
        # every start and begin came in order: the gaps shown are the gaps summarised
        assert past == len(flagged), result.stdout
    else:
        # a begin reported late splits a gap already shown: the summary can only count more
        assert past >= len(flagged), result.stdout
    assert _summary(result.stdout, "result:") == "result: ok"


@pytest.mark.processes
def test_demo_says_one_process_and_one_start_in_the_singular(cli: Cli, state_url: str) -> None:
    result = cli("demo", "--processes", "1", "--jobs", "1", "--interval", "0.02", "--url", state_url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("1 process x 1 start, one start every 20 ms"), result.stdout


@pytest.mark.processes
def test_demo_without_a_name_uses_a_fresh_queue_and_leaves_no_record(cli: Cli, state_url: str) -> None:
    ratequeue.Limiter(state_url, name="real", interval=0.5).acquire()
    result = _quick_demo(cli, state_url, "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    header = re.search(r"\(queue '(ratequeue-demo-[0-9a-f]+)', deleted at the end\)", result.stdout)
    assert header, result.stdout
    with open_state(state_url) as state:
        assert state.names() == ["real"]  # the demo's record is gone; the other queue is untouched
        record = state.read("real").record
    assert record is not None
    assert record.interval == 500_000


@pytest.mark.processes
def test_demo_refuses_a_queue_that_has_a_record_unless_reset(cli: Cli, state_url: str) -> None:
    ratequeue.Limiter(state_url, name="prod", interval=0.5).acquire()
    with open_state(state_url) as state:
        before = state.read("prod").record
    refused = _quick_demo(cli, state_url, "--name", "prod")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.startswith("ratequeue: error: queue 'prod' already has a record"), refused.stderr
    assert "--reset" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert refused.stdout == ""  # refused before anything is printed
    with open_state(state_url) as state:
        assert state.read("prod").record == before  # untouched: interval 0.5 s, its ticket and start

    reset = _quick_demo(cli, state_url, "--name", "prod", "--reset", "--quiet")
    assert reset.returncode == 0, reset.stdout + reset.stderr
    assert "(queue 'prod', kept at the end)" in reset.stdout
    with open_state(state_url) as state:
        after = state.read("prod").record
    assert after is not None
    assert after.interval == 20_000  # reset on purpose, and kept for status to show


def test_demo_help_states_the_safety_rule_the_gaps_and_the_exit_status(cli: Cli) -> None:
    result = cli("demo", "--help")
    assert result.returncode == 0, result.stdout + result.stderr
    text = " ".join(result.stdout.split())
    assert "--reset" in text
    assert "ratequeue-demo-<random hex>" in text
    assert "state-clock gap" in text
    assert "begin gap" in text
    for status in ("0 ", "1 ", "2 ", "130 "):
        assert f"\n  {status}" in result.stdout, result.stdout


def test_demo_refuses_a_tiny_interval_before_printing_anything(cli: Cli, state_url: str) -> None:
    result = cli("demo", "--interval", "1e-9", "--url", state_url)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("ratequeue: error: interval must be at least one microsecond")


def test_an_unknown_option_shows_the_commands_usage(cli: Cli) -> None:
    result = cli("demo", "--bogus")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("usage: ratequeue demo "), result.stderr
    assert "unrecognized arguments: --bogus" in result.stderr
    listed = cli("list", "default", "--bogus")
    assert listed.returncode == 2
    assert listed.stderr.startswith("usage: ratequeue list "), listed.stderr


@pytest.mark.processes
def test_demo_plot_writes_a_png(cli: Cli, tmp_path: Path, state_url: str) -> None:
    plot = tmp_path / "demo.png"
    result = _quick_demo(cli, state_url, "--quiet", "--plot", str(plot))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"plot: {plot}" in result.stdout
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_demo_plot_without_matplotlib_says_what_to_install(cli: Cli, tmp_path: Path, state_url: str) -> None:
    # python -S: no site-packages, so no matplotlib (ratequeue itself needs only the standard library)
    result = subprocess.run(
        [sys.executable, "-S", "-m", "ratequeue", "demo", "--url", state_url, "--plot", "demo.png"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=cli.env,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pip install 'ratequeue[plot]'" in result.stderr
    assert result.stdout == ""  # refused before the demo runs
    assert not (tmp_path / "state.json").exists()


def test_demo_plot_refuses_a_file_it_cannot_write(cli: Cli, tmp_path: Path, state_url: str) -> None:
    for plot, said in (
        (tmp_path / "demo.txt", ".png"),
        (tmp_path / "nowhere" / "demo.png", "does not exist"),
    ):
        result = _quick_demo(cli, state_url, "--plot", str(plot))
        assert result.returncode == 2, result.stdout + result.stderr
        assert said in result.stderr
        assert result.stdout == ""


@pytest.mark.processes
@pytest.mark.skipif(
    sys.platform == "win32", reason="a process group and SIGINT, as a POSIX terminal sends them"
)
def test_ctrl_c_stops_the_demo_without_a_traceback(cli: Cli, state_url: str) -> None:
    """A real SIGINT to the demo's process group, as a terminal's Ctrl-C sends it, once a start is shown."""
    demo = cli.popen("demo", "--processes", "2", "--jobs", "1000", "--interval", "0.02", "--url", state_url)
    try:
        assert demo.stdout is not None
        header = demo.stdout.readline()
        assert header.startswith("2 processes x 1000 starts"), header
        first = demo.stdout.readline()
        assert LIVE_LINE.match(first), first
        # the line came through a pipe while the demo runs (its 40 s are far from over): flushed live
        assert demo.poll() is None
        os.killpg(demo.pid, signal.SIGINT)
        out, err = demo.communicate(timeout=TIMEOUT)
        _wait_until_gone(demo.pid)  # no worker (nor the resource tracker) survives
    finally:
        _stop_group(demo)
    assert demo.returncode == 130, out + err
    assert "Traceback" not in err, err
    assert err.strip() == "ratequeue: interrupted", err
    assert "summary:" not in out
    with open_state(state_url) as state:
        assert state.names() == []  # the demo's fresh queue was deleted on the way out


@pytest.mark.processes
@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM and SIGHUP to a POSIX process")
@pytest.mark.parametrize("signum", [signal.SIGTERM, getattr(signal, "SIGHUP", 1)], ids=["TERM", "HUP"])
def test_sigterm_or_sighup_to_the_demo_ends_its_workers_and_deletes_its_record(
    cli: Cli, state_url: str, signum: int
) -> None:
    """``kill PID`` (a supervisor, a closed terminal): to the demo's own process only, not its group."""
    demo = cli.popen("demo", "--processes", "3", "--jobs", "200", "--interval", "0.02", "--url", state_url)
    try:
        assert demo.stdout is not None
        header = demo.stdout.readline()
        assert header.startswith("3 processes x 200 starts"), header
        first = demo.stdout.readline()
        assert LIVE_LINE.match(first), first
        os.kill(demo.pid, signum)
        out, err = demo.communicate(timeout=TIMEOUT)
        _wait_until_gone(demo.pid)
    finally:
        _stop_group(demo)
    name = signal.Signals(signum).name
    assert demo.returncode == 128 + signum, out + err
    assert err.strip() == f"ratequeue: ended by {name}", err
    assert "summary:" not in out
    with open_state(state_url) as state:
        assert state.names() == []  # the demo's fresh queue was deleted on the way out


@pytest.mark.processes
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL to a POSIX process")
def test_the_workers_of_a_killed_demo_end_too(cli: Cli, state_url: str) -> None:
    """SIGKILL cannot be handled: the workers notice that the demo's process is gone, and end."""
    # 2 minutes of starts: workers that went on would outlast the test's deadline
    demo = cli.popen("demo", "--processes", "3", "--jobs", "2000", "--interval", "0.02", "--url", state_url)
    try:
        assert demo.stdout is not None
        assert demo.stdout.readline().startswith("3 processes x 2000 starts")
        assert LIVE_LINE.match(demo.stdout.readline())
        os.kill(demo.pid, signal.SIGKILL)
        demo.communicate(timeout=TIMEOUT)  # its output ends once every worker has ended
        _wait_until_gone(demo.pid)
    finally:
        _stop_group(demo)
    assert demo.returncode == -signal.SIGKILL


@pytest.mark.processes
@pytest.mark.skipif(sys.platform == "win32", reason="a process group, as a POSIX shell's job has")
def test_a_demo_whose_output_is_closed_ends_with_141_and_cleans_up(cli: Cli, state_url: str) -> None:
    """``ratequeue demo | head -1``: the reader leaves; the demo ends quietly, its workers and record too."""
    demo = cli.popen("demo", "--processes", "2", "--jobs", "500", "--interval", "0.02", "--url", state_url)
    try:
        assert demo.stdout is not None
        header = demo.stdout.readline()
        assert header.startswith("2 processes x 500 starts"), header
        demo.stdout.close()  # the next live line meets a closed pipe
        _, err = demo.communicate(timeout=TIMEOUT)
        _wait_until_gone(demo.pid)
    finally:
        _stop_group(demo)
    assert demo.returncode == 141, err  # 128 + SIGPIPE, as a shell reports it
    assert err == "", err  # no traceback, no "Exception ignored" at exit
    with open_state(state_url) as state:
        assert state.names() == []


@pytest.mark.skipif(sys.platform == "win32", reason="a process group, as a POSIX shell's job has")
def test_a_watch_whose_output_is_closed_ends_with_141(cli: Cli, state_url: str) -> None:
    """``ratequeue status URL NAME --watch | head -2``."""
    watch = cli.popen("status", state_url, "q", "--watch", "--every", "0.05")
    try:
        assert watch.stdout is not None
        assert watch.stdout.readline().startswith("watching queue 'q'")
        watch.stdout.close()
        _, err = watch.communicate(timeout=TIMEOUT)
    finally:
        _stop_group(watch)
    assert watch.returncode == 141, err
    assert err == "", err


def test_the_watch_does_not_catch_up_in_a_burst_after_a_slow_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """One read takes 10 refreshes' time: the next refresh comes at once, the later ones on the pace again."""
    import argparse
    import io
    import types

    from ratequeue.cli import watch
    from ratequeue.state import Snapshot

    clock = [0.0]
    reads: list[float] = []

    class SlowOnceState:
        url = "file:///nowhere.json"

        def __enter__(self) -> SlowOnceState:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def read(self, name: str) -> Snapshot:
            reads.append(clock[0])
            if len(reads) == 2:
                clock[0] += 10.0  # the second read takes 10 s
            return Snapshot(record=None, now=0)

    def sleep(seconds: float) -> None:
        assert seconds >= 0
        clock[0] += seconds

    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep)
    monkeypatch.setattr(watch, "time", fake_time)
    monkeypatch.setattr(watch, "opened_state", lambda url: SlowOnceState())
    args = argparse.Namespace(url="x", name="q", every=1.0, count=6, json=True)
    assert watch.run(args, io.StringIO()) == 0
    assert reads == [0.0, 1.0, 11.0, 12.0, 13.0, 14.0]


@pytest.mark.parametrize("command", ["list", "keys"])
def test_list_and_keys_name_a_stored_name_that_is_not_a_valid_queue_name_and_list_the_rest(
    cli: Cli, tmp_path: Path, state_url: str, command: str
) -> None:
    """A foreign key under a Redis prefix, say: its control character shown escaped, the others listed."""
    good = stored_fields(4, 3, 1_000_000, 20_000)
    write_state(tmp_path / "state.json", HEADER, {"a\x01b": good, "good": good})
    for args in ([], ["--json"]):
        result = cli(command, state_url, *args)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        assert "good" in result.stdout
        assert "'a\\x01b'" in result.stderr  # repr: the control character shows
        assert "\x01" not in result.stdout + result.stderr
    listed = cli(command, state_url)
    assert [line.split()[0] for line in listed.stdout.splitlines()] == ["NAME", "good"][command == "keys" :]


def test_demo_refuses_more_processes_than_it_can_start_before_printing_anything(
    cli: Cli, tmp_path: Path, state_url: str
) -> None:
    # one quick start each: were the cap missing, the 65 processes would end soon, not outlive the test
    result = cli("demo", "--processes", "65", "--jobs", "1", "--interval", "0.001", "--url", state_url)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("ratequeue: error: --processes must be at most 64"), result.stderr
    assert "65" in result.stderr
    assert not (tmp_path / "state.json").exists()


def test_status_and_list_read_the_default_state_without_a_url(cli: Cli) -> None:
    """A limiter without a URL uses the per-user file: so do ``status NAME`` and ``list`` (issue 31)."""
    # max_late=None: a late wake-up under load would give ticket 1 up and shift the count
    limiter = ratequeue.Limiter(
        FileState(cli.default_state, create_parents=True), name="mine", interval=0.5, max_late=None
    )
    try:
        limiter.acquire()
    finally:
        limiter.close()
    status = cli("status", "mine", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["tickets"] == 1
    assert json.loads(status.stdout)["state"] == cli.default_state.as_uri()
    listed = cli("list")
    assert listed.returncode == 0, listed.stderr
    assert "mine" in listed.stdout
    assert cli("status", "default", "mine").returncode == 0, "the URL may still be given"


def test_the_exit_statuses_in_the_help_are_those_in_the_docs(cli: Cli) -> None:
    """``--help`` and docs/cli.md list the same statuses, for the same commands."""
    from ratequeue.cli import EXIT_STATUS

    helped = set(re.findall(r"^\s+(\d+)\s", EXIT_STATUS, re.MULTILINE)) | set(
        re.findall(r"\((\d+): by", EXIT_STATUS)
    )
    page = (SOURCE_ROOT / "docs" / "cli.md").read_text()
    table = page[page.index("## Exit status") : page.index("## demo")]
    documented = {
        number
        for row in re.findall(r"^\| ([\d, ]+) \|", table, re.MULTILINE)
        for number in re.findall(r"\d+", row)
    }
    assert helped == documented
    assert "demo and set-interval" in EXIT_STATUS, "143 and 129 end set-interval too (docs/cli.md)"


def test_the_demo_summary_says_what_passed_tickets_are() -> None:
    """180/180 starts and ticket 198: the summary says the 18 passed tickets were taken again, none lost."""
    import io

    from ratequeue.cli import demo

    starts = [index * 50_000 for index in range(10)]
    seen = demo.Seen(starts=starts, begins=[start / 1e6 for start in starts], highest_ticket=12)
    out = io.StringIO()
    assert demo._summary(seen, 10, 50_000, out) == 0
    assert "12 handed out for 10 starts: 2 tickets passed" in out.getvalue()
    assert "none was lost" in out.getvalue()
    out = io.StringIO()
    demo._summary(
        demo.Seen(starts=starts, begins=[s / 1e6 for s in starts], highest_ticket=10), 10, 50_000, out
    )
    assert "passed" not in out.getvalue(), "no word on passed tickets when there were none"
