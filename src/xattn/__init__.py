"""xattn: randomized attention estimators for any Array API library.

Public names:

- :func:`softmax_attention`: exact softmax attention (the reference);
- :func:`rfa`: random feature attention (RFA / Performer FAVOR+: positive, hyperbolic,
  trigonometric maps; orthogonal samples; causal mode);
- :func:`ra`: randomized attention (unbiased, biased and deterministic forms);
- :func:`lara`: linear randomized attention (multiple-importance sampling, linear cost);
- :mod:`xattn.mrf`: linear-chain MRF log-partition functions, exact and random-feature;
- :mod:`xattn.random`: the random-number adapter (:func:`xattn.random.default_rng`).
"""

from xattn import mrf, random
from xattn.lara import lara
from xattn.ra import ra
from xattn.rfa import rfa
from xattn.softmax import softmax_attention

__all__ = ["lara", "mrf", "ra", "random", "rfa", "softmax_attention"]
__version__ = "0.1.0.dev0"
