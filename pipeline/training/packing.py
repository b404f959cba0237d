"""Packed and padding-free batches of `client = sft` (`Setting.packing`, `Run.packing`), by TRL's names.

TRL 1.16's SFTTrainer with `packing` packs the tokenized documents into rows of `max_length` tokens by best fit
decreasing (`packing_strategy` "bfd", documents longer than a row truncated), which turns `padding_free` on: the
collator concatenates a micro-batch's rows into one row of B x L tokens with `position_ids` that restart at every
document, and no attention mask. `padding_free` alone concatenates the (truncated) documents of a micro-batch the
same way. With torch's SDPA or eager attention, transformers builds a (1, 1, N, N) boolean mask for N such tokens
(`masking_utils.find_packed_sequence_indices`); flash-attention's variable-length path needs none.

A step is given by the documents of each row (`documents`): by default a packed row is full, made of two
documents (a row of one document has no mask: it is an unpacked row); padding-free rows are one document of
max_length. `worst_step` finds, for a list of document lengths, the micro-batch with the most tokens and a step of
as many tokens.
"""

from __future__ import annotations

import bisect
import json
import math
import numbers
from collections import deque
from dataclasses import dataclass

from pipeline.core.errors import UserError
from pipeline.core.text import short

MAX_DOCUMENTS = 10_000_000  # lengths of a dataset the worst step is searched over
PACKED_TOGETHER = 1000  # documents packed at once: datasets' Dataset.map batch size, which pack_dataset keeps


