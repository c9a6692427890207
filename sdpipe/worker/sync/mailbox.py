"""Requests to a server thread through the run's store (the transport of ``ps`` and ``adpsgd``)."""

from __future__ import annotations

import threading
import time
import traceback

from sdpipe.wire.protocol import Keys

__all__ = ["HOLE_POLL", "MAILBOX_POLL", "WAKE", "Mailbox", "MailboxServer"]


class Mailbox:
    """Requests to one server, through the run's store: a counter hands out slots in order.

    Putting a request takes two store calls (claim a slot, fill it), so a
    writer that dies between them leaves a slot that is never filled (a hole):
    the server serves the filled slots past a hole (:class:`MailboxServer`).
    """

    def __init__(self, store, prefix: str):
        self.store, self.prefix = store, prefix

    def put(self, text: str) -> int:
        i = self.store.add(Keys.mailbox_count(self.prefix), 1) - 1
        self.store.set(Keys.mailbox_slot(self.prefix, i), text)
        return i

    def issued(self) -> int:
        """Slots claimed so far (filled or not)."""
        return self.store.add(Keys.mailbox_count(self.prefix), 0)

    def get(self, i: int, timeout: float):
        """Slot ``i``'s request once it is filled (waiting at most ``timeout`` seconds), or None.

        It looks every ``MAILBOX_POLL`` seconds at most rather than waiting in the store: a store wait that
        expires makes torch print a warning on the terminal (once per connection, on every worker that
        serves), and an idle server's waits expire."""
        key = Keys.mailbox_slot(self.prefix, i)
        deadline = time.monotonic() + timeout
        pause = MAILBOX_POLL / 8
        while not self.store.check([key]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(MAILBOX_POLL, pause * 2)
        return self._pop(key)

    def take(self, i: int):
        """Slot ``i``'s request if it is filled now, else None (no wait)."""
        key = Keys.mailbox_slot(self.prefix, i)
        return self._pop(key) if self.store.check([key]) else None

    def _pop(self, key: str) -> str:
        text = self.store.get(key).decode()
        self.store.delete_key(key)
        return text


#: seconds between looks at an idle server's next slot, at most (see :meth:`Mailbox.get`)
MAILBOX_POLL = 0.001
#: seconds between looks at the slots past a hole (see :class:`MailboxServer`)
HOLE_POLL = 0.002
#: a request that only wakes a server waiting for its next slot (:meth:`MailboxServer.settle` puts one)
WAKE = "wake"


class MailboxServer(threading.Thread):
    """Serves a mailbox until stopped; an error is kept for the main thread to raise.

    Slots are served in order while they are filled in order.  A slot that
    stays empty while later ones were claimed (its writer may have died
    between claiming and filling it) does not hold up the others: the server
    then looks at every claimed slot every ``HOLE_POLL`` seconds and serves
    the filled ones.  :meth:`settle` gives up on the holes below a count once
    every live writer is known to be done with them (the caller knows when);
    a slot given up on that is filled after all is still served.
    """

    def __init__(self, name: str, mailbox: Mailbox, handle, idle=None, door=None):
        super().__init__(name=name, daemon=True)
        self.mailbox, self.handle, self.idle = mailbox, handle, idle
        #: the same mailbox on the connection of the threads that are not this one (settle's wake, issued()): a
        #: store connection serves one call at a time, and this thread's waits would hold their calls up
        self.door = door if door is not None else mailbox
        self.stopping = threading.Event()
        self.error = None
        self.served = 0
        self.next = 0  # every slot below it is served or given up on
        self.ahead: set = set()  # slots above ``next`` already served (past a hole)
        self.given_up: set = set()  # empty slots below ``next``: still served if they are filled after all
        self.claimed = 0  # the mailbox's count of claimed slots, as last read
        self.settle_to = 0  # set by settle(): give up on the empty slots below it once the filled ones are served
        self.settled = 0
        self.woken = 0  # the highest settle target a wake was put for

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if not self._serve_one() and self.idle is not None:
                    self.idle()
        except BaseException as e:  # surfaced by check() in the worker's main thread
            traceback.clear_frames(e.__traceback__)  # kept: its frames must not keep a process group open
            self.error = e

    def _serve_one(self) -> bool:
        """Serve one filled slot if there is one (waiting a little); whether one was served."""
        behind = self.claimed > self.next or self.settle_to > self.settled
        text = self.mailbox.take(self.next) if behind else self.mailbox.get(self.next, 0.2)
        if text is not None:
            self._served(self.next, text)
            return True
        self.claimed = self.mailbox.issued()
        for i in sorted(self.given_up) + list(range(self.next + 1, self.claimed)):
            if i not in self.ahead:
                text = self.mailbox.take(i)
                if text is not None:
                    self.given_up.discard(i)
                    self._served(i, text)
                    return True
        if self.settle_to > self.settled:
            # every filled slot below settle_to is served: the empty ones are holes
            self.given_up.update(i for i in range(self.next, self.settle_to) if i not in self.ahead)
            self._advance(self.settle_to)
            self.settled = self.settle_to
        elif self.claimed > self.next:
            time.sleep(HOLE_POLL)
        return False

    def _served(self, i: int, text: str) -> None:
        if text == WAKE:  # settle() put it: the settle target takes it in, so the next look settles
            self.settle_to = max(self.settle_to, i + 1)
        else:
            self.handle(text)
            self.served += 1
        self.ahead.add(i)
        self._advance(self.next)

    def _advance(self, to: int) -> None:
        self.next = max(self.next, to)
        self.ahead = {i for i in self.ahead if i >= self.next}
        while self.next in self.ahead:
            self.ahead.discard(self.next)
            self.next += 1

    def settle(self, upto: int, timeout: float) -> bool:
        """Serve every filled slot below ``upto`` and give up on the empty ones; whether done within ``timeout``.

        Call it once every live writer has filled the slots it claimed below
        ``upto`` (e.g. every one of them is waiting for this worker).  A server that served everything waits
        for its next slot (up to 0.2 s a look): a wake request in that slot ends the wait at once.
        """
        self.settle_to = max(self.settle_to, upto)
        if self.settled < upto and self.woken < upto:
            self.woken = upto
            self.door.put(WAKE)
        return self.wait_until(lambda: self.settled >= upto, timeout, poll=0.001)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"{self.name}: {type(self.error).__name__}: {self.error}") from self.error

    def wait_until(self, until, timeout: float, poll: float = 0.02) -> bool:
        """Wait (at most ``timeout`` seconds) until ``until()`` holds or the server failed; whether it holds."""
        deadline = time.monotonic() + timeout
        while not until():
            if self.error is not None or time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True

    def finish(self, timeout: float, until=None) -> None:
        """Stop once ``until()`` holds (or at once), waiting at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        if until is not None:
            self.wait_until(until, timeout)
        self.stopping.set()
        self.join(max(0.0, deadline - time.monotonic()) + 1.0)
