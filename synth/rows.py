"""The decode batch's per-row host state, as numpy arrays over cache rows. No torch here.

The scheduler keeps every running segment's step counters in a `RowTable` rather than in its SegmentState, so
what each step does for every row (advance its position, tell the runner what to feed, record the id it sampled,
test the stop rules) is a fixed handful of numpy operations over arrays of rows, whatever the number of rows: a
Python loop over segments runs only for their rare events (admission, first id, end).

Rows of one CFG segment (cond, uncond) advance together; the per-segment counts (ids read back, valid ids, the
limit, the ids themselves) live on the cond row.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FREE = 0  # `gen` of a row no segment holds (claim ids start at 1)

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class RowTable:
    def __init__(self, max_rows: int, max_tokens: int) -> None:
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        # every row
        self.gen: IntArray = np.zeros(max_rows, np.int64)  # claim id of the segment holding the row (FREE: none)
        self.feed: IntArray = np.arange(max_rows, dtype=np.int64)  # row whose sampled id it feeds: its cond row
        self.next_pos: IntArray = np.zeros(max_rows, np.int64)  # next cache position it writes
        self.launched: IntArray = np.zeros(max_rows, np.int64)  # ids sampled or in flight for its segment
        self.decoding: BoolArray = np.zeros(max_rows, np.bool_)  # it decodes at the next step
        self.held: BoolArray = np.zeros(max_rows, np.bool_)  # its ids go to the vocoder only when its segment ends
        # cond rows
        # its segment is a live turn's first (its session has heard nothing yet): what job rows may sit out for
        self.first_audio: BoolArray = np.zeros(max_rows, np.bool_)
        self.n_tokens: IntArray = np.zeros(max_rows, np.int64)  # ids read back
        self.n_valid: IntArray = np.zeros(max_rows, np.int64)  # of them, ids the vocoder takes
        self.max_new: IntArray = np.zeros(max_rows, np.int64)  # the segment's limit
        self.tokens = np.zeros((max_rows, max_tokens), np.int32)  # [R, T] the ids read back, in order

    def claim(self, rows: tuple[int, ...], gen: int, next_pos: int, max_new: int, held: bool = False,
              first_audio: bool = False) -> None:
        """A segment admitted now: its first id is sampled at this step (from the prefill), so it decodes from
        the next one (`start_decoding`). `held`: a job segment (its ids are not streamed while it may be
        preempted). `first_audio`: a live turn's first segment."""
        if max_new > self.max_tokens:
            raise ValueError(f"max_new_tokens {max_new} > the table's {self.max_tokens}")
        index = list(rows)
        self.gen[index] = gen
        self.feed[index] = rows[0]
        self.next_pos[index] = next_pos
        self.launched[index] = 1
        self.decoding[index] = False
        self.held[index] = held
        cond = rows[0]
        self.first_audio[index] = False
        self.first_audio[cond] = first_audio  # on the cond row, beside its valid-id count
        self.n_tokens[cond] = self.n_valid[cond] = 0
        self.max_new[cond] = max_new

    def start_decoding(self, rows: tuple[int, ...]) -> None:
        self.decoding[list(rows)] = True

    def release(self, rows: tuple[int, ...]) -> None:
        index = list(rows)
        self.gen[index] = FREE
        self.decoding[index] = False
        self.first_audio[index] = False

    def tokens_of(self, cond_row: int) -> list[int]:
        return [int(t) for t in self.tokens[cond_row, :self.n_tokens[cond_row]]]
