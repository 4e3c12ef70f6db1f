"""Correlated noise across steps: banded matrix factorization (Choquette-Choo et al. 2023)
and buffered linear Toeplitz (BLT) noise (Dvijotham et al. 2024; no accounting yet).

* :mod:`~tf_dpnsgd.correlated.strategy`: the banded Toeplitz strategy (offline, NumPy/SciPy);
* :mod:`~tf_dpnsgd.correlated.blt`: BLT strategies and their min-separation sensitivity;
* :mod:`~tf_dpnsgd.correlated.noise`: the noise ``C^{-1} z`` in the train step (TF);
* :mod:`~tf_dpnsgd.correlated.sampling`: cyclic Poisson sampling (b-min-separation) and
  the checks that bind the plan, the optimizer and the ledger together.

See docs/correlated_noise.md.
"""
