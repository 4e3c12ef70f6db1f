"""Keras ``Dropout`` inside the layer-wise engine's forward pass: Philox, named.

Keras' ``Dropout`` draws its mask with ``tf.nn.experimental.stateless_dropout``
and TensorFlow's default algorithm, ``"auto_select"``. Without XLA that is
Philox on CPU and GPU. Compiled by XLA on CPU it is not: measured on the
project's 2-core machine, 6.3 M uniform numbers took 6.8-8.4 s with
``"auto_select"`` and 0.17 s with ``alg="philox"`` (a dropout of a
``[32, 128, 1536]`` activation), which made a BERT DP step with dropout under
``jit_compile=True`` about 10x the plain XLA step (issue 21).

While the engine's forward pass runs (:class:`PhiloxDropout`), every layer of
exact type ``keras.layers.Dropout`` in the model draws its mask exactly as
Keras does (the layer's own ``SeedGenerator``, its ``noise_shape``, the same
``stateless_dropout`` op) but with ``rng_alg="philox"`` named. The mask is
drawn once per call and used by the forward and the one backward pass, so the
per-example contributions are exactly those of the per-example gradients with
these masks.

Values: without XLA, bit-identical to Keras' own ``Dropout`` (``"auto_select"``
resolves to Philox there; tested). Under XLA they are the compiled Philox
stream's, which differs from the non-XLA one, as XLA's draws already did.

The routing is an instance attribute ``call`` for the duration of the pass
(:class:`~tf_dpnsgd.per_example.base.CallOverrides`), and only calls from the
thread that entered the context are routed (``tf.distribute`` replica threads
each enter their own).
"""

from __future__ import annotations

import threading

import keras
import tensorflow as tf

from tf_dpnsgd.per_example.base import CallOverrides

RNG_ALG = "philox"
"""The algorithm the routed ``Dropout`` layers name (TensorFlow's CPU/GPU default)."""

_ROUTES = CallOverrides()
_ACTIVE = threading.local()


def dropout_layers(model) -> list:
  """Layers of exact type ``keras.layers.Dropout`` in ``model`` (nested ones included)."""
  return [l for l in model._flatten_layers(include_self=True, recursive=True)
          if type(l) is keras.layers.Dropout]  # pylint: disable=unidiomatic-typecheck


def _seed(layer) -> tf.Tensor:
  """The layer's next ``[2]`` seed, as Keras' TensorFlow backend casts it (int32)."""
  seed = layer.seed_generator.next()
  if seed.dtype != tf.int32:
    seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
  return seed


def philox_dropout(layer, inputs, training=False):
  """``layer(inputs, training)`` of a ``keras.layers.Dropout``, the mask drawn with Philox."""
  if not training or layer.rate <= 0:
    return inputs
  if layer.rate >= 1.0:
    return tf.zeros_like(inputs)
  noise_shape = None
  if layer.noise_shape is not None:
    shape = tf.shape(inputs)
    noise_shape = [shape[i] if n is None else n for i, n in enumerate(layer.noise_shape)]
  return tf.nn.experimental.stateless_dropout(inputs, rate=layer.rate, seed=_seed(layer),
                                              noise_shape=noise_shape, rng_alg=RNG_ALG)


def _router(layer):
  original = layer.call

  def call(inputs, training=False):
    if getattr(_ACTIVE, "depth", 0):
      return philox_dropout(layer, inputs, training)
    return original(inputs, training=training)

  return call


class PhiloxDropout:
  """Context manager: the model's ``keras.layers.Dropout`` layers draw with Philox.

  Use around one training forward pass; on exit the layers' ``call`` is
  restored, also on error.
  """

  def __init__(self, model):
    self._layers = dropout_layers(model)
    self._installed = []

  def __enter__(self):
    self._installed = _ROUTES.install(self._layers, _router)
    _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
    return self

  def __exit__(self, *exc):
    _ACTIVE.depth -= 1
    _ROUTES.uninstall(self._installed)
    return False


__all__ = ["PhiloxDropout", "RNG_ALG", "dropout_layers", "philox_dropout"]
