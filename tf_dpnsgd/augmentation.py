"""Per-example augmentation inside the sampler, with augmentation multiplicity.

DP-SGD and DP-NSGD bound what one example can change in the summed update:
its contribution is clipped (or normalized) once. Augmentation keeps that bound
only if it is a function of ONE example: a transformation of whole batches
(MixUp across rows, a batch followed by an augmented copy of itself) lets one
example reach several rows, and the sum then moves by a multiple of the
sensitivity the noise was calibrated to. Here the augmentation is given to
the sampler (:meth:`tf_dpnsgd.plan.PrivacyPlan.dataset`, ``augment=fn``) and
runs row by row, before the rows are batched and tagged: ``fn`` never sees
another row and cannot change how many rows there are.

``fn(x_i, y_i, seed) -> x_i'`` takes one example's inputs and label (one row
of each leaf) and a stateless seed (int64 ``[2]``, for ``tf.random.stateless_*``
and ``tf.image.stateless_*``) and returns the example's new inputs (any
structure, dtype or shape, the same for every example; the label is kept).
The seed is a pure function of ``(sampler seed, step, example index, view)``:
the stream is reproducible for a fixed sampler seed, the same for any number
of replicas, and fresh at every step.

Augmentation multiplicity (De et al. 2022, Sec. 3.1; jax-privacy's
``augmult``): with ``multiplicity=K > 1`` each example's ``K`` views (``fn``
with ``K`` different seeds) are stacked on a new axis 1 (``x`` leaves become
``[B, K, ...]``). The model then takes the ``K`` views of an example and its
per-example loss is the MEAN over the views (e.g. ``views.multi_view(head, K)``
with ``views.view_mean_loss()``, :mod:`tf_dpnsgd.models.views`), so the
gradient that is clipped or normalized once is the mean of the views'
gradients: the sensitivity is unchanged.

Formal guarantee (with the guard's row checks, :mod:`tf_dpnsgd.rows`): every
row the step trains on is ``fn`` (or its ``K`` views) of exactly one example,
and no example fills two real rows. Not checked: ``fn`` must depend only on
its arguments and public constants (a function that reads other training
examples, e.g. from a captured array, would mix examples again).

==============================  ===============================================
case                            behaviour
==============================  ===============================================
Poisson padding rows            augmented like the others (example 0), then
                                masked: they contribute exactly zero
per-replica pipelines           each replica's pipeline augments its own rows,
                                with the same seeds as one global pipeline
``multiplicity > 1``, no ``fn``  ``ValueError`` (K identical views)
``fn`` not callable             ``TypeError``
==============================  ===============================================
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Augmentation:
  """A per-example augmentation ``fn(x_i, y_i, seed) -> x_i'`` and its multiplicity ``K``."""

  fn: Callable
  multiplicity: int = 1

  def __post_init__(self):
    if not callable(self.fn):
      raise TypeError(f"`augment` must be a function fn(x_i, y_i, seed) -> x_i' of ONE "
                      f"example; got {self.fn!r}.")
    if isinstance(self.multiplicity, bool) or not isinstance(self.multiplicity, int) \
        or self.multiplicity < 1:
      raise ValueError(f"`multiplicity` must be an int >= 1; got {self.multiplicity!r}.")

  def views(self, x_i, y_i, key, step, example):
    """``fn`` of one example (``K = 1``), or its ``K`` views stacked on a new axis 0."""
    outs = [self.fn(x_i, y_i, view_seed(key, step, example, v))
            for v in range(self.multiplicity)]
    if self.multiplicity == 1:
      return outs[0]
    return tf.nest.map_structure(lambda *v: tf.stack(v), *outs)


def make(augment, multiplicity: int = 1):
  """The :class:`Augmentation` of ``augment`` (None: none, then ``multiplicity`` must be 1)."""
  if augment is None:
    if multiplicity != 1:
      raise ValueError(f"multiplicity={multiplicity!r} needs `augment`: K views of an example "
                       "are K augmentations of it (identical views only cost time).")
    return None
  return Augmentation(augment, multiplicity)


def augmentation_key(sampler_seed: int) -> int:
  """A non-negative int63 keying the augmentation seeds, derived from the sampler's seed
  (domain-separated: it reveals nothing practical about the seed, and is no secret)."""
  digest = hashlib.sha256(b"tf_dpnsgd.augment|" + str(int(sampler_seed)).encode()).digest()
  return int.from_bytes(digest[:8], "little") >> 1


def view_seed(key, step, example, view) -> tf.Tensor:
  """The stateless seed (int64 ``[2]``) of view ``view`` of example ``example`` at ``step``."""
  seed = tf.stack([tf.constant(key, tf.int64), tf.cast(step, tf.int64)])
  seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(example, tf.int64))
  return tf.random.experimental.stateless_fold_in(seed, tf.constant(view, tf.int64))


def per_example_batches(steps: tf.data.Dataset, x, y, rows: int, augmentation: Augmentation,
                        key: int) -> tf.data.Dataset:
  """``(step, idx, mask)`` elements -> ``(step, idx, mask, xb, yb)``, each row augmented alone.

  Every row is gathered and augmented in its own ``tf.data`` element, then
  exactly ``rows`` of them are batched back: a row's augmentation cannot see
  another row, and each step keeps its rows.
  """
  ragged = any(isinstance(t, tf.RaggedTensor) for t in tf.nest.flatten((x, y)))

  def spread(step, idx, mask):
    return tf.fill([rows], step), idx, mask

  def one(step, i, m):
    xi = tf.nest.map_structure(lambda t: tf.gather(t, i), x)
    yi = tf.nest.map_structure(lambda t: tf.gather(t, i), y)
    return step, i, m, augmentation.views(xi, yi, key, step, i), yi

  per_row = steps.map(spread).unbatch().map(one, num_parallel_calls=tf.data.AUTOTUNE,
                                            deterministic=True)
  batched = (per_row.ragged_batch(rows, drop_remainder=True) if ragged
             else per_row.batch(rows, drop_remainder=True))
  return batched.map(lambda s, i, m, xb, yb: (s[0], i, m, xb, yb))


__all__ = ["Augmentation", "augmentation_key", "make", "per_example_batches", "view_seed"]