@dataclass(frozen=True)
class Packing:
    """How SFTTrainer batches the rows: `packing` (best fit decreasing into rows of max_length; padding-free),
    `padding_free` (a micro-batch's rows concatenated into one), and the token counts of the documents that make
    each row (`documents`; None: a full row of max_length, as `row_documents` splits it)."""

    packing: bool = False
    padding_free: bool = False
    documents: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.packing and not self.padding_free:  # TRL's bfd packing turns padding-free on
            object.__setattr__(self, "padding_free", True)
        if self.documents is not None:
            object.__setattr__(self, "documents", tuple(int(n) for n in self.documents))

    @classmethod
    def of(cls, packing, padding_free, label: str = "packing") -> Packing | None:
        """The batching of `packing` / `padding_free` (true, false or None); None where neither is on."""
        for name, value in (("packing", packing), ("padding_free", padding_free)):
            if value is not None and not isinstance(value, bool):
                raise UserError(f"{label}: {name} must be true or false, not {short(value)}")
        if not packing and not padding_free:
            return None
        return cls(bool(packing), bool(padding_free))

    def row_documents(self, seq: int) -> tuple[int, ...]:
        """The documents of each dataset row at max_length `seq`: a packed row two (of seq // 2 and the rest, which
        best fit decreasing packs back into one full row), a padding-free row one."""
        if self.documents is not None:
            return self.documents
        return (seq - seq // 2, seq // 2) if self.packing and seq > 1 else (seq,)

    def config_arguments(self) -> dict:
        """SFTConfig's keys: padding-free without packing with max_length None, as TRL requires (it refuses a
        max_length it would not enforce); the documents are then as long as they are."""
        return {"packing": True} if self.packing else {"padding_free": True, "max_length": None}

    def to_text(self) -> str:
        """The tables' `packing` cell (JSON)."""
        given = {"packing": self.packing, "padding_free": self.padding_free}
        if self.documents is not None:
            given["documents"] = list(self.documents)
        return json.dumps(given, sort_keys=True)

    @classmethod
    def from_text(cls, text) -> Packing | None:
        if not isinstance(text, str) or not text:
            return None
        given = json.loads(text)
        return cls(bool(given.get("packing")), bool(given.get("padding_free")), given.get("documents"))

    @classmethod
    def from_keys(cls, keys, label: str) -> Packing | None:
        """A table's packing cell as given by hand (`measure --packing`): its keys checked, one line for a bad one."""
        if not isinstance(keys, dict) or not set(keys) <= {"packing", "padding_free", "documents"}:
            raise UserError(f"{label} must be a JSON object of packing, padding_free and documents")
        packing = cls.of(keys.get("packing"), keys.get("padding_free"), label)
        documents = keys.get("documents")
        if documents is not None:
            documents = check_lengths(documents, f"{label}: documents")
        if packing is None:
            if documents is not None:
                raise UserError(f"{label}: documents go with packing or padding_free")
            return None
        return cls(packing.packing, packing.padding_free, documents)


def check_lengths(lengths, label: str = "lengths") -> list[int]:
    """A dataset's document lengths (token counts): whole numbers from 1."""
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise UserError(f"{label} must be a list of token counts, not {short(lengths)}")
    lengths = list(lengths)
    if not lengths or len(lengths) > MAX_DOCUMENTS:
        raise UserError(f"{label} must list from 1 to {MAX_DOCUMENTS:,} token counts, not {len(lengths):,}")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise UserError(f"{label}: every token count must be a whole number from 1, not {short(n)}")
    return [int(n) for n in lengths]


def read_lengths(path) -> list[int]:
    """A dataset's document lengths from a file: a JSON list of token counts, or one count per line, or JSON lines
    with each document's `input_ids` (a tokenized dataset's rows) or its `length` / `num_tokens`."""
    from pathlib import Path

    label = f"lengths file {path}"
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{label}: cannot be read ({type(exc).__name__})") from None
    text = text.strip()
    if text.startswith("["):
        try:
            return check_lengths(json.loads(text), label)
        except json.JSONDecodeError:
            raise UserError(f"{label}: not a JSON list of token counts") from None
    lengths = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{label}: line {number} is neither a token count nor a JSON object") from None
        if isinstance(value, dict):
            value = len(value["input_ids"]) if isinstance(value.get("input_ids"), list) else \
                value.get("length", value.get("num_tokens"))
        lengths.append(value)
    return check_lengths(lengths, label)


def packed_rows(lengths: list[int], seq: int) -> list[list[int]]:
    """The rows TRL's best fit decreasing packs `lengths` into (each truncated to `seq`): each row the lengths of
    its documents. `pack_dataset` packs each batch of `PACKED_TOGETHER` documents apart (`Dataset.map(batched=True)`),
    in the dataset's order."""
    return [row for start in range(0, len(lengths), PACKED_TOGETHER)
            for row in best_fit_decreasing(lengths[start:start + PACKED_TOGETHER], seq)]


def best_fit_decreasing(lengths: list[int], seq: int) -> list[list[int]]:
    """`trl.data_utils._pack_bfd`: longest first, a document goes to the row whose free space fits it most tightly,
    a new row if none does (of rows with the same free space, the first)."""
    rows: list[list[int]] = []
    spaces: list[int] = []  # sorted free space of the open rows
    rows_by_space: dict[int, deque] = {}
    for n in sorted((min(n, seq) for n in lengths), reverse=True):
        at = bisect.bisect_left(spaces, n)
        if at < len(spaces):
            space = spaces.pop(at)
            index = rows_by_space[space].popleft()
        else:
            space, index = seq, len(rows)
            rows.append([])
        rows[index].append(n)
        left = space - n
        if left > 0:
            bisect.insort(spaces, left)
            rows_by_space.setdefault(left, deque()).append(index)
    return rows


@dataclass(frozen=True)
class WorstStep:
    """The micro-batch of a dataset with the most tokens: its tokens, and the step that has as many: `batch` rows
    of `seq` tokens (the rows' length; at most max_length) batched by `packing`."""

    tokens: int
    seq: int
    packing: Packing | None
    batch: int  # the rows of the step: the run's batch, or fewer where the dataset has fewer

    def note(self, batch: int, seq: int, count: int) -> str:
        kind = ("packed rows" if self.packing.packing else "documents, concatenated") if self.packing else \
            "documents, padded to the longest"
        return (f"the worst step of the {count:,} documents: {self.tokens:,} tokens in {self.batch} {kind} (the "
                f"step asked: {batch * seq:,})")


def worst_step(lengths: list[int], batch: int, seq: int, packing: Packing | None) -> WorstStep:
    """The micro-batch of `batch` rows with the most tokens that the Trainer's shuffled sampler can draw from a
    dataset of documents of `lengths` tokens (truncated to max_length `seq`, but under padding-free alone, which TRL
    runs without a max_length): the `batch` fullest packed rows, or the `batch` longest documents (padded to the
    longest without padding-free). Its rows are simulated alike, each
    of the rows' mean length rounded up (the step's length, at most `seq`): packing splits each into two documents
    that pack back into one row of that length, or keeps the one document of a lone row."""
    lengths = check_lengths(lengths)
    if packing is not None and packing.packing:
        # of rows as full, those of more documents first: a row of several gets the packed-sequence mask
        rows = sorted(packed_rows(lengths, seq), key=lambda row: (sum(row), len(row)), reverse=True)[:batch]
        tokens = sum(map(sum, rows))
        per_row = math.ceil(tokens / len(rows))
        alone = len(rows) == 1 and len(rows[0]) == 1  # one row of one document: no packed-sequence mask
        return WorstStep(tokens, per_row, Packing(True, True, (per_row,) if alone else None), len(rows))
    if packing is not None and packing.padding_free:  # TRL runs it with max_length None: nothing truncated
        longest = sorted(lengths, reverse=True)[:batch]
        return WorstStep(sum(longest), math.ceil(sum(longest) / len(longest)), Packing(False, True), len(longest))
    longest = sorted((min(n, seq) for n in lengths), reverse=True)[:batch]
    return WorstStep(len(longest) * longest[0], longest[0], None, len(longest))
