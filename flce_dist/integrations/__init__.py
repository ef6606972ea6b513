"""Framework integrations of flce_dist.

- :mod:`flce_dist.integrations.transformers`: ``apply(model, group=None, **loss_options)`` makes a
  Hugging Face ``*ForCausalLM`` compute its ``labels`` loss with the fused, vocab-parallel loss
  (no logits are materialised).
- :mod:`flce_dist.integrations.deepspeed`: the ``"flce_dist"`` section of a DeepSpeed JSON config
  and ``initialize(...)``, a drop-in for ``deepspeed.initialize`` that makes flce_dist the fused
  loss behind DeepSpeed AutoTP's vocabulary-parallel lm_head.

The submodules import their framework lazily, so importing this package needs neither.
"""
