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
the line. Nothing here knows the record format beyond ``key``. With a ``job`` (job_spec.py) the
file starts with the job's header and is checked against the job before anything in it changes,
the torn last line included: a file that is not this job's output is never modified.
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

from jaxserve.checkpoints_tools.interrupt import check_interrupted
from jaxserve.jobs.job_spec import HEADER_KEY, JobSpec, NotAResultsFileError, is_header
from jaxserve.jobs.jsonl import LineError, decode_line, parse_object

logger = logging.getLogger("jaxserve")

Record = dict[str, Any]


class ResultsFile:
    """Args:
    path: the JSONL file (created if missing, with its folder).
    key: a record's key (e.g. its custom_id).
    expected: records a key needs to count as done (default: one).
    job: what identifies the job (job_spec.py). With it the file starts with the job's header,
        every record read back is checked against the job, and a file that is not recognisably
        this job's output is refused before anything in it changes (NotAResultsFileError,
        JobMismatchError; both ValueError). Without it, any JSONL of keyed records is taken.
    overwrite: with ``job``, start again: a file recognisably a jaxserve job's output is
        replaced by a fresh header (atomically); any other file is still refused.
    group_size, group_seconds: when a group is written (whichever comes first).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        key: Callable[[Record], Hashable],
        *,
        expected: Callable[[Hashable], int] | None = None,
        job: JobSpec | None = None,
        overwrite: bool = False,
        group_size: int = 16,
        group_seconds: float = 1.0,
    ) -> None:
        self.path = pathlib.Path(path)
        self.group_size = group_size
        self.group_seconds = group_seconds
        self.job = job
        self.num_torn_dropped = 0  # bytes of a torn last line dropped at open
        self.num_partial_dropped = 0  # records of unfinished keys dropped at open
        self._header: list[str] = []  # the header line kept when the file is rewritten
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done = self._recover(key, expected, overwrite)
        self._buffer: list[str] = []
        self._last_write = time.monotonic()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    # ---- opening ----------------------------------------------------------------------------
    def _recover(
        self,
        key: Callable[[Record], Hashable],
        expected: Callable[[Hashable], int] | None,
        overwrite: bool,
    ) -> set[Hashable]:
        data = self.path.read_bytes() if self.path.exists() else b""
        end = data.rfind(b"\n") + 1
        lines = [_decode(raw, self.path, i + 1) for i, raw in enumerate(data[:end].splitlines())]
        if self.job is not None:
            fresh = self._check_job(lines, data[end:], key, overwrite)
            if fresh:
                self._header = [json.dumps(self.job.header(), ensure_ascii=False)]
                self._replace_with([])
                return set()
            lines = lines[len(self._header) :]
        if end < len(data):
            self._drop_torn(end, len(data) - end)
        first = len(self._header) + 1
        keys = [_key_of(key, line, self.path, first + i) for i, line in enumerate(lines)]
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

    def _check_job(
        self, lines: list[str], torn: bytes, key: Callable[[Record], Hashable], overwrite: bool
    ) -> bool:
        """Whether to start a fresh file; raises when the file is not this job's to touch.
        Sets ``_header`` when the file has one."""
        assert self.job is not None
        job = self.job
        if not lines:
            if torn and not torn.startswith(b'{"' + HEADER_KEY.encode()):
                raise NotAResultsFileError(
                    f"{self.path}: {len(torn)} bytes without a newline, not a results file; "
                    f"refusing to modify it (choose another output, or move it away)"
                )
            return True  # empty, or a header torn by a crash at the very first write
        records = [_parse(line, self.path, i + 1) for i, line in enumerate(lines)]
        if is_header(records[0]):
            if overwrite:
                return True
            job.check_header(records[0], self.path)
            self._header = [json.dumps(job.header(), ensure_ascii=False)]
            for i, record in enumerate(records[1:], start=2):
                where = f"{self.path}:{i}"
                job.check_record(_key_of(key, lines[i - 1], self.path, i), record, where)
            return False
        for i, record in enumerate(records, start=1):
            if not job.is_record(record) or (
                not overwrite and _key_of(key, lines[i - 1], self.path, i) not in job.input_hashes
            ):
                raise NotAResultsFileError(
                    f"{self.path}:{i}: not a result of this {job.kind} job (and no "
                    f"{HEADER_KEY!r} header); refusing to modify it (choose another output, or "
                    f"move it away)"
                )
        if overwrite:
            return True
        logger.warning(
            "%s: no %r header (written by an older jaxserve): resuming, but a change in the "
            "input since that run cannot be detected; pass --overwrite to start again",
            self.path,
            HEADER_KEY,
        )
        return False

    def _drop_torn(self, end: int, num_bytes: int) -> None:
        self.num_torn_dropped = num_bytes
        logger.warning(
            "%s: dropping a torn last line (%d bytes) left by an interrupted run",
            self.path,
            num_bytes,
        )
        with open(self.path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())

    def _replace_with(self, lines: list[str]) -> None:
        """Atomically make the file its header line (if it has one) and ``lines``."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in self._header + lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    # ---- writing ----------------------------------------------------------------------------
    def append(self, *records: Record) -> None:
        """Queue records (written together, in one group); writes the group when it is due.

        Raises:
            KeyboardInterrupt: a Ctrl-C came whose own KeyboardInterrupt was lost
                (checkpoints_tools/interrupt.py).
        """
        check_interrupted()
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


def _decode(raw: bytes, path: pathlib.Path, number: int) -> str:
    try:
        return decode_line(raw, f"{path}:{number}")
    except LineError as e:
        raise NotAResultsFileError(f"{e}; not a results file") from None


def _parse(line: str, path: pathlib.Path, number: int) -> Record:
    try:
        return parse_object(line, f"{path}:{number}")
    except LineError as e:
        raise NotAResultsFileError(f"{e}; not a results file?") from None
