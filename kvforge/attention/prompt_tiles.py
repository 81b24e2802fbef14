"""Attention of prompt rows in fixed tiles, so a row's bits do not depend on how the prompt was
split (``layers/prompt_rows.py``: a prefix-cache hit's tail, chunked prefill's pieces).

``scaled_dot_product_attention`` rounds a row by the shape of its call: the key count and the
query block it shares (a 1- or 2-row call sums otherwise than a 32-row block). So prompt rows are
computed per tile of absolute positions, each tile always the same call whatever rows of it the
step has::

    tile j:   query positions  [T j, T j + T)                 T = PROMPT_TILE; rows the step
                                                             lacks are zeros, their output dropped
              key positions    [lo_j, T j + T)                lo_j = 0, or with a sliding window
                                                             of W: max(0, T j - W + 1)
              mask             key <= query (and in the query's window)

A key position no present row can see (past the sequence, or before the earliest row's window)
is zero, never read from the cache (a window's freed blocks). The K/V come from the cache, which
the step wrote first: rows computed now and rows cached earlier read the same values.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvforge.attention.metadata import AttentionMetadata

PROMPT_TILE = 32


@dataclass
class _Tile:
    rows: slice                 # the step's rows at this tile's present positions
    offset: int                 # their first position - the tile's first
    keys: slice                 # the tile's key columns in the sequence's gathered K/V
    mask: torch.Tensor          # [PROMPT_TILE, key columns] bool, True: visible


@dataclass
class _Sequence:
    slots: torch.Tensor         # [gathered] cache slots of the key positions (0 where unread)
    unread: torch.Tensor        # [gathered, 1, 1] bool: positions left zero
    tiles: list[_Tile]


def prompt_plan(meta: AttentionMetadata, window: int | None) -> list[_Sequence]:
    """The step's tiles per sequence (``window``: a sliding window of that many keys, the query
    included; None: full causal attention). Built once per step and window."""
    device, block = meta.block_tables.device, meta.block_size
    starts = list(itertools.accumulate(meta.query_lens_list, initial=0))
    plan = []
    for seq in range(meta.num_seqs):
        query_len, seq_len = meta.query_lens_list[seq], meta.seq_lens_list[seq]
        if query_len == 0:
            continue
        first = seq_len - query_len
        tile_ids = range(first // PROMPT_TILE, (seq_len - 1) // PROMPT_TILE + 1)

        def lowest_key(tile: int) -> int:
            return 0 if window is None else max(0, tile * PROMPT_TILE - window + 1)

        lo, hi = lowest_key(tile_ids[0]), (tile_ids[-1] + 1) * PROMPT_TILE
        key_pos = torch.arange(lo, hi, device=device)
        earliest = 0 if window is None else first - window + 1
        read = (key_pos < seq_len) & (key_pos >= earliest)
        table = meta.block_tables[seq]
        safe_pos = torch.where(read, key_pos, 0)
        slots = torch.where(read, table[safe_pos // block] * block + safe_pos % block, 0)
        tiles = []
        for tile in tile_ids:
            p0, p1 = tile * PROMPT_TILE, (tile + 1) * PROMPT_TILE
            a, b = max(p0, first), min(p1, seq_len)
            query = torch.arange(p0, p1, device=device)[:, None]
            key = torch.arange(lowest_key(tile), p1, device=device)[None, :]
            mask = key <= query
            if window is not None:
                mask &= key > query - window
            tiles.append(_Tile(slice(starts[seq] + a - first, starts[seq] + b - first), a - p0,
                               slice(lowest_key(tile) - lo, p1 - lo), mask))
        plan.append(_Sequence(slots, ~read[:, None, None], tiles))
    return plan


def prompt_attention(backend, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     window: int | None, out: torch.Tensor) -> None:
    """``out[rows] =`` attention of every row of the step, tile by tile (``backend``: a paged
    backend: ``_gather_kv`` reads its cache layout, ``_sdpa`` runs one sequence's attention)."""
    plans = meta.__dict__.setdefault("_prompt_plans", {})
    if window not in plans:
        plans[window] = prompt_plan(meta, window)
    for seq in plans[window]:
        keys, values = backend._gather_kv(kv_cache, seq.slots)
        keys = keys.to(q.dtype).masked_fill_(seq.unread, 0.0)
        values = values.to(q.dtype).masked_fill_(seq.unread, 0.0)
        for tile in seq.tiles:
            n = tile.rows.stop - tile.rows.start
            queries = q.new_zeros(PROMPT_TILE, q.shape[1], q.shape[2])
            queries[tile.offset:tile.offset + n] = q[tile.rows]
            attn = backend._sdpa(queries, keys[tile.keys], values[tile.keys], tile.mask)
            out[tile.rows] = attn[tile.offset:tile.offset + n]
