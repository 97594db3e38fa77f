"""The estimators, one module each, with the machinery they share.

- :mod:`~xattn._estimators.softmax`, :mod:`~xattn._estimators.rfa`,
  :mod:`~xattn._estimators.ra`, :mod:`~xattn._estimators.lara` (and
  :mod:`~xattn._estimators.lara_causal`): the public functions, each reading like its
  paper's equations;
- the linear-attention machinery of RFA and LARA: :mod:`~xattn._estimators.rf_groups`
  (non-causal products by memory budget), :mod:`~xattn._estimators.chunks` and
  :mod:`~xattn._estimators.rf_scan` (the causal scan in parallel chunks),
  :mod:`~xattn._estimators.window` (exact band and sinks beside the features),
  :mod:`~xattn._estimators.decode` (one step from a state);
- LARA's parts: :mod:`~xattn._estimators.importance` (the multiple-importance weights) and
  :mod:`~xattn._estimators.segments` (1-D and 2-D segment means).

May import: :mod:`xattn._core`, :mod:`xattn.random` and :mod:`xattn.features`, and each
other downwards in the order above (an estimator imports the machinery, never the reverse).
Never a framework: the layers and the command line sit above.
"""

__all__ = ["chunks", "decode", "importance", "lara", "lara_causal", "ra", "rf_groups", "rf_scan",
           "rfa", "segments", "softmax", "window"]
