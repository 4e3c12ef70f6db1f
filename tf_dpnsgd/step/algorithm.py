"""One DP step, as Algorithm 1 of Yang, Zhang, Chen, Liu (2022) reads it.

==========  ==========================================================================
phase       what runs, and where
==========  ==========================================================================
0 check     the batch continues the privacy ledger (no replay, skip, other sampler,
            unverifiable source), the forward pass is verified: on the HOST, before
            this function runs (:mod:`tf_dpnsgd.guard`); nothing here asserts in-graph
1 contribute ``sum_i h_i g_i``: per-example gradients normalized
            (``h_i = 1/(r + ||g_i||)``, DP-NSGD) or clipped (``min(1, c/||g_i||)``,
            DP-SGD) by the transform, which carries its sensitivity ``S``
            (:mod:`tf_dpnsgd.step.contributions`, :mod:`tf_dpnsgd.per_example`); at the
            user level a unit is one user's rows, its mean-loss gradient bounded once
            (:mod:`tf_dpnsgd.per_example.units`, :mod:`tf_dpnsgd.users`)
2 privatize ``(sum + N(0, (sigma S)^2 I)) / D``: ONE draw keyed by the ledger's
            ``[lineage, generation, step]``, ``S`` taken only from the transform,
            ``D`` the public denominator (``B``, or ``qN`` under Poisson sampling); one
            all-reduce of the sum under a strategy
            (:func:`tf_dpnsgd.noise.privatize`, through the optimizer)
3 apply     the wrapped Keras optimizer's update on the noised mean, plus the
            gradients of data-independent weight regularizers (after the noise)
4 record    the ledger counts the step, its batch kind, sampler and noise (and
            adaptive clipping's count noise and clip)
            (:meth:`tf_dpnsgd.ledger.PrivacyLedger.record`)
==========  ==========================================================================

Formal guarantee: given contributions of norm at most ``S`` (the transform's
guarantee, tested against single-example loops), phase 2 is the Gaussian
mechanism with noise multiplier ``sigma`` that :mod:`tf_dpnsgd.accounting`
accounts, and phase 4 records exactly the steps that ran it.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import vectorized as _vectorized
from tf_dpnsgd.step import contributions as contributions_lib


def public_gradients(variables):
  """``(grads or None, loss)``: gradients of data-independent weight regularizers.

  They depend on the weights only, never on the data, so they are added after
  the noise at no privacy cost.
  """
  regularized = [v for v in variables if getattr(v, "regularizer", None) is not None]
  if not regularized:
    return None, 0.0
  with tf.GradientTape() as tape:
    reg = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for v in regularized])
  return tape.gradient(reg, variables), reg


def dp_step(model, x, y, mask, denominator, tags, num_microbatches):
  """Runs phases 1-4 on one (checked) batch of ``model``; returns ``(out, reg_loss)``.

  Args:
    model: the DP model (its engine, loss, optimizer and privacy ledger).
    x, y: the batch.
    mask: ``[B]`` bool (False: a padding row, contributing exactly 0) or None.
    denominator: the public (expected) number of units of the GLOBAL batch
      (Poisson: ``qN`` from the batch), or None: this replica's units (then
      summed over replicas by the optimizer).
    tags: the sampler's tags (None for an untagged batch), for the ledger.
    num_microbatches: units are microbatch means (tensorflow-privacy's option).

  Returns:
    The engine's output (losses, norms, factors, predictions: for logging
    only, not privatized) and the regularizer loss.
  """
  optimizer = model.optimizer
  local = denominator is None
  if local:
    denominator = tf.cast(num_microbatches or _vectorized.batch_size_of(x), tf.float32)
  # Adaptive clipping's own check (the count noise fits the budget) also ran on the host;
  # here it only orders the step after it (a NaN noise, were it ever bypassed).
  with tf.control_dependencies(optimizer.step_checks(denominator, local)):
    ledger = model.privacy_ledger
    x = tf.nest.map_structure(tf.identity, x)
    stream = tf.identity(ledger.noise_stream())  # [lineage, generation, step]
    # The transform of THIS step, read once: under adaptive clipping Clip(C_t) clips,
    # counts the unclipped units and scales this step's noise; C_{t+1} is written after.
    transform = optimizer.transform
    # 1. contribute
    out = contributions_lib.contributions(model, x, y, mask, num_microbatches, transform)
    count = None
    if optimizer.adaptive_clip is not None:
      count = transforms.centered_unclipped_count(out.norms, transform.l2_norm_clip, mask)
    # 2. privatize and 3. apply (the noise, then the wrapped optimizer's update)
    variables = model.trainable_variables
    public, reg_loss = public_gradients(variables)
    released = optimizer.apply_private_gradients(
        out.summed, denominator, variables, public, local_denominator=local, step=stream,
        transform=transform, centered_unclipped_count=count)
    # 4. record: the effective noise multiplier (adaptive clipping: of the gradient and
    # count queries together, tf_dpnsgd.accounting.adaptive) is what the plan accounts;
    # adaptive clipping's count noise and clip go to the ledger too (the report reads them).
    ledger.record(tags, optimizer.noise_multiplier, user_seeded=optimizer.seed is not None,
                  adaptive=released, bands=getattr(optimizer, "bands", 1),
                  trainable_variables=variables,
                  unit_rows=getattr(model, "_dp_rows_per_user", None) or 0)
  return out, reg_loss


__all__ = ["dp_step", "public_gradients"]
