"""Fixed-size, shardable, resumable batches, tokenised lazily (classification; see causal_lm.py)."""

import torch

from galaxy.plan_shares import replica_slice


class StepBatches:
    """Global batches of `batch_size` samples, encoded lazily per step by `encode` (subclasses).

    Holds what every task shares: the epoch order, the shard of each batch this process
    encodes, and the resumable (epoch, step) position described in ClassificationBatches.
    Subclasses set `self.samples` (any list) and implement `encode(indices) -> dict`.
    """

    def __init__(self, samples, batch_size, shuffle, seed=0, shard=None):
        # shard: (index, count) for even shares, or (index, rows of every shard) for uneven ones
        index, count = shard if shard is not None else (0, 1)
        shares = None if isinstance(count, int) else tuple(count)
        count = count if shares is None else len(shares)
        if batch_size <= 0:
            raise ValueError(f"batch_size ({batch_size}) must be positive")
        if count <= 0 or not 0 <= index < count:
            raise ValueError(f"bad shard {shard!r}: need 0 <= index < count")
        if shares is None and batch_size % count:
            raise ValueError(f"shard count {count} does not divide batch_size {batch_size}")
        if shares is not None and (sum(shares) != batch_size or min(shares) < 1):
            raise ValueError(f"shard rows {list(shares)} do not split batch_size {batch_size}")
        if len(samples) < batch_size:
            raise ValueError(f"{len(samples)} examples is less than one batch of {batch_size}")
        self.samples = samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rows = replica_slice(shares, index, batch_size, count)  # this shard within a batch
        self.epoch = 0
        self.step = 0

    def __len__(self):
        return len(self.samples) // self.batch_size

    def set_epoch(self, epoch):
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        if not 0 <= state["step"] <= len(self):
            raise ValueError(f"step {state['step']} outside an epoch of {len(self)} steps")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    def order(self, epoch):
        """Example indices for an epoch, [N] long; the same on every process."""
        n = len(self.samples)
        if not self.shuffle:
            return torch.arange(n)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=generator)

    def _rows_of(self, order, step):
        """This shard's rows of global batch `step` within an epoch order, [B] long."""
        start = step * self.batch_size
        return order[start:start + self.batch_size][self.rows]

    def batch_indices(self, epoch, step):
        """Example indices this process gets at (epoch, step), [B] long."""
        return self._rows_of(self.order(epoch), step)

    def __iter__(self):
        epoch = self.epoch
        order = self.order(epoch)  # computed once per epoch, not per step
        while self.epoch == epoch and self.step < len(self):
            indices = self._rows_of(order, self.step)
            self.step += 1
            yield self.encode(indices)
        if self.epoch == epoch and self.step >= len(self):
            self.epoch, self.step = epoch + 1, 0

    def encode(self, indices):
        """Encode only the given samples -> dict of tensors."""
        raise NotImplementedError



class ClassificationBatches(StepBatches):
    """Iterate global batches of `batch_size` examples, tokenised lazily per step.

    Each step yields a dict of long tensors (B = batch_size // shard count):
      input_ids, attention_mask, token_type_ids: [B, pad_size]
      labels: [B]
    Texts are encoded with tokenizer(texts, padding="max_length", truncation=True,
    max_length=pad_size, return_tensors="pt"); tokenizers without token_type_ids
    get zeros.

    Order: shuffle=False keeps the given order; shuffle=True uses
    torch.randperm(n, generator seeded with seed + epoch), identical on every process.
    The last partial batch is DROPPED, so every step has exactly batch_size examples
    (len(self) = len(examples) // batch_size steps per epoch).

    shard=(index, count): this process only tokenises rows
    [index*B, (index+1)*B) of each global batch, B = batch_size // count;
    shard=(index, rows): the shards' rows in order (uneven), this one rows[index] of them.

    Position: (epoch, step) = the next batch to yield. Iteration starts there and
    advances step before each yield, so state_dict() taken while training on a batch
    resumes after it. Finishing an epoch moves to (epoch + 1, 0). set_epoch(e) jumps
    to (e, 0) unless e is already the current epoch (keeps a loaded mid-epoch
    position), so `for e in ...: batches.set_epoch(e); for b in batches: ...` resumes.
    """

    def __init__(self, examples, tokenizer, pad_size, batch_size, shuffle, seed=0, shard=None):
        if pad_size <= 0:
            raise ValueError(f"pad_size ({pad_size}) must be positive")
        super().__init__(examples, batch_size, shuffle, seed, shard)
        self.texts = [text for text, _ in examples]
        self.labels = torch.tensor([label for _, label in examples], dtype=torch.long)  # [N]
        self.tokenizer = tokenizer
        self.pad_size = pad_size

    def encode(self, indices):
        """Tokenise only the given examples -> dict of [B, pad_size] / [B] long tensors."""
        texts = [self.texts[i] for i in indices.tolist()]
        enc = self.tokenizer(texts, padding="max_length", truncation=True,
                             max_length=self.pad_size, return_tensors="pt")
        input_ids = enc["input_ids"].long()
        token_type_ids = enc.get("token_type_ids")
        return {
            "input_ids": input_ids,
            "attention_mask": enc["attention_mask"].long(),
            "token_type_ids": (token_type_ids.long() if token_type_ids is not None
                               else torch.zeros_like(input_ids)),
            "labels": self.labels[indices],
        }
