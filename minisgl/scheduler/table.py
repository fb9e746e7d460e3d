"""Table rows: which request owns which row of the engine's page and token tables.

A row is a request's slot in the device tables (its token ids and the KV slot of each position).
Rows are handed out at admission and come back at release; writes go through `DeviceTables`,
which queues them for the next forward so the scheduler never waits for the device.
"""

from __future__ import annotations

import torch

from minisgl.engine.tables import DeviceTables


class TableManager:
    def __init__(self, tables: DeviceTables) -> None:
        self.tables = tables
        # A stack, lowest row on top: rows are reused in a stable order.
        self._free_rows = list(range(tables.num_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        self.tables.write_tokens(row, start, token_ids)

    def write_slots(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.tables.write_slots(row, start, slots)
