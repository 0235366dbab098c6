"""The plan search behind plan.py (docs/planning.md).

  profiles.py        device / link / cluster JSON: read, check, fit the link, compose
  harness.py         one layer's sub-blocks run alone at any share (time, saved bytes, parameters)
  model_profile.py   profile-model: parameters, activation bytes and FLOPs per sub-block and share
  encdec_bench.py    an encoder-decoder's encoder and decoder layer, run one sub-block at a time
  encdec_profile.py  profile-model of an encoder-decoder: the version-2 profile, one section per stack
  encdec_method.py   its "peft" section: the config's PEFT method measured on the two layers
  device_profile.py  profile-devices: every rank's compute and memory, the collectives between them
  cost.py            step time and peak memory per rank of any plan
  encdec_terms.py    what a rank of an encoder-decoder's plan holds and keeps: parameters, memory
  encdec_cost.py     step time of an encoder-decoder's plans, per stack, layer kind and stage
  search.py          the search: mesh x methods x micro-batches, shares and stages by local moves
  encdec_search.py   the same over an encoder-decoder's plans (XATT's method, target token shares)
  latency_cost.py    --objective latency: one request's prefill, decode steps and KV cache per rank
  encoder_latency.py --objective latency for an encoder classifier: one forward a request, no cache
  latency_search.py  the search on those cost models (dp 1), its table and --json
  latency_cli.py     search --objective latency: the request's size, the refusals, the written config
  writer.py          the chosen plan over the base config, checked by galaxy.config
  draw.py            --png: the plan, ranks x sub-blocks, and predicted time per rank
  cli.py             the three subcommands
"""
