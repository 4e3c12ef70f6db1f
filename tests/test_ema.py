"""An exponential moving average of the weights (``use_ema`` / ``--ema_momentum``).

The average is post-processing of the noised updates: it must not change the steps, the
noise or the epsilon, and the model must end training on it. Oracle: the weights after
every step, recorded by a callback, averaged here with the textbook recursion
(``a_1 = w_1``, ``a_t = m a_{t-1} + (1 - m) w_t``).
"""

import keras
import numpy as np
import pytest

import tf_dpnsgd
from test_launch import parse_launcher_flags
from test_one_call import LOSS, data, mlp


class RecordWeights(keras.callbacks.Callback):
  def __init__(self):
    super().__init__()
    self.after_step = []

  def on_train_batch_end(self, batch, logs=None):
    self.after_step.append([w.copy() for w in self.model.get_weights()])


def fit(use_ema, momentum=0.8):
  x, y = data()
  model = tf_dpnsgd.make_private(mlp(), target_epsilon=3.0, delta=1e-5, batch_size=10, epochs=2)
  extra = {"use_ema": True, "ema_momentum": momentum} if use_ema else {}
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.5, regularizer=0.01, momentum=0.5,
                                           **extra), loss=LOSS)
  record = RecordWeights()
  model.fit(x, y, verbose=0, callbacks=[record])
  return model, record.after_step


@pytest.mark.slow
def test_training_ends_on_the_average_of_the_weights_after_each_step():
  m = 0.8
  model, after_step = fit(use_ema=True, momentum=m)
  assert len(after_step) == model.privacy_ledger.steps == 12
  average = [w.copy() for w in after_step[0]]
  for weights in after_step[1:]:
    average = [m * a + (1 - m) * w for a, w in zip(average, weights)]
  final = model.get_weights()
  for got, want, last in zip(final, average, after_step[-1]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, last)  # it is the average, not the last step's weights
  plain, _ = fit(use_ema=False)
  assert model.privacy_report().epsilon == pytest.approx(plain.privacy_report().epsilon)
  assert model.privacy_ledger.steps == plain.privacy_ledger.steps


def test_launcher_flag_builds_the_average_and_rejects_bad_values():
  from absl import flags
  from tf_dpnsgd.launch import common
  cfg = parse_launcher_flags("--ema_momentum=0.99")
  assert cfg.hyperparameters()["ema_momentum"] == 0.99  # recorded (and checked on resume)
  optimizer = common.make_optimizer(cfg, noise_multiplier=1.0, total_steps=10)
  inner = optimizer.inner_optimizer  # the wrapped Keras optimizer keeps the average
  assert inner.use_ema and inner.ema_momentum == pytest.approx(0.99)
  plain = common.make_optimizer(parse_launcher_flags(), noise_multiplier=1.0, total_steps=10)
  assert not plain.inner_optimizer.use_ema
  for bad in ("0", "1", "-0.5", "1.5"):
    with pytest.raises(flags.IllegalFlagValueError, match="--ema_momentum must be in"):
      parse_launcher_flags(f"--ema_momentum={bad}")
