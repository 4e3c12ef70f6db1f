"""Text batches at their real length: physical chunks cut to their longest row (issue 32, part 2).

The oracle is the same chunked DP step without cutting (every chunk at the
batch's padded length), which ``tests/test_layerwise.py`` checks against the
per-example loop; with a model that masks its padding, the summed
contributions, norms, factors, losses and predictions must agree to float
tolerance, in the batch's own order.
"""

from __future__ import annotations

import importlib
import textwrap
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import fixtures
import tf_dpnsgd
from tf_dpnsgd import padding_probe
from tf_dpnsgd import transforms
from tf_dpnsgd.padding_probe import PaddingDependenceError

# The module (tf_dpnsgd.step re-exports its function `contributions` under the same name).
contributions_lib = importlib.import_module("tf_dpnsgd.step.contributions")

LENGTHS = (3, 10, 5, 2, 7, 4, 9)  # real tokens per row, padded to 12
SEQ = 12
VOCAB = 40


def _tiny_bert_classifier():
  keras_hub = pytest.importorskip("keras_hub")
  backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                           hidden_dim=8, intermediate_dim=16,
                                           max_sequence_length=SEQ, dropout=0.0)
  return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                             preprocessor=None, dropout=0.0)


def _padded_batch(lengths=LENGTHS):
  rng = np.random.default_rng(0)
  mask = np.arange(SEQ)[None, :] < np.asarray(lengths)[:, None]
  ids = np.where(mask, rng.integers(5, VOCAB, (len(lengths), SEQ)), 0)
  segments = np.where(mask, rng.integers(0, 2, (len(lengths), SEQ)), 0)
  x = {"token_ids": tf.constant(ids, tf.int32), "segment_ids": tf.constant(segments, tf.int32),
       "padding_mask": tf.constant(mask.astype("int32"))}
  return x, tf.constant(np.arange(len(lengths)) % 2, tf.int32)


def _private(physical):
  keras.utils.set_random_seed(2)
  model = tf_dpnsgd.make_private(_tiny_bert_classifier(), per_example="layerwise",
                                 physical_batch_size=physical,
                                 trust_untagged_batches=True)  # hand-made batches
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                           noise_multiplier=0.0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def test_sequence_lengths_and_trim():
  x, _ = _padded_batch()
  np.testing.assert_array_equal(contributions_lib.sequence_lengths(x["padding_mask"]), LENGTHS)
  cut = contributions_lib.trim_to_longest({k: v[:1] for k, v in x.items()}, "padding_mask")
  assert all(t.shape == (1, 3) for t in cut.values())
  holes = {"padding_mask": tf.constant([[0, 1, 0, 1, 0, 0]]), "labels": tf.constant([[1]])}
  cut = contributions_lib.trim_to_longest(holes, "padding_mask")  # keeps up to the last real one
  assert cut["padding_mask"].shape == (1, 4) and cut["labels"].shape == (1, 1)
  empty = contributions_lib.trim_to_longest({"padding_mask": tf.zeros([2, 5], tf.int32)},
                                            "padding_mask")
  assert empty["padding_mask"].shape == (2, 1)
  with pytest.raises(ValueError, match="dict inputs"):
    contributions_lib.check_length_key(tf.zeros([2, 3]), "padding_mask")


@pytest.mark.slow
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_bucketed_chunks_give_the_same_contributions_on_a_tiny_bert(graph):
  model = _private(physical=3)
  x, y = _padded_batch()
  mask = tf.constant([True, True, True, False, True, True, True])  # a Poisson padding row
  transform = transforms.Normalize(0.01)
  seen = []

  def engine(*args, **kwargs):
    seen.append(args[2]["token_ids"].shape[1])
    return model._dp_engine(*args, **kwargs)

  def run(length_key):
    out = contributions_lib.chunked_contributions(model, engine, transform, x, y, mask, 3,
                                                  length_key=length_key)
    return {k: getattr(out, k) for k in ("summed", "norms", "factors", "losses", "y_pred")}

  if graph:
    run = tf.function(run)
  plain = types.SimpleNamespace(**run(None))
  bucketed = types.SimpleNamespace(**run("padding_mask"))
  if not graph:  # longest first, chunks of 3: lengths (10, 9, 7), (5, 4, 3), (2, 2, 2)
    assert seen[-3:] == [10, 5, 2] and seen[:3] == [SEQ] * 3
  for a, b, v in zip(bucketed.summed, plain.summed, model.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                               atol=1e-6 * (1 + np.abs(b.numpy()).max()), err_msg=v.path)
  for name in ("norms", "factors", "losses"):
    np.testing.assert_allclose(getattr(bucketed, name).numpy(), getattr(plain, name).numpy(),
                               rtol=1e-5, err_msg=name)
  np.testing.assert_allclose(bucketed.y_pred.numpy(), plain.y_pred.numpy(), rtol=1e-5,
                             atol=1e-6)
  assert bucketed.factors.numpy()[3] == 0.0
  unchunked = model._dp_engine(model, model._dp_loss_fn, x, y, transform, mask=mask)
  for a, b in zip(bucketed.summed, unchunked.summed):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                               atol=1e-6 * (1 + np.abs(b.numpy()).max()))


