"""ResultsFile: a job's JSONL output that survives crashes and resumes.

Records are appended as requests finish, in groups: each group is one write() followed by
flush and fsync, at most ``group_size`` records or ``group_seconds`` apart. A crash (even
``kill -9`` or a lost VM) can therefore only leave the last line torn. Opening the file again:

    - drops a torn last line (the file is truncated to its last newline);
    - reads every record's key (``key(record)``), so the job skips what is done;
    - with ``expected``, drops the records of a key that has fewer than ``expected(key)`` of
      them (a request of n completions whose group was cut short), rewriting the file
      atomically (temp file, fsync, rename), so rerunning that request duplicates nothing.

A complete line that is not a JSON object is not guessed at: opening raises ValueError naming
the line. Nothing here knows the record format beyond ``key``.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

logger = logging.getLogger("jaxserve")

Record = dict[str, Any]


class ResultsFile:
    """Args:
    path: the JSONL file (created if missing, with its folder).
    key: a record's key (e.g. its custom_id).
    expected: records a key needs to count as done (default: one).
    group_size, group_seconds: when a group is written (whichever comes first).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        key: Callable[[Record], Hashable],
        *,
        expected: Callable[[Hashable], int] | None = None,
        group_size: int = 16,
        group_seconds: float = 1.0,
    ) -> None:
        self.path = pathlib.Path(path)
        self.group_size = group_size
        self.group_seconds = group_seconds
        self.num_torn_dropped = 0  # bytes of a torn last line dropped at open
        self.num_partial_dropped = 0  # records of unfinished keys dropped at open
        self.done = self._recover(key, expected)
        self._buffer: list[str] = []
        self._last_write = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    # ---- opening ----------------------------------------------------------------------------
    def _recover(
        self, key: Callable[[Record], Hashable], expected: Callable[[Hashable], int] | None
    ) -> set[Hashable]:
        if not self.path.exists():
            return set()
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            self.num_torn_dropped = len(data) - end
            logger.warning(
                "%s: dropping a torn last line (%d bytes) left by an interrupted run",
                self.path,
                self.num_torn_dropped,
            )
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
            data = data[:end]
        lines = data.decode("utf-8").splitlines()
        keys = [_key_of(key, line, self.path, i + 1) for i, line in enumerate(lines)]
        counts = Counter(keys)
        if expected is None:
            return set(counts)
        partial = {k for k, n in counts.items() if n < expected(k)}
        if partial:
            kept = [line for line, k in zip(lines, keys, strict=True) if k not in partial]
            self.num_partial_dropped = len(lines) - len(kept)
            logger.warning(
                "%s: dropping %d records of %d unfinished requests (they run again)",
                self.path,
                self.num_partial_dropped,
                len(partial),
            )
            self._replace_with(kept)
        return set(counts) - partial

    def _replace_with(self, lines: list[str]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    # ---- writing ----------------------------------------------------------------------------
    def append(self, *records: Record) -> None:
        """Queue records (written together, in one group); writes the group when it is due."""
        self._buffer.extend(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        due = time.monotonic() - self._last_write >= self.group_seconds
        if len(self._buffer) >= self.group_size or due:
            self.flush()

    def flush(self) -> None:
        """Write the queued records and make them durable (fsync)."""
        if self._buffer:
            self._file.write("".join(self._buffer))
            self._buffer.clear()
            self._file.flush()
            os.fsync(self._file.fileno())
        self._last_write = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key_of(
    key: Callable[[Record], Hashable], line: str, path: pathlib.Path, number: int
) -> Hashable:
    record = _parse(line, path, number)
    try:
        return key(record)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}:{number}: a record without its key ({e!r})") from None


def _parse(line: str, path: pathlib.Path, number: int) -> Record:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not a JSON line ({e}); not a results file?") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
    return record
