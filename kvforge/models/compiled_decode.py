"""The compiled whole-step decode (``kernels/decode_stack.py``) as a model family uses it.

A family whose decode step the ``DecodeStack`` runs (Llama and its relatives, Gemma 3) mixes
this in and says what differs through these hooks:

- ``_build_decode_stack()``: the stack over the model's weights, or None (not eligible);
- ``_stack_step_inputs(ids, positions)``: the embedded rows and the step's RoPE rows, ``(hidden,
  (cos, sin))`` or ``(hidden, (cos, sin, cos_local, sin_local))`` with ``[T, head_dim]`` each;
- ``_stack_rope_tables(positions, num_steps)``: ``(cos_sin, cos_sin_local or None, base)``:
  rows ``[rows, 2, head_dim]`` covering positions ``positions .. positions + num_steps - 1``,
  position p at row ``p - base`` (a precomputed table: the whole of it, base 0);
- ``_stack_embed_scale`` and ``_stack_greedy_exact``: the factor on embedded rows, and whether
  the argmax of the head's raw logits is the greedy token (not with a logit soft-cap).

What it provides: the step through the stack when ``forward`` qualifies (``_stack_forward``),
``decode_stack()``, and multi-step greedy decoding (``can_decode_steps`` / ``decode_steps``).
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.kernels.decode_stack import kernel_weight, run_decode_stack, stack_handles_step
from kvforge.kernels.ops import KERNEL_KV_DTYPES
from kvforge.layers.linear import Linear, PackedLinearMethod, PackedRowsEmbedding, place_linears
from kvforge.layers.prompt_rows import computing_prompt_rows


class CompiledDecodeMixin:
    _decode_stack = None            # built lazily, once
    _decode_stack_built = False
    # the stack's weights (and the LM head) in the packed layout; the ModelRunner turns it off
    # when speculation verifies up to 8 rows a step (kernels/decode_stack.py)
    pack_decode_weights = True
    _stack_embed_scale = 1.0
    _stack_greedy_exact = True

    def _build_decode_stack(self):
        raise NotImplementedError

    def _stack_step_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor):
        raise NotImplementedError

    def _stack_rope_tables(self, positions: torch.Tensor, num_steps: int):
        raise NotImplementedError

    def _stack_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], meta) -> torch.Tensor | None:
        """A step of decodes and short query runs (speculative verification), no prefill
        chunk, in one compiled call when the model qualifies; None otherwise (the caller runs
        its Python layers, which remain the reference). Prompt rows always run the Python
        layers (``layers/prompt_rows.py``), as a whole prompt's do."""
        if computing_prompt_rows():
            return None
        if stack_handles_step(meta) and len(kv_caches) == self.num_layers:
            stack = self.decode_stack()
            if (stack is not None and stack_handles_step(meta, stack)
                    and kv_caches[0].dtype in KERNEL_KV_DTYPES):
                return run_decode_stack(stack, self, input_ids, positions, kv_caches, meta)
        return None

    def decode_stack(self):
        """The compiled decode stack, built on first use (moving the projections' weights into
        huge pages and packing them: ~1 s for SmolLM2, so the engine calls this once it has
        configured the model), or None when the model does not qualify."""
        if not self._decode_stack_built:
            self._decode_stack = self._build_decode_stack()
            self._decode_stack_built = True
            if self._decode_stack is not None:
                self._place_lm_head()
        return self._decode_stack

    def can_decode_steps(self, num_seqs: int) -> bool:
        """Whether ``decode_steps`` runs ``num_seqs`` rows: the compiled stack with fp32
        kernels for every projection and an fp32 LM head and embedding table."""
        stack = self.decode_stack()
        return (stack is not None and self._stack_greedy_exact
                and stack.can_generate(num_seqs) and self._head_and_table() is not None)

    def decode_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, num_steps: int,
                     kv_caches: list[torch.Tensor], block_tables: torch.Tensor,
                     stop: torch.Tensor | None = None) -> torch.Tensor:
        """``num_steps`` greedy decode steps of a batch of sequences in one compiled call
        (multi-step decoding, see ``DecodeStack::generate``): sequence i continues from token
        ``input_ids[i]`` at ``positions[i]``, with KV slots for ``num_steps`` positions in its
        ``block_tables`` row. Returns the [num_seqs, steps run] argmax tokens, the ones that
        many one-step greedy samples would give: ``num_steps``, or fewer when another thread
        set ``stop`` (int32 [1]) during the call (it ends after the step then running)."""
        head, table = self._head_and_table()
        cos_sin, cos_sin_local, base = self._stack_rope_tables(positions, num_steps)
        return self.decode_stack().generate(
            input_ids, positions, num_steps, kv_caches, block_tables, cos_sin, table, head,
            self.config.vocab_size, stop, cos_sin_local=cos_sin_local, position_base=base,
            embed_scale=self._stack_embed_scale)

    def _head_and_table(self):
        """(LM head, embedding table) as the compiled stack takes weights
        (``kernel_weight``), or None."""
        head, embed = self.lm_head, self.model.embed_tokens
        if head.output_size != self.config.vocab_size or head.bias is not None:
            return None
        head_weight = kernel_weight(head)
        if isinstance(embed, PackedRowsEmbedding):
            table = head_weight
        elif isinstance(embed, Linear):            # GGUFEmbedding: the file's blocks
            table = kernel_weight(embed)
        elif type(embed) is nn.Embedding and embed.weight.dtype == torch.float32:
            table = embed.weight
        else:
            return None
        if head_weight is None or table is None:
            return None
        return head_weight, table

    def _place_lm_head(self) -> None:
        """The LM head in huge pages too, packed like the stack's projections when they are (a
        49k x 576 head streams at ~0.9 of a t.sum pass packed vs ~0.77 row-major when memory is
        fast). A tied head is the embedding table: the table then reads its rows from the head's
        new storage (packed: through ``PackedRowsEmbedding``)."""
        place_linears([self.lm_head], pack=self.pack_decode_weights)
        if not self._head_shares_embedding:
            return
        if type(self.lm_head.method) is PackedLinearMethod:
            self.model.embed_tokens = PackedRowsEmbedding(self.lm_head)
        else:
            self.model.embed_tokens.weight = self.lm_head.weight