@pytest.mark.slow
def test_make_private_length_key_trains_exactly_as_without_it():
  """The user-facing option: ``make_private(..., length_key="padding_mask")``; one DP step
  (noise 0) gives the same weights as the uncut chunked step, and the option survives a
  ``.keras`` config round trip."""
  x, y = _padded_batch()
  weights = []
  for key in (None, "padding_mask"):
    keras.utils.set_random_seed(2)
    model = tf_dpnsgd.make_private(_tiny_bert_classifier(), per_example="layerwise",
                                   physical_batch_size=3, trust_untagged_batches=True,
                                   length_key=key)
    model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                             noise_multiplier=0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    model.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0)
    weights.append([w.copy() for w in model.get_weights()])
    assert any(np.abs(a - b).max() > 0 for a, b in zip(weights[-1], before))  # a step ran
    assert model.get_config()["length_key"] == key
  for a, b in zip(*weights):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_length_key_needs_physical_chunks():
  with pytest.raises(ValueError, match="physical_batch_size"):
    tf_dpnsgd.make_private(_tiny_bert_classifier(), length_key="padding_mask")


# --- models whose rows depend on their padding are refused (issue 46, scenario 3) ------------
XENT = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLIP = 1.0  # DP-SGD's c: the replace-one bound on the summed contributions is 2c


def _pooled_embeddings(mask_zero):
  """Embedding -> GlobalAveragePooling1D -> Dense on keras-hub-style dicts of any length.

  ``mask_zero=False``: the mean runs over the padding too (``padding_mask`` is an input the
  model never reads), so a row's output depends on how much padding follows it.
  ``mask_zero=True``: Keras' mask makes the pooling skip the padding (id 0).
  """
  keras.utils.set_random_seed(0)
  ids = keras.Input((None,), dtype="int32", name="token_ids")
  padding = keras.Input((None,), dtype="int32", name="padding_mask")
  h = keras.layers.Embedding(VOCAB, 4, mask_zero=mask_zero)(ids)
  h = keras.layers.GlobalAveragePooling1D()(h)
  return keras.Model({"token_ids": ids, "padding_mask": padding}, keras.layers.Dense(2)(h))


def _token_batch(lengths, seed=0):
  """Right-padded ids in [1, VOCAB) (0 is the padding id), all labels 0."""
  rng = np.random.default_rng(seed)
  mask = np.arange(SEQ)[None, :] < np.asarray(lengths)[:, None]
  ids = np.where(mask, rng.integers(1, VOCAB, (len(lengths), SEQ)), 0)
  return ({"token_ids": ids.astype("int32"), "padding_mask": mask.astype("int32")},
          np.zeros(len(lengths), "int32"))


def _private_sgd(model, physical=8, length_key="padding_mask", **compile_kw):
  dp = tf_dpnsgd.make_private(model, physical_batch_size=physical, length_key=length_key,
                              trust_untagged_batches=True)  # hand-made batches
  dp.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=CLIP,
                                       noise_multiplier=0.0), loss=XENT, **compile_kw)
  return dp


def _state(model):
  return ([w.copy() for w in model.get_weights()],
          int(model.optimizer.iterations.numpy()), model.privacy_ledger.steps)


def _assert_unchanged(before, model):
  weights, iterations, steps = _state(model)
  assert (iterations, steps) == before[1:]  # no step ran, none was counted
  for a, b in zip(weights, before[0]):
    np.testing.assert_array_equal(a, b)


# The oracle: DP-SGD's sum of clipped per-example gradients, one example at a time
# (tf.GradientTape on a batch of one), each example at the length its physical chunk is cut
# to. Chunks as the step forms them: rows by length, longest first, `size` per chunk, each
# cut to its longest row (re-derived here with numpy).
def _chunk_lengths(lengths, size):
  order = np.argsort(-np.asarray(lengths), kind="stable")
  cut = np.empty(len(lengths), int)
  for start in range(0, len(order), size):
    chunk = order[start:start + size]
    cut[chunk] = max(int(np.max(np.asarray(lengths)[chunk])), 1)
  return cut


def _clipped_sum(model, x, y, cut_lengths):
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
  total = 0.0
  for i, n in enumerate(cut_lengths):
    xi = {k: tf.constant(v[i:i + 1, :n]) for k, v in x.items()}
    with tf.GradientTape() as tape:
      value = loss(y[i:i + 1], model(xi, training=True))
    g = np.concatenate([np.ravel(tf.convert_to_tensor(t))
                        for t in tape.gradient(value, model.trainable_variables)])
    g = g.astype(np.float64)
    total = total + g * min(1.0, CLIP / np.linalg.norm(g))
  return total


