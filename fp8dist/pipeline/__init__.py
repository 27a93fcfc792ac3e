"""The one pipeline (:func:`fp8dist.wrap_model`) and what runs with it on every rank: launch environment,
rendezvous, rank agreement, blocks, meta init, pretrained weights, optimizer, gradients, the non-finite guard."""
