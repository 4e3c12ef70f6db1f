"""The DP step in one place: read :mod:`tf_dpnsgd.step.algorithm` first.

:mod:`~tf_dpnsgd.step.algorithm` is one step as Algorithm 1 of the paper reads
(check -> contributions -> privatize -> apply -> record);
:mod:`~tf_dpnsgd.step.contributions` is its phase 1 (engines over physical
chunks). The Keras glue around it (compile, fit, metrics, saving) is
:mod:`tf_dpnsgd.training`; the host-side checks are :mod:`tf_dpnsgd.guard`.
"""

from tf_dpnsgd.step.algorithm import dp_step, public_gradients
from tf_dpnsgd.step.contributions import chunk_rows, contributions, gather_rows

__all__ = ["chunk_rows", "contributions", "dp_step", "gather_rows", "public_gradients"]
