"""The device-side page table and token table, written by the scheduler, read by the forward.

- page table `[rows, width]` int32: row r, column p is the KV slot of position p of the request
  in table row r.
- token table `[rows, width]` int32: the token ids of each request. The engine reads a batch's
  input ids from it and writes sampled ids back, so batch N+1 can be launched before the host has
  seen batch N's tokens (overlap scheduling).

The scheduler's writes (a new request's prompt, new pages' slots) are queued on the host and
applied by the engine at the start of the next forward, in stream order, with one non-blocking
copy: the scheduler never waits for the device. On CPU they are applied at once. Under CPU
overlap the forward runs on its own thread and flushes too, so a lock guards the queue: a flush
takes every queued write or none.

The last row is the dummy row that padded (CUDA-graph) batch entries point at: position 0 maps
to the pool's dummy page, which no request ever owns.
"""

from __future__ import annotations

import threading

import torch

from minisgl.engine.device import ComputeStream


class DeviceTables:
    def __init__(self, num_rows: int, width: int, stream: ComputeStream) -> None:
        self.stream = stream
        self.width = width
        self.num_rows = num_rows  # rows requests may use; row `num_rows` is the dummy row
        self.dummy_row = num_rows
        shape = (num_rows + 1, width)
        self.page_table = torch.zeros(shape, dtype=torch.int32, device=stream.device)
        self.token_table = torch.zeros(shape, dtype=torch.int32, device=stream.device)
        # Pending writes per table: flat indices into it and the values to put there (int64).
        self._pending: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {
            "page_table": ([], []),
            "token_table": ([], []),
        }
        self._lock = threading.Lock()  # the queue: scheduler thread vs CPU overlap's forward

    def point_dummy_row(self, dummy_slot: int) -> None:
        """Every position of the dummy row maps to `dummy_slot` (a slot no request owns)."""
        self.page_table[self.dummy_row].fill_(dummy_slot)
        self.token_table[self.dummy_row].zero_()

    def write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        self._write("token_table", row, start, torch.tensor(token_ids))

    def write_slots(self, row: int, start: int, slots: torch.Tensor) -> None:
        self._write("page_table", row, start, slots)

    def _write(self, table: str, row: int, start: int, data: torch.Tensor) -> None:
        if data.numel() == 0:
            return
        assert 0 <= row < self.num_rows and start + data.numel() <= self.width
        index, values = self._pending[table]
        with self._lock:
            index.append(torch.arange(data.numel(), dtype=torch.int64) + row * self.width + start)
            values.append(data.to(torch.int64))
        if not self.stream.is_cuda:
            self.flush()

    def flush(self) -> None:
        """Apply pending writes (on the engine's stream: call inside `ComputeStream.active`)."""
        with self._lock:
            for table, (index, values) in self._pending.items():
                if not index:
                    continue
                flat_index, flat_values = self.stream.stage(*_last_writes(index, values))
                getattr(self, table).view(-1).index_copy_(
                    0, flat_index, flat_values.to(torch.int32)
                )
                index.clear()
                values.clear()


def _last_writes(
    index: list[torch.Tensor], values: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate queued writes, keeping only the last write to each position: a row freed and
    reused within one step gets two writes to the same cells, and `index_copy_` applies
    duplicates in no defined order on CUDA."""
    flat_index, flat_values = torch.cat(index), torch.cat(values)
    unique, inverse = torch.unique(flat_index, return_inverse=True)
    if unique.numel() == flat_index.numel():
        return flat_index, flat_values
    order = torch.arange(flat_index.numel())
    last = torch.full_like(unique, -1).scatter_reduce_(0, inverse, order, "amax")
    return flat_index[last], flat_values[last]
