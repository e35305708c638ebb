"""Messages on their way into the conversation store, written in the order they happened.

A write the store refuses (a full disk, another writer holding the lock past the busy timeout)
is kept in memory with every write after it, and the whole queue is tried again on the next
write and on `flush` (the app calls it on a timer): nothing is dropped while the app runs, and a
reply is never written before the prompt it answers, whose `seq` it records.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.store import Store, StoreError
from engine.request.conversation import Conversation, Message


@dataclass(eq=False)
class Entry:
    """One message as the store should hold it: `seq` is None until its row is written;
    `partial` while its answer streams (the row is rewritten as it grows); `withdrawn`: its
    row, if written, is to be removed."""

    conv: Conversation
    message: Message
    reply_to: Entry | None = None
    partial: bool = False
    seq: int | None = None
    withdrawn: bool = False


@dataclass(eq=False)
class Cut:
    """Every stored message of `conv` after its first `n_keep` is to be removed (a message
    edited and sent again, an answer regenerated)."""

    conv: Conversation
    n_keep: int


class Outbox:
    """Writes entries to a store in order; keeps the ones that could not be written yet.

    `error` is the store's last refusal ("" once everything is written); `n_waiting` the
    messages not on disk yet.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.error = ""
        self._due: list[Entry | Cut] = []

    @property
    def n_waiting(self) -> int:
        return len({id(e) for e in self._due if isinstance(e, Entry) and not e.withdrawn})

    def put(self, entry: Entry | Cut) -> bool:
        """Write `entry` (its row, or its new text) after every earlier one; False when it
        waits in memory for the store."""
        if entry not in self._due:
            self._due.append(entry)
        return self.flush()

    def withdraw(self, entry: Entry) -> bool:
        """Remove `entry`: its row if written, else its pending write."""
        entry.withdrawn = True
        if entry.seq is None:  # never written: nothing to remove from the store
            self._due = [e for e in self._due if e is not entry]
            return self.flush()
        return self.put(entry)

    def cut(self, conv: Conversation, n_keep: int) -> bool:
        """Remove the stored messages of `conv` after its first `n_keep`, once every earlier
        write is done (a reply waiting in memory is written, then cut: positions agree)."""
        return self.put(Cut(conv, n_keep))

    def flush(self) -> bool:
        """Try every waiting write in order; False (and `error` set) at the first refusal."""
        while self._due:
            try:
                self._write(self._due[0])
            except StoreError as exc:
                self.error = str(exc)
                return False
            self._due.pop(0)
        self.error = ""
        return True

    def _write(self, entry: Entry | Cut) -> None:
        store = self.store
        if isinstance(entry, Cut):
            store.truncate(entry.conv.id, entry.n_keep)
            return
        if entry.withdrawn:
            assert entry.seq is not None, "a pending write withdrawn stays in the queue"
            store.withdraw(entry.conv.id, entry.seq)
            return
        if entry.seq is not None:
            store.update(entry.conv.id, entry.seq, entry.message, entry.partial)
            return
        prompt = entry.reply_to
        if prompt is not None and prompt.withdrawn:
            return  # the prompt is gone: so is its answer (a failed request)
        assert prompt is None or prompt.seq is not None, "a reply queued before its prompt"
        reply_to = prompt.seq if prompt is not None else None
        entry.seq = store.append(entry.conv, entry.message, reply_to, entry.partial)
