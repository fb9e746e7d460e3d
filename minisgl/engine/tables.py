"""The device-side page table (int32 [rows, width]: row r, column p is the KV slot of position p
of the request in row r) and token table (its token ids: the forward reads input ids there and
writes sampled ids back, so batch N+1 can launch before the host has seen batch N's tokens).

The scheduler's writes are queued on the host (under a lock: CPU overlap flushes from another
thread) and applied at the next forward in one non-blocking copy. The last row is the dummy
row that padded graph entries point at (its slots are the pool's dummy page)."""

import threading

import numpy as np
import torch
from torch import Tensor

from minisgl.engine.device import ComputeStream

_PAGE_TABLE, _TOKEN_TABLE = 0, 1  # their index in DeviceTables._tables


class DeviceTables:
    def __init__(self, num_rows: int, width: int, stream: ComputeStream) -> None:
        self.stream = stream
        self.width = width
        self.num_rows = num_rows  # rows requests may use; row `num_rows` is the dummy row
        self.dummy_row = num_rows
        # Both tables in one tensor, so that one copy applies every pending write: [2, rows, width]
        self._tables = torch.zeros(2, num_rows + 1, width, dtype=torch.int32, device=stream.device)
        self.page_table, self.token_table = self._tables[_PAGE_TABLE], self._tables[_TOKEN_TABLE]
        # Pending writes: flat indices into both tables and the values to put there (int64), in
        # numpy: a small array op costs a fraction of a torch call's microseconds on the host.
        self._index: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._lock = threading.Lock()  # the queue: scheduler thread vs CPU overlap's forward

    def point_dummy_row(self, dummy_slot: int) -> None:
        """Every position of the dummy row maps to `dummy_slot` (a slot no request owns)."""
        self.page_table[self.dummy_row].fill_(dummy_slot)
        self.token_table[self.dummy_row].zero_()

    def write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        self._write(_TOKEN_TABLE, [row], [start], np.asarray(token_ids, np.int64)[None, :])

    def write_slots(self, rows: list[int], starts: list[int], slots: Tensor) -> None:
        """Positions starts[i] .. starts[i] + k - 1 of row rows[i] get slots[i] ([len(rows), k]):
        one write for a whole step's new pages."""
        self._write(_PAGE_TABLE, rows, starts, slots.numpy())

    def _write(self, table: int, rows: list[int], starts: list[int], data: np.ndarray) -> None:
        if data.size == 0:
            return
        assert min(rows) >= 0 and max(rows) < self.num_rows
        assert min(starts) >= 0 and max(starts) + data.shape[1] <= self.width
        first = np.asarray(rows, np.int64) * self.width + np.asarray(starts, np.int64)
        first += table * (self.num_rows + 1) * self.width
        with self._lock:
            self._index.append((first[:, None] + np.arange(data.shape[1])).ravel())
            self._values.append(data.astype(np.int64).ravel())

    def flush(self) -> None:
        """Apply pending writes (on the engine's stream: call inside `ComputeStream.active`)."""
        with self._lock:
            if not self._index:
                return
            writes = _last_writes(self._index, self._values)
            index, values = self.stream.stage(torch.int64, *map(torch.from_numpy, writes))
            self._tables.view(-1).index_copy_(0, index, values.to(torch.int32))
            self._index.clear()
            self._values.clear()


def _last_writes(index: list[np.ndarray], values: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Concatenate queued writes, keeping only the last write to each position: a row freed and
    reused within one step gets two writes to the same cells, and `index_copy_` applies
    duplicates in no defined order on CUDA."""
    flat_index, flat_values = np.concatenate(index), np.concatenate(values)
    unique, last_from_end = np.unique(flat_index[::-1], return_index=True)
    if unique.size == flat_index.size:
        return flat_index, flat_values
    last = flat_index.size - 1 - last_from_end
    return flat_index[last], flat_values[last]
