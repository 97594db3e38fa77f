"""The attention layers' framework-independent core and its framework adapters.

- :mod:`~xattn._integrations.layers`: what every layer shares (option checks, the
  estimator call, feature redraws, generation states);
- :mod:`~xattn._integrations.torch_layer`, :mod:`~xattn._integrations.flax_layer`,
  :mod:`~xattn._integrations.flax_attention_fn`, :mod:`~xattn._integrations.keras_layer`:
  the per-framework pieces behind :mod:`xattn.torch`, :mod:`xattn.flax` and
  :mod:`xattn.keras`;
- :mod:`~xattn._integrations.hf_cache`, :mod:`~xattn._integrations.hf_masks`: the
  Hugging Face cache and mask handling behind :mod:`xattn.transformers`.

May import: the estimators (:mod:`xattn._estimators`), :mod:`xattn._core`,
:mod:`xattn.random` and :mod:`xattn.features`; each framework only inside the module named
for it, and only when that module is imported. Never the public framework modules
(``xattn.torch``, ``xattn.flax``, ...), which sit above and import from here.
"""

__all__ = ["flax_attention_fn", "flax_layer", "hf_cache", "hf_masks", "keras_layer", "layers",
           "torch_layer"]
