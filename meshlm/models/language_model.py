"""The language model: embedding -> blocks from the pattern -> final norm -> output head.

    h_0 = Dropout(Embed(tokens) [+ Positions(p)])      (model.position_embedding=learned: GPT-2's table)
    h_i = h_{i-1} + m Dropout(Mixer_i(Norm_i(h_{i-1})))  one pre-norm residual block per symbol
                                                         (m: model.residual_multiplier, 1 by default)
    logits = Head(FinalNorm(h_L)) / d                   (d: model.logit_divisor; soft-capped:
                                                         model.final_logit_softcap)
    loss = CE(logits, labels) + sum_E (aux_coeff * aux + z_coeff * z) + mtp_coeff * MTP

Dropout (``model.hidden_dropout``, off by default, active in training mode only) draws its masks
from the tokens' global coordinates (``meshlm/models/dropout.py``), so a parallel run drops the
same elements as a single process; the trainer passes the key (seed, step, sample indices), a
bare training-mode forward draws one.

A reward model (``model.head=reward``) has no output head and no logits: ``reward_head`` maps the
normed last token of each sequence to its scores (``meshlm/models/reward_head.py``).

When the caller wants only the loss (``return_logits=False``, as the trainer does), Head and CE
are fused (``head_loss``, meshlm/models/losses.py): the logits are computed a chunk of tokens at
a time and never held in full, which saves memory and time.

The forward is split into ``embed``, ``run_blocks`` and ``finish`` (head, losses, MTP) so that a
pipeline stage can run only its share (embedding on the first stage, head and loss on the last;
``meshlm/parallel/pipeline/``), and parameter names (``blocks.{i}...``) use the *global* block index so that checkpoints do not
depend on the parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.block import Block, pair_parallel_residual_blocks
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.dropout import DropoutKey, HiddenDropout, dropout_site
from meshlm.models.init import draw_seed, initialize_weights
from meshlm.models.lora import add_adapters
from meshlm.models.losses import language_model_loss, linear_cross_entropy
from meshlm.models.mtp import MultiTokenPrediction
from meshlm.models.norms import model_norm
from meshlm.models.position_embedding import LearnedPositions
from meshlm.models.reward_head import build_reward_head
from meshlm.models.softcap import soft_cap


@dataclass
class LMOutput:
    logits: torch.Tensor | None
    """[batch, seq, vocab] fp32 logits (None when the caller asked for the loss only)."""
    loss: torch.Tensor | None = None
    """Total training loss: language-model loss plus every auxiliary term times its coefficient."""
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each term before its coefficient: 'lm', 'moe_aux', 'moe_z', 'mtp', 'mtp_{k}'."""
    tokens_per_expert: list[torch.Tensor] = field(default_factory=list)
    """Per MoE block, the number of token assignments each expert received."""