def _neighbours():
  """Batches D and D' of 16 that differ in example 0 only: a row of 12 tokens in D, of 2 in
  D'. With chunks of 8, D's first chunk (the long row and 7 rows of 2) runs at length 12,
  D''s at length 2: 7 other examples' gradients change with example 0."""
  x, y = _token_batch([SEQ] + [2] * 15)
  x2 = {k: v.copy() for k, v in x.items()}
  x2["padding_mask"][0] = np.arange(SEQ) < 2
  x2["token_ids"][0] = np.where(x2["padding_mask"][0] == 1, x["token_ids"][0], 0)
  return (x, y), (x2, y)


def test_without_the_check_one_example_would_move_the_sum_past_2c():
  """Why the unmasked model is refused: the chunked step's sum (what would be noised and
  released) moves by more than the replace-one bound 2c when one example is replaced."""
  model = _private_sgd(_pooled_embeddings(mask_zero=False))
  (x, y), (x2, y2) = _neighbours()
  lengths = [int(v.sum()) for v in x["padding_mask"]], [int(v.sum()) for v in x2["padding_mask"]]
  cut = [_chunk_lengths(n, 8) for n in lengths]
  assert cut[0].tolist() == [SEQ] * 8 + [2] * 8 and cut[1].tolist() == [2] * 16
  sums = [_clipped_sum(model, x, y, cut[0]), _clipped_sum(model, x2, y2, cut[1])]
  moved = np.linalg.norm(sums[0] - sums[1])
  assert moved > 1.5 * 2 * CLIP  # 3.31 against 2c = 2
  # Every chunk at the padded length (no length_key): only example 0's term moves.
  full = [_clipped_sum(model, x, y, [SEQ] * 16), _clipped_sum(model, x2, y2, [SEQ] * 16)]
  assert np.linalg.norm(full[0] - full[1]) <= 2 * CLIP
  # The oracle is the step's own sum (the contributions phase, called past the guard).
  out = contributions_lib.chunked_contributions(
      model, model._dp_engine, transforms.Clip(CLIP), {k: tf.constant(v) for k, v in x.items()},
      tf.constant(y), None, 8, length_key="padding_mask")
  summed = np.concatenate([np.ravel(t) for t in out.summed])
  np.testing.assert_allclose(summed, sums[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("call", [pytest.param("train_on_batch", marks=pytest.mark.slow), "fit"])
def test_unmasked_padding_with_length_key_is_refused_before_any_update(call):
  model = _private_sgd(_pooled_embeddings(mask_zero=False))
  (x, y), _ = _neighbours()
  before = _state(model)
  with pytest.raises(PaddingDependenceError, match="depend on the padding length") as info:
    if call == "fit":
      model.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0)
    else:
      model.train_on_batch(x, y)
  assert "privacy failure" in str(info.value) and "mask_zero=True" in str(info.value)
  assert isinstance(info.value, tf_dpnsgd.ExampleInteractionError)
  _assert_unchanged(before, model)
  model.compile(optimizer=model.optimizer, loss=XENT)  # a new compile probes again
  with pytest.raises(PaddingDependenceError):
    model.train_on_batch(x, y)
  _assert_unchanged(before, model)


def test_without_length_key_the_unmasked_model_trains():
  model = _private_sgd(_pooled_embeddings(mask_zero=False), length_key=None)
  (x, y), _ = _neighbours()
  before = _state(model)
  model.train_on_batch(x, y)
  assert model.privacy_ledger.steps == before[2] + 1


def test_a_batch_without_short_rows_leaves_the_probe_pending():
  """A batch whose rows are all at the padded length cuts nothing (no chunk is shorter than
  its longest row), so it trains; the first batch with a shorter row is probed, also when
  it is not the first batch of a call (steps_per_execution)."""
  model = _private_sgd(_pooled_embeddings(mask_zero=False))
  full = _token_batch([SEQ] * 4)
  model.train_on_batch(*full)
  assert model._dp_guard.padding_probe_pending and model.privacy_ledger.steps == 1
  (x, y), _ = _neighbours()
  before = _state(model)
  with pytest.raises(PaddingDependenceError):
    model.train_on_batch(x, y)
  _assert_unchanged(before, model)

  model = _private_sgd(_pooled_embeddings(mask_zero=False), steps_per_execution=2)
  batches = tf.data.Dataset.from_tensors(full).concatenate(
      tf.data.Dataset.from_tensors(({k: v[:4] for k, v in x.items()}, y[:4])))
  before = _state(model)
  with pytest.raises(PaddingDependenceError):
    model.fit(batches, epochs=1, verbose=0)
  _assert_unchanged(before, model)


@pytest.mark.slow  # CI only (issue 47); the probe's scores stay quick
def test_masked_pooling_trains_with_length_key_as_without_it():
  """Embedding(mask_zero=True): the pooling skips the padding; the probe passes (and is
  pending again after a new compile), and cutting changes nothing."""
  (x, y), _ = _neighbours()
  weights = []
  for key in (None, "padding_mask"):
    model = _private_sgd(_pooled_embeddings(mask_zero=True), length_key=key)
    model.train_on_batch(x, y)
    weights.append(model.get_weights())
  assert not model._dp_guard.padding_probe_pending
  for a, b in zip(*weights):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  model.compile(optimizer=model.optimizer, loss=XENT)
  assert model._dp_guard.padding_probe_pending  # every compile probes again


def test_padding_probe_scores():
  """The pure probe: untestable batches, Poisson padding rows, the row limit."""
  (x, y), _ = _neighbours()
  x = {k: tf.constant(v) for k, v in x.items()}
  unmasked, masked = _pooled_embeddings(False), _pooled_embeddings(True)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

  def probe(model, x=x, mask=None, limit=None):
    forward = padding_probe.model_forward(model, loss)
    return padding_probe.probe_padding(forward, model.trainable_variables, x, y[:len(
        x["token_ids"])], "padding_mask", mask=mask, limit=limit, seed=(1, 2))

  report = probe(unmasked)
  assert bool(report.tested) and bool(report.refused) and float(report.score) > 100
  assert bool(probe(unmasked, limit=1).refused)
  report = probe(masked)
  assert bool(report.tested) and not bool(report.refused) and float(report.score) < 1e-2
  only_long = tf.constant([True] + [False] * 15)  # the short rows are Poisson padding
  report = probe(unmasked, mask=only_long)
  assert not bool(report.tested) and not bool(report.refused)
  with pytest.raises(PaddingDependenceError):
    padding_probe.assert_padding_independent(unmasked, x, y, "padding_mask", loss_fn=loss)
  padding_probe.assert_padding_independent(masked, x, y, "padding_mask", loss_fn=loss)


@pytest.mark.slow
def test_bert_with_dropout_passes_the_padding_probe():
  """A keras-hub encoder masks its padding; with dropout (random draws depend on the cut
  shape) the probe runs in inference mode and the model trains at its real length."""
  keras_hub = pytest.importorskip("keras_hub")
  backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                           hidden_dim=8, intermediate_dim=16,
                                           max_sequence_length=SEQ, dropout=0.1)
  classifier = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                                   preprocessor=None, dropout=0.1)
  model = tf_dpnsgd.make_private(classifier, per_example="layerwise", physical_batch_size=3,
                                 trust_untagged_batches=True, length_key="padding_mask")
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                           noise_multiplier=0.0), loss=XENT)
  assert not padding_probe.probes_in_training_mode(model)
  x, y = _padded_batch()
  model.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0)
  assert model.privacy_ledger.steps == 1 and not model._dp_guard.padding_probe_pending


