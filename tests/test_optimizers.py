import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd

ALL = [
    (tf_dpnsgd.DPNSGD, dict(learning_rate=0.1, regularizer=0.01, noise_multiplier=1.2, seed=0)),
    (tf_dpnsgd.DPSGD, dict(learning_rate=0.1, l2_norm_clip=1.5, noise_multiplier=1.2, seed=0,
                           momentum=0.9, num_microbatches=4)),
    (tf_dpnsgd.DPAdam, dict(learning_rate=1e-3, l2_norm_clip=1.0, noise_multiplier=0.8, seed=1)),
    (tf_dpnsgd.DPNAdam, dict(learning_rate=1e-3, regularizer=0.1, noise_multiplier=0.8, seed=None)),
]


@pytest.mark.parametrize("cls,kwargs", ALL)
def test_config_round_trip(cls, kwargs):
  opt = cls(**kwargs)
  config = opt.get_config()
  for k, v in kwargs.items():
    assert config[k] == pytest.approx(v) if isinstance(v, float) else config[k] == v
  clone = cls.from_config(config)
  assert clone.get_config() == config
  again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
  assert type(again) is cls and again.get_config() == config


@pytest.mark.parametrize("cls,kwargs,arg", [
    (tf_dpnsgd.DPNSGD, dict(regularizer=0.0, noise_multiplier=1.0), "regularizer"),
    (tf_dpnsgd.DPNSGD, dict(regularizer=-1.0, noise_multiplier=1.0), "regularizer"),
    (tf_dpnsgd.DPNSGD, dict(regularizer=0.1, noise_multiplier=-1.0), "noise_multiplier"),
    (tf_dpnsgd.DPSGD, dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
    (tf_dpnsgd.DPSGD, dict(l2_norm_clip=-2.0, noise_multiplier=1.0), "l2_norm_clip"),
    (tf_dpnsgd.DPAdam, dict(l2_norm_clip=1.0, noise_multiplier=-0.5), "noise_multiplier"),
    (tf_dpnsgd.DPNAdam, dict(regularizer=0.0, noise_multiplier=1.0), "regularizer"),
    (tf_dpnsgd.DPSGD, dict(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=0),
     "num_microbatches"),
    (tf_dpnsgd.DPSGD, dict(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=2.5),
     "num_microbatches"),
    (tf_dpnsgd.DPNSGD, dict(regularizer=0.1, noise_multiplier=1.0, seed=-3), "seed"),
    (tf_dpnsgd.DPNSGD, dict(regularizer=0.1, noise_multiplier=1.0, gradient_accumulation_steps=2),
     "gradient_accumulation_steps"),
])
def test_invalid_hyperparameters_raise_at_construction(cls, kwargs, arg):
  with pytest.raises(ValueError, match=arg):
    cls(**kwargs)


def test_missing_privacy_arguments_raise():
  with pytest.raises(ValueError, match="regularizer"):
    tf_dpnsgd.DPNSGD(learning_rate=0.1)
  with pytest.raises(ValueError, match="l2_norm_clip"):
    tf_dpnsgd.DPSGD(learning_rate=0.1, noise_multiplier=1.0)


def test_raw_gradients_are_refused():
  opt = tf_dpnsgd.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0)
  v = keras.Variable(np.zeros(3, np.float32))
  with pytest.raises(RuntimeError, match="make_private"):
    opt.apply_gradients([(tf.ones(3), v)])


def test_plain_keras_model_with_dp_optimizer_fails_loudly():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(optimizer=tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0), loss="mse")
  with pytest.raises(RuntimeError, match="DPModel"):
    model.fit(np.zeros((4, 3)), np.zeros((4, 1)), verbose=0)


def test_one_step_against_hand_computation():
  """DPNSGD with noise 0: w <- w - lr * (sum_i g_i/(r+||g_i||)) / B."""
  opt = tf_dpnsgd.DPNSGD(learning_rate=0.5, regularizer=1.0, noise_multiplier=0.0)
  v = keras.Variable(np.array([1.0, 1.0], np.float32))
  g = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)  # norms 5, 0
  summed = (g[0] / 6.0 + g[1] / 1.0)
  opt.apply_private_gradients([tf.constant(summed)], 2.0, [v])
  np.testing.assert_allclose(v.numpy(), [1 - 0.5 * 0.5 / 2 * 1.0, 1 - 0.5 * (4 / 6) / 2], rtol=1e-6)