class LanguageModel(nn.Module):
    """``seed`` fixes the initial values, each tensor drawn from its own generator (see
    ``meshlm/models/init.py``; None: a seed drawn from torch's global generator). Built under
    ``torch.device("meta")`` the model has shapes but no values: that is how a parallel run
    starts (``meshlm/checkpoint/materialize.py`` fills each rank's shards with the same values)."""

    def __init__(self, config: ModelConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.init_seed = draw_seed() if seed is None else int(seed)
        device = torch.get_default_device()
        with torch.device("meta"):  # shapes first; each tensor is then filled once, by its rule
            self.build_modules(config)
        if device.type != "meta":
            self.to_empty(device=device)
            initialize_weights(self, config, self.init_seed)

    def build_modules(self, config: ModelConfig) -> None:
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = None
        """``model.position_embedding=learned``: a trained vector per position, added to the token
        embeddings (GPT-2's ``wpe``); looked up at the positions RoPE would rotate by (each token's
        place in its document when packed documents are kept apart; the cache's count when
        generating). None for RoPE or no positions."""
        if config.position_embedding == "learned":
            self.position_embedding = LearnedPositions(config.max_position_embeddings, config.hidden_size)
        self.embedding_dropout = HiddenDropout(config.hidden_dropout, dropout_site("embedding"))
        self.blocks = nn.ModuleList(Block(kind, config, index) for index, kind in enumerate(config.block_kinds))
        pair_parallel_residual_blocks(self.blocks, config)
        self.final_norm = model_norm(config)
        self.output = (None if config.tie_embeddings or config.head == "reward"
                       else nn.Linear(config.hidden_size, config.vocab_size, bias=config.output_bias))
        self.reward_head = None  # model.head=reward: scores at the last token instead of logits (reward_head.py)
        if config.head == "reward":
            self.reward_head = build_reward_head(config.hidden_size, len(config.reward_attributes))
        self.mtp = None
        if config.mtp_depth:
            self.mtp = MultiTokenPrediction(config)
        add_adapters(self, config, self.named_blocks())  # model.lora_rank > 0: LoRA (lora.py)
        self.loss_chunk_softmax = None
        """The fused loss's softmax part (``losses.linear_cross_entropy``'s ``chunk_softmax``): None
        for the eager kernels; ``train.compile`` sets a compiled ``softmax_cross_entropy_chunk``."""

    def named_blocks(self) -> list[tuple[str, Block]]:
        """(name, block) of the main blocks and the MTP depths' blocks."""
        named = [(f"blocks.{index}", block) for index, block in enumerate(self.blocks)]
        if self.mtp is not None:
            named += [(f"mtp.depths.{depth}.blocks.{index}", block)
                      for depth, module in enumerate(self.mtp.depths) for index, block in enumerate(module.blocks)]
        return named

    # --- pieces (pipeline stages call these directly) ------------------------------------------
    def embed(self, input_ids: torch.Tensor, context: SequenceContext | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings, plus learned position embeddings (at ``positions``, else the context's);
        with ``context``, after the embedding dropout (the model's input; MTP's future-token
        embeddings are taken without, and without positions: the two are not combined)."""
        hidden = self.embedding(input_ids)
        if self.config.embedding_multiplier != 1.0:  # Gemma's sqrt(hidden), in the embedding's dtype as there
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        if self.position_embedding is not None and (positions is not None or context is not None):
            positions = context.rotary_positions if positions is None else positions
            hidden = hidden + self.position_embedding(positions).to(hidden.dtype)
        return hidden if context is None else self.embedding_dropout(hidden, context)

    def run_blocks(self, hidden: torch.Tensor, context: SequenceContext) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden, context)
        return hidden

    def output_weight(self) -> torch.Tensor:
        if self.reward_head is not None:  # every path to logits comes here: generation, evaluation, LM losses
            raise ConfigError("this model has model.head=reward, which gives scores, not next-token logits, so it "
                              "cannot generate or compute a language-model loss; read it with `meshlm score`.")
        return self.embedding.weight if self.output is None else self.output.weight

    def output_bias(self) -> torch.Tensor | None:
        """The output head's bias (``model.output_bias``), or None."""
        return None if self.output is None else self.output.bias

    def head_logits(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """Final norm (unless already applied) then the output projection, as fp32 logits
        (soft-capped with ``model.final_logit_softcap``)."""
        if not normed:
            hidden = self.final_norm(hidden)
        return self.finished_logits(F.linear(hidden, self.output_weight(), self.output_bias()).float())

    def finished_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's raw ``logits`` divided by ``model.logit_divisor`` (Granite) and soft-capped at
        ``model.final_logit_softcap`` (Gemma 2), where those are set."""
        if self.config.logit_divisor != 1.0:
            logits = logits / self.config.logit_divisor
        cap = self.config.final_logit_softcap
        return logits if cap is None else soft_cap(logits, cap)

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """``language_model_loss(head_logits(hidden), labels)`` without materializing the logits.

        A subclass that replaces ``head_logits`` (e.g. a vocabulary-split head) must replace this too.
        """
        if not normed:
            hidden = self.final_norm(hidden)
        bias = self.output_bias()
        if self.config.logit_divisor != 1.0:  # (h / d) W^T + b / d = (h W^T + b) / d: on the smaller tensors
            hidden = hidden / self.config.logit_divisor
            bias = None if bias is None else bias / self.config.logit_divisor
        return linear_cross_entropy(hidden, self.output_weight(), labels, chunk_softmax=self.loss_chunk_softmax,
                                    softcap=self.config.final_logit_softcap, bias=bias)

    # --- whole model -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                token_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cache: InferenceCache | None = None, return_logits: bool = True,
                dropout_key: DropoutKey | None = None, document_ids: torch.Tensor | None = None,
                document_positions: torch.Tensor | None = None) -> LMOutput:
        """Logits for ``input_ids`` [batch, seq]; with ``labels`` [batch, seq] also the loss.

        ``labels[b, t]`` is the token that should follow position t (IGNORE_INDEX to skip it).
        ``dropout_key`` fixes the dropout masks in training mode (drawn from torch's generator
        when None and the model has dropout). ``document_ids`` [batch, seq]: the row packs several
        documents, kept apart as if each were run on its own (``SequenceContext``; the labels at
        boundaries are the data's business: ``meshlm/data/gpt_dataset.py`` ignores them).
        """
        config = self.config
        if dropout_key is None and self.training and (config.hidden_dropout or config.attention_dropout
                                                      or config.lora_dropout):
            dropout_key = DropoutKey.draw(input_ids.shape[0], input_ids.device)
        context = SequenceContext.for_tokens(input_ids, token_mask, cache, position_ids, dropout_key,
                                             document_ids, document_positions)
        hidden = self.run_blocks(self.embed(input_ids, context), context)
        return self.finish(hidden, input_ids, labels, context, token_mask=token_mask, return_logits=return_logits)

    def finish(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None,
               context: SequenceContext, token_mask: torch.Tensor | None = None,
               return_logits: bool = True) -> LMOutput:
        """Head, losses and MTP from the last block's output: the end of ``forward``, and all that
        the last pipeline stage runs after its blocks (the MoE terms are those of ``context``)."""
        fused_loss = labels is not None and not return_logits
        logits = None if fused_loss else self.head_logits(hidden)
        output = LMOutput(logits=logits)
        if context.moe_losses:
            output.tokens_per_expert = [losses.tokens_per_expert for losses in context.moe_losses]
        if labels is None:
            return output

        output.losses["lm"] = self.head_loss(hidden, labels) if fused_loss else language_model_loss(logits, labels)
        total = output.losses["lm"]
        if context.moe_losses:
            output.losses.update(self.moe_loss_terms(context))
            total = self.add_moe_losses(total, output.losses)
        if self.mtp is not None:
            mtp_context = SequenceContext(position_ids=context.position_ids, token_mask=token_mask,
                                          dropout_key=context.dropout_key, document_ids=context.document_ids,
                                          document_positions=context.document_positions)
            per_depth = self.mtp(hidden, input_ids, labels, self, mtp_context, fused_loss=fused_loss)
            for depth, depth_loss in enumerate(per_depth, start=1):
                output.losses[f"mtp_{depth}"] = depth_loss
            output.losses["mtp"] = torch.stack(per_depth).mean()
            total = total + self.config.mtp_loss_coeff * output.losses["mtp"]
        output.loss = total
        return output

    @staticmethod
    def moe_loss_terms(context: SequenceContext) -> dict[str, torch.Tensor]:
        """The MoE blocks' auxiliary losses collected in ``context``, summed over blocks, before
        their coefficients (a pipeline stage without the head reports its own blocks' share)."""
        return {"moe_aux": torch.stack([m.aux_loss for m in context.moe_losses]).sum(),
                "moe_z": torch.stack([m.z_loss for m in context.moe_losses]).sum()}

    def add_moe_losses(self, total: torch.Tensor | float, terms: dict[str, torch.Tensor]) -> torch.Tensor:
        """``total`` plus each MoE term times its coefficient."""
        config = self.config
        return total + config.moe_aux_loss_coeff * terms["moe_aux"] + config.moe_z_loss_coeff * terms["moe_z"]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
