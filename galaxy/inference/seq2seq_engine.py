"""KV-cached generation for an encoder-decoder (BART, T5) under any Galaxy plan.

One batch of rows at a time, every rank of the group in lockstep, the same sampler and [b, 2]
broadcast as the causal LMs' Engine (galaxy.inference.engine):

  first pass  the prompts, right-padded to one length S (the encoder's token shares' pad_size
              where the plan splits tokens, XATT SP included; BART's learned positions count
              from the left, as Hugging Face's tokenizers pad them), run once through the encoder
              under the plan; the memory, gathered whole as in training, feeds every decoder
              layer's XATT, which projects its K/V once into its cache (its heads under XATT TP,
              its own source tokens under SP). The decoder runs the start token
              (decoder_start_token_id) of every row at position 0 in the decode layouts
              (galaxy.parallel.decode_layout).
  decode      the chosen token of each row at the next position through the decoder alone: its
              ATT appends to its cache (per rank as the decoder-only ATT, without a prefill),
              XATT reads its cache (under SP: its source tokens, the ranks' partial attentions
              merged by log-sum-exp), no encoder and no memory.

The caches (galaxy.models.seq2seq.cached_prefills): per decoder layer, ATT [b, kv_heads_r,
max_new_tokens, d] (SP: max_new_tokens / N slots, round-robin) and XATT [b, heads_r, S, d] (SP:
all heads of the rank's S_r source tokens, [b, heads, S_r, d]), preallocated when the batch starts.

As a pipeline (Engine._through_stage, as the causal LMs' passes): the first pass carries both
stacks' carries from stage to stage as training does (galaxy.pipeline.carry: inside the encoder
the source's stream in the plan's CON layout and the target's start token [b, 1, h] in R; from
the encoder's end on, the encoder's output and the target's), so the encoder's stages run once
and every stage holding decoder layers gathers the memory once for its XATTs' caches. A decode
step carries the decoder's stream alone ([b, 1, h] per tensor, decoding_slots): the first stage
embeds the token, stages without decoder layers pass it on, and the last stage's sampler picks
the tokens, broadcast over the pipeline as Engine's are.
"""
from __future__ import annotations

import torch

from galaxy.inference.engine import Engine
from galaxy.inference.requests import Completion, Progress, Request
from galaxy.layers.kv_cache import CacheStep, open_caches
from galaxy.parallel.decode_layout import decode_layouts
from galaxy.pipeline.stage import carry_dtype, carry_shapes, decoding_slots, stage_slots
from galaxy.plan import Layout


class Seq2SeqEngine(Engine):
    """Engine's batches, sampler, stops and broadcast; the encoder once, then the decoder alone."""

    @torch.no_grad()
    def generate(self, requests: list[Request], on_token=None) -> list[Completion]:
        """Every row's completion (the tokens after the start token); on_token as Engine's."""
        m = self.model
        progress = self._progress(requests)
        ids, mask = self._right_padded(progress.rows)
        caches = open_caches(m, *ids.shape, max(r.max_new_tokens for r in requests), carry_dtype(m), self.device)
        self.cache_bytes = caches.nbytes
        try:
            with decode_layouts(m, self.token_sum, self.link):
                source = self._first_pass(ids, mask, progress, on_token, caches)
                position = 1
                while not progress.done:
                    # beams: the encoder's padding and output follow the rows (a prompt's beams hold the same)
                    mask = self._reordered(progress, mask)
                    source = tuple(t if t is None else self._reordered(progress, t) for t in source)
                    self._decode_step(source, mask, position, progress, on_token, caches)
                    position += 1
        finally:
            caches.close()
        return self._completions(progress, on_token)

    def _first_pass(self, ids, mask, progress: Progress, on_token, caches) -> tuple:
        """The encoder on ids, mask [b, S] under the plan, and the start token through the decoder
        (each XATT filling its cache); returns this stage's source carry (kept for the head's
        carry; None where a tensor did not reach this stage)."""
        m = self.model
        rows, length = ids.shape
        start = torch.full((rows, 1), m.config.decoder_start_token_id, dtype=torch.long, device=self.device)
        context = m.decoding_context(mask, 0, CacheStep(True, self._every_row(rows), 0, self.link))
        received, sent = stage_slots(m)
        shapes = carry_shapes(m, self.plan.con_layout, rows, length, 1, self._stage_start(),
                              target_layout=Layout.R)
        carry = self._through_stage(lambda: m.embed(ids, decoder_input_ids=start), received, sent, shapes, context,
                                    m.layers)
        self._advance(progress, self._logits(carry), on_token, caches)
        return carry[:m.carry_size]

    def _decode_step(self, source: tuple, mask, position: int, progress: Progress, on_token, caches) -> None:
        """Each row's last token at `position` through the decoder layers alone; the SP ATT's
        owner of the step is position mod N (round-robin)."""
        m = self.model
        tokens = torch.tensor(progress.last_tokens(), device=self.device)[:, None]               # [b, 1]
        step = CacheStep(True, self._every_row(len(tokens)), position % self.group.size, self.link)
        decoder = [layer for layer in m.layers if layer.sequence == "target"]
        received, sent = (decoding_slots(slots) for slots in stage_slots(m))
        shapes = carry_shapes(m, Layout.R, len(tokens), 1, 1, slots=received)
        carry = self._through_stage(lambda: (*source, *m.embed_target(tokens, position)), received, sent, shapes,
                                    m.decoding_context(mask, position, step), decoder)
        self._advance(progress, self._logits(carry), on_token, caches)

    def _stage_start(self) -> int:
        """The boundary this stage receives at: its first layer's index (0 without a pipeline)."""
        stage = self.model.attached.stage
        return 0 if stage is None else stage.layers.start

    def _every_row(self, rows: int):
        return torch.ones(rows, 1, dtype=torch.bool, device=self.device)      # [b, 1]: every new token is real

    def _right_padded(self, requests):
        """ids, mask [b, S]: prompts from the left, padding after (the encoder's mask hides it)."""
        length = self.prefill_length(max(len(r.ids) for r in requests))
        ids = torch.full((len(requests), length), self.pad, dtype=torch.long)
        mask = torch.zeros(len(requests), length, dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, :len(r.ids)] = torch.tensor(r.ids)
            mask[i, :len(r.ids)] = 1
        return ids.to(self.device), mask.to(self.device)

    def _logits(self, carry):
        """On the sampler, the decoder's token's logits [b, vocab] (fp32); None elsewhere."""
        if not self.is_sampler:
            return None
        n = self.model.carry_size
        logits, _ = self.model.head((*carry[:n], *(t[:, -1:] for t in carry[n:2 * n])))    # [b, 1, vocab]
        return logits[:, -1].float()
