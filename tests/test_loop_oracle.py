"""The shared oracle of the layer-wise rules' tests (``fixtures.check_rule_against_the_loops``:
one tape per example, the paper's factors in float64) catches an engine that is wrong by
1% on one example, one that ignores the row mask, and one that clips where it should
normalize; the library's engine passes it."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpnsgd.per_example import layerwise_engine
import fixtures

L = keras.layers


def _model():
  inputs = keras.Input((5,))
  model = keras.Model(inputs, L.Dense(3)(L.Dense(4, activation="tanh")(inputs)))
  rng = np.random.default_rng(0)
  model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
  return model


def _data():
  rng = np.random.default_rng(1)
  return (tf.constant(rng.normal(size=(4, 5)), tf.float32),
          tf.constant(rng.normal(size=(4, 3)), tf.float32))


def _one_example_off_by_one_percent(model, loss, x, y, transform, mask=None):
  out = layerwise_engine(model, loss, x, y, transform, mask=mask)
  extra = layerwise_engine(model, loss, x[:1], y[:1], transform)  # example 0's contribution
  return dataclasses.replace(out, summed=[s + 0.01 * e for s, e in zip(out.summed, extra.summed)])


def _mask_ignored(model, loss, x, y, transform, mask=None):
  return layerwise_engine(model, loss, x, y, transform)


def _always_clipped(model, loss, x, y, transform, mask=None):
  from tf_dpnsgd import transforms
  return layerwise_engine(model, loss, x, y, transforms.Clip(1.0), mask=mask)


def test_the_library_engine_passes():
  x, y = _data()
  fixtures.check_rule_against_the_loops(_model(), x, y, 0.1)
  fixtures.check_rule_against_the_loops(_model(), x, y, 0.1, mask=tf.constant([1, 0, 1, 1]) > 0)


@pytest.mark.parametrize("engine,mask", [
    (_one_example_off_by_one_percent, None),
    (_mask_ignored, [True, False, True, True]),
    (_always_clipped, None),
])
def test_a_wrong_engine_is_caught(engine, mask):
  x, y = _data()
  mask = None if mask is None else tf.constant(mask)
  with pytest.raises(AssertionError):
    fixtures.check_rule_against_the_loops(_model(), x, y, 0.1, engine=engine, mask=mask)