MIRRORED = textwrap.dedent("""
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, numpy as np, tf_dpnsgd
    from tf_dpnsgd.padding_probe import PaddingDependenceError
    rng = np.random.default_rng(0)
    lengths = np.array([12, 2, 2, 2, 5, 3, 12, 4])
    mask = (np.arange(12)[None, :] < lengths[:, None]).astype("int32")
    x = {"token_ids": np.where(mask, rng.integers(1, 40, (8, 12)), 0).astype("int32"),
         "padding_mask": mask}
    y = np.zeros(8, "int32")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for mask_zero in (True, False):
      with strategy.scope():
        keras.utils.set_random_seed(0)
        ids = keras.Input((None,), dtype="int32", name="token_ids")
        padding = keras.Input((None,), dtype="int32", name="padding_mask")
        h = keras.layers.Embedding(40, 4, mask_zero=mask_zero)(ids)
        h = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
        m = tf_dpnsgd.make_private(keras.Model({"token_ids": ids, "padding_mask": padding}, h),
                                   physical_batch_size=2, length_key="padding_mask",
                                   trust_untagged_batches=True)
        m.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                            noise_multiplier=0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
      w0 = m.get_weights()
      try:
        m.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0)
        print("RESULT", mask_zero, "trained", int(m.optimizer.iterations.numpy()))
      except PaddingDependenceError:
        same = all(np.array_equal(a, b) for a, b in zip(w0, m.get_weights()))
        print("RESULT", mask_zero, "refused", same)
""")


@pytest.mark.slow
def test_padding_probe_runs_per_replica_under_mirrored_strategy():
  lines, stderr = fixtures.result_lines(MIRRORED)
  assert lines == [["True", "trained", "1"], ["False", "refused", "True"]], stderr[-3000:]
