"""Celery tasks that start at the fleet's global turn, and wait out a service's refusal together.

::

    app = Celery("jobs", broker="redis://...")
    turns = ratequeue.celery.TaskTurns("redis://...", name="api", rate="10/second")

    @app.task
    @turns
    def fetch(item_id):
        response = httpx.get(f"https://api.example/items/{item_id}")
        response.raise_for_status()          # a 429 raises httpx.HTTPStatusError
        return response.json()

Every run of ``fetch``, in every worker process of every host, first waits
for its turn of the queue ``api``. A run that fails with a refusal (a 429, a
503 naming a wait, :class:`~ratequeue.RateLimited`; see
:func:`ratequeue.headers.refusal_of`) holds the **whole queue** for the wait
the service asked, then runs again at its next turn, in the same task
execution: no Celery retry is used (``self.request.retries`` stays 0), and
no other worker sends meanwhile. After ``refusals`` refusals in one run the
error goes to Celery, and the task's own retry policy applies.

The limiter is made in each worker process at its first task there, never in
the process that imports the module: a prefork pool's children do not share
their parent's connections or file descriptors. docs/celery.md.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from .core.flow import run
from .errors import ConfigurationError, RateQueueError
from .headers import refusal_of
from .limiter import Limiter
from .settings import Options, Settings
from .state import StateLike

__all__ = ["TaskTurns"]

_log = logging.getLogger("ratequeue.celery")

F = TypeVar("F", bound=Callable[..., Any])


class TaskTurns:
    """A decorator for a Celery task's function: each run takes its global turn; refusals hold the fleet."""

    def __init__(self, url: StateLike = None, *, name: str, refusals: int = 10, **options: Any) -> None:
        """
        :param url: the state (as for :class:`~ratequeue.Limiter`); shared by every worker.
        :param name: the queue name.
        :param refusals: how many refusals one run waits out before the error goes to Celery.
        :param options: the limiter's options (``rate=`` or ``interval=``, ``burst=``, ...),
            checked now.
        """
        Settings.of(name, cast(Options, dict(options)))  # every option checked here, not in the workers
        if isinstance(refusals, bool) or not isinstance(refusals, int) or not 0 <= refusals <= 1000:
            raise ConfigurationError(f"refusals must be a whole number from 0 to 1000, got {refusals!r}")
        self._url, self._name, self._options, self.refusals = url, name, options, refusals
        self._guard = threading.Lock()
        self._made: tuple[int, Limiter] | None = None

    @property
    def limiter(self) -> Limiter:
        """This process's limiter, made at its first use here (again in a forked child)."""
        with self._guard:
            if self._made is None or self._made[0] != os.getpid():
                self._made = (os.getpid(), Limiter(self._url, name=self._name, **self._options))
            return self._made[1]

    def __call__(self, fn: F) -> F:
        """``fn`` run at its turn; a refused run holds the queue and runs again at its next turn."""

        @functools.wraps(fn)
        def at_its_turn(*args: Any, **kwargs: Any) -> Any:
            limiter, refused = self.limiter, 0
            while True:
                turn = limiter.acquire()
                try:
                    return fn(*args, **kwargs)
                except Exception as exc:
                    held = refusal_of(exc)
                    if held is None or refused >= self.refusals or not _held(limiter, held):
                        raise
                    refused += 1
                finally:
                    if limiter.holds_places:  # a failed release must not fail the run: the lease expires
                        limiter._release_quietly((turn.ticket, turn.token))

        return cast(F, at_its_turn)


def _held(limiter: Limiter, seconds: float) -> bool:
    """Hold (and, adaptive, slow) the queue for a refusal; ``False`` if the state failed (it is logged)."""
    try:
        run(limiter._refused_flow(seconds))
    except RateQueueError as exc:  # the run fails with the refusal itself, for Celery's policy
        _log.warning("queue %r: could not hold the queue after a refusal: %s", limiter.name, exc)
        return False
    return True
