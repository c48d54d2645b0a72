"""What a block needs to know about its tokens besides their hidden states.

Every mixer has the same signature, ``mixer(hidden, context)``, so that a pattern string can put
any block kind anywhere and parallel wrappers can treat blocks alike. The context carries:

- ``position_ids`` [batch, seq]: global token positions (RoPE). With left-padded prompts they
  count real tokens only; under context parallelism they will be each chunk's global offsets.
- ``token_mask`` [batch, seq] bool or None: False marks padding. Attention never attends to a
  padded key; Mamba zeroes padded positions so they leave its conv and SSM states untouched.
- ``cache``: an ``InferenceCache`` during generation, else None.
- ``moe_losses``: MoE blocks append their auxiliary losses here for the model to collect.
- ``dropout_key``: which draw of the run this forward is (seed, step, global sample indices),
  for the layout-independent dropout masks of ``meshlm/models/dropout.py``; None outside training.
- ``document_ids`` [batch, seq] or None: with packed documents kept apart
  (``data.document_boundaries``), the document of each token, non-decreasing along a row (any
  integers: only equality matters, and under context parallelism they are the whole row's).
  Each block kind then acts as if every document were its own sequence: attention attends within
  a document only (``attention.document_attention``), Mamba-2 restarts its conv window and SSM
  state at each boundary (``causal_conv``, ``ssd``), MTP never looks or predicts across one
  (``mtp.py``); MLP and MoE act per token and need nothing.
- ``document_positions`` [batch, seq] or None: each token's position inside its document (0 at a
  document's first token), set with ``document_ids``. RoPE reads these (``rotary_positions``);
  ``position_ids`` stay the row positions, which dropout masks and context parallelism key on.
  The conv reads them too: tap j looks back j tokens, inside the document iff position >= j.
- ``rotary_tables``: RoPE's cos and sin of ``rotary_positions``, per (head_dim, theta), made once
  per forward (``rotary_cos_sin``) and read by every attention block. Each block making its own
  cost a whole step's worth: compiled, Inductor fused the table into the rotation and so took a
  cos, a sin and a power per element of every query and key head (an H200's 1B dense step spent
  21 ms of 447 there, 2026-11-27), where reading a table is a pass over memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshlm.models.cache import InferenceCache
from meshlm.models.dropout import DropoutKey


@dataclass
class SequenceContext:
    position_ids: torch.Tensor
    token_mask: torch.Tensor | None = None
    cache: InferenceCache | None = None
    moe_losses: list = field(default_factory=list)
    dropout_key: DropoutKey | None = None
    document_ids: torch.Tensor | None = None
    document_positions: torch.Tensor | None = None
    rotary_tables: dict = field(default_factory=dict)
    parallel_residual_input: tuple[int, torch.Tensor] | None = None
    """``model.parallel_residual``: (layer index, input) of the attention block that runs beside the
    next block, set by the attention block and taken (and cleared) by its partner (``models/block.py``)."""

    @property
    def rotary_positions(self) -> torch.Tensor:
        """The positions RoPE rotates by: inside each document when documents are kept apart."""
        return self.position_ids if self.document_positions is None else self.document_positions

    def rotary_cos_sin(self, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary(rotary_positions)`` (a ``RotaryEmbedding``), made once per forward and kept.

        ``Block.forward`` asks for it eagerly before its compiled step (``prepare_context``), so a
        compiled block finds the table here as an input. Inside a graph being traced nothing is
        kept: a graph that wrote into its input would be guarded on that, and compiled again.
        """
        key = rotary.table_key
        tables = self.rotary_tables.get(key)
        if tables is None:
            tables = rotary(self.rotary_positions)
            if not torch.compiler.is_compiling():
                self.rotary_tables[key] = tables
        return tables

    @staticmethod
    def for_tokens(input_ids: torch.Tensor, token_mask: torch.Tensor | None = None,
                   cache: InferenceCache | None = None,
                   position_ids: torch.Tensor | None = None,
                   dropout_key: DropoutKey | None = None, document_ids: torch.Tensor | None = None,
                   document_positions: torch.Tensor | None = None) -> "SequenceContext":
        """Build the context for a forward over ``input_ids`` [batch, seq].

        Positions default to 0, 1, 2, ... after whatever the cache has already seen, counting
        only real (unmasked) tokens, so a left-padded prompt starts at position 0 like an
        unpadded one. ``document_positions`` default to ``positions_in_documents(document_ids)``
        (context parallelism passes those of the whole row instead).
        """
        if document_ids is not None and (cache is not None or token_mask is not None):
            raise ValueError("document_ids (packed documents kept apart) are for training forwards: "
                             "they cannot be combined with a cache or a padding token_mask.")
        batch, seq = input_ids.shape
        cached_positions = None
        if cache is not None:
            cached_positions = cache.append_token_mask(token_mask, batch, seq, input_ids.device)
        if position_ids is None:
            if cache is not None:
                position_ids = cached_positions
            elif token_mask is not None:
                position_ids = (token_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        if document_ids is not None and document_positions is None:
            document_positions = positions_in_documents(document_ids)
        return SequenceContext(position_ids=position_ids, token_mask=token_mask, cache=cache, dropout_key=dropout_key,
                               document_ids=document_ids, document_positions=document_positions)


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document, for non-decreasing ``document_ids`` [batch, seq]."""
    seq = document_ids.shape[-1]
    positions = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts_here = torch.ones_like(document_ids, dtype=torch.bool)
    starts_here[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    document_start = torch.where(starts_here, positions, 0).cummax(dim=-1).values
    return positions - document_start
