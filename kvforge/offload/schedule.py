"""The zig-zag block schedule: a block of ``num_batches`` batches is traversed column by column
(FlexGen's Figure 3): layer j runs on every batch of the block before layer j + 1 starts, so one
load of layer j's weights serves them all. Consecutive layers walk the batches in opposite
directions (0..n-1, then n-1..0): the batch a layer finishes on is the one the next layer starts
on, whose activations are the most recently touched."""
from __future__ import annotations


def walks_forward(layer: int) -> bool:
    """Whether ``layer`` walks the block's batches 0..n-1 (else n-1..0)."""
    return layer % 2 == 0


def zigzag_order(num_layers: int, num_batches: int) -> list[tuple[int, int]]:
    """[(layer, batch)] in compute order."""
    if num_layers < 0 or num_batches < 1:
        raise ValueError(f"need num_layers >= 0 and num_batches >= 1, got {num_layers}, "
                         f"{num_batches}")
    order: list[tuple[int, int]] = []
    for layer in range(num_layers):
        batches = range(num_batches) if walks_forward(layer) else range(num_batches - 1, -1, -1)
        order.extend((layer, b) for b in batches)
    return order


def split_batches(num_seqs: int, batch_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) sequence ranges of at most ``batch_size`` (decodes stay first
    within each range because the step's layout puts them first)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [(s, min(s + batch_size, num_seqs)) for s in range(0, num_seqs, batch_size)]


def group_batches(batch_tokens: list[int], max_rows: int) -> list[list[int]]:
    """Consecutive batches joined into groups of at most ``max_rows`` tokens (a batch larger
    than that is a group alone): the rows a layer's dense projections run on in one call.
    Attention still runs per batch where the KV is staged per batch; a group bounds the
    activations a projection holds (a prefill step's thousands of tokens)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    groups: list[list[int]] = []
    rows = 0
    for k, n in enumerate(batch_tokens):
        if groups and rows + n <= max_rows:
            groups[-1].append(k)
            rows += n
        else:
            groups.append([k])
            rows = n
    return groups
