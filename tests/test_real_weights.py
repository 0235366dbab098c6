"""The Galaxy plan on the real pretrained all-MiniLM-L6-v2 equals HF on real sentences."""
import pydoc_data.topics
import torch

from support.parity import rel_err, worst_param_error, world_group

from galaxy.runtime.assemble import build_model
from galaxy.assets.packaged_minilm import packaged_minilm_dir
from galaxy.parallel.full_state import gather_full
from galaxy.parallel.grad_sync import GradientSync
from galaxy.plan import Plan

PAD = 48


def real_batch(model_dir):
    from transformers import AutoTokenizer
    topics = pydoc_data.topics.topics
    texts = [" ".join(topics[k].split()[:n]) for k, n in (("assert", 60), ("lambda", 12), ("for", 35), ("pass", 20))]
    enc = AutoTokenizer.from_pretrained(model_dir)(texts, padding="max_length", truncation=True,
                                                   max_length=PAD, return_tensors="pt")
    return dict(enc, labels=torch.tensor([0, 1, 2, 1]))


def galaxy_vs_hf_on_minilm():
    from transformers import BertForSequenceClassification
    model_dir = packaged_minilm_dir()
    group = world_group((7, 5), (896, 640), (27, 21))            # uneven: 12 heads, 1536 columns
    model = build_model(model_dir, Plan("TP", "TP", "SP"), group, num_labels=3, dropout=0.0)
    ref = BertForSequenceClassification.from_pretrained(model_dir, num_labels=3, hidden_dropout_prob=0.0,
                                                        attention_probs_dropout_prob=0.0)
    with torch.no_grad():   # the task head is new in both: start HF from galaxy's
        ref.classifier.weight.copy_(model.classifier.weight)
        ref.classifier.bias.copy_(model.classifier.bias)
    batch = real_batch(model_dir)
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    logits, loss = model(**batch)
    out = ref(**batch)
    loss.backward()
    out.loss.backward()
    GradientSync(model, group.pg)()
    grad = worst_param_error(gather_full(model, grads=True), ref, grads=True)
    return rel_err(logits, out.logits), rel_err(loss, out.loss), grad


def test_galaxy_plan_on_real_minilm_matches_hf(dist_pool):
    for rank, (logits, loss, (grad, where)) in enumerate(dist_pool(2).run(galaxy_vs_hf_on_minilm)):
        assert logits < 1e-5, f"rank {rank}: logits off by {logits}"
        assert loss < 1e-5, f"rank {rank}: loss off by {loss}"
        assert grad < 1e-5, f"rank {rank}: gradient of {where} off by {grad}"
