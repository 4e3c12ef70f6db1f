"""Mean pooling, top-layer training and the frozen-layer cache (tf_dpnsgd.models.text_cache).

The guarantee: training the top layers on cached lower-layer outputs is the same DP
step as training the whole model with its lower layers frozen (dropout off below the
cut), checked against a single-example gradient loop through the uncut model; the
cache depends on no trainable weight; padding contributes nothing.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

pytest.importorskip("keras_hub")

import fixtures  # noqa: E402
from tf_dpnsgd.models import text  # noqa: E402
from tf_dpnsgd.models import text_cache  # noqa: E402

LAYERS = 3


def _backbone(lora_rank=0, lora_layers=None):
  keras.utils.set_random_seed(0)
  backbone = fixtures.tiny_bert_backbone(num_layers=LAYERS, dropout=0.0)
  if lora_rank:
    backbone.enable_lora(lora_rank, text.lora_target_names(backbone, lora_layers))
  return backbone


def _tokens(rows=6, length=12, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, length + 1, rows)
  lengths[0] = length
  mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
  ids = rng.integers(1, len(fixtures.TINY_VOCAB), (rows, length)) * mask
  return {"token_ids": ids.astype(np.int32), "segment_ids": np.zeros_like(ids, np.int32),
          "padding_mask": mask}


def test_masked_mean_ignores_padding_and_its_values():
  seq = tf.constant(np.random.default_rng(1).normal(size=(2, 5, 3)), tf.float32)
  mask = tf.constant([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
  out = text.MaskedMeanPooling()(seq, mask).numpy()
  np.testing.assert_allclose(out[0], seq.numpy()[0, :2].mean(0), rtol=1e-6)
  np.testing.assert_allclose(out[1], seq.numpy()[1].mean(0), rtol=1e-6)
  poisoned = tf.where(tf.cast(mask, tf.bool)[..., None], seq, 1e30)  # huge values in the padding
  np.testing.assert_array_equal(text.MaskedMeanPooling()(poisoned, mask).numpy(), out)
  empty = text.MaskedMeanPooling()(seq, tf.zeros_like(mask)).numpy()
  assert np.all(np.isfinite(empty)) and np.all(empty == 0)


def test_mean_pooled_classifier_gives_each_row_the_same_logits_at_its_own_length():
  model = text.mean_pooled_classifier(_backbone(), num_classes=2, dropout=0.0)
  x = _tokens()
  full = model(x, training=False).numpy()
  for i, n in enumerate(x["padding_mask"].sum(1)):
    cut = model({k: v[i:i + 1, :n] for k, v in x.items()}, training=False).numpy()
    np.testing.assert_allclose(cut[0], full[i], atol=1e-5)
  # The BERT pooler reads only the first token; unused with mean pooling, it is frozen.
  assert not any("pooled_dense" in v.path for v in model.trainable_variables)


@pytest.mark.parametrize("k", [0, 1, LAYERS])
def test_freeze_lower_layers_leaves_only_the_top_k_trainable(k):
  backbone = _backbone()
  text.freeze_lower_layers(backbone, k)
  trained = {v.path.split("/")[0] for v in backbone.trainable_variables}
  expected = {f"transformer_layer_{i}" for i in range(LAYERS - k, LAYERS)} | {"pooled_dense"}
  if k == LAYERS:
    expected |= {"embeddings_layer_norm", "token_embedding", "position_embedding",
                 "segment_embedding"}
  assert trained == expected


@pytest.mark.parametrize("k", [-1, LAYERS + 1, True, 1.0])
def test_bad_trainable_layers_are_refused(k):
  with pytest.raises(ValueError, match="trainable_layers"):
    text.freeze_lower_layers(_backbone(), k)
  with pytest.raises(ValueError, match="trainable_layers"):
    text_cache.split_classifier(_backbone(), k)


@pytest.mark.parametrize("k", [0, 1])
def test_cached_top_layers_equal_the_uncut_model_and_serve_on_tokens(k):
  """k = 1: the top layer trains on the cache; k = 0: the whole encoder is cached and only
  the head trains (the linear probe of the heatmap study)."""
  lower, upper, full = text_cache.split_classifier(_backbone(), k, dropout=0.0)
  x = _tokens(rows=40, length=12)
  cache = text_cache.cache_lower_outputs(lower, x, batch_size=7)  # batches cut to their longest
  assert cache["hidden"].dtype == np.float16
  # Padding positions are zero in the cache: nothing of a row's padding is kept.
  assert np.all(cache["hidden"][x["padding_mask"] == 0] == 0)
  np.testing.assert_allclose(upper(cache, training=False).numpy(),
                             full(x, training=False).numpy(), atol=1e-5)
  # Only the top layer (if any) and the head train; the lower model has no trainable variable.
  assert {v.path.split("/")[0] for v in upper.trainable_variables} == (
      {f"transformer_layer_{LAYERS - 1}", "logits"} if k else {"logits"})
  assert not lower.trainable_weights


def test_cache_does_not_move_when_the_top_layers_train():
  lower, upper, _ = text_cache.split_classifier(_backbone(), 2, dropout=0.0)
  x = _tokens(rows=8)
  before = text_cache.cache_lower_outputs(lower, x)["hidden"]
  for v in upper.trainable_variables:
    v.assign(v + 1.0)
  np.testing.assert_array_equal(text_cache.cache_lower_outputs(lower, x)["hidden"], before)


def test_disk_cache_reuses_an_entry_only_for_the_same_tokens_and_frozen_weights(tmp_path):
  lower, _, _ = text_cache.split_classifier(_backbone(), 1, dropout=0.0)
  splits = {"train": _tokens(rows=8, seed=1), "dev": _tokens(rows=3, seed=2)}
  first, hit = text_cache.cache_lower_outputs_on_disk(lower, splits, tmp_path)
  assert not hit
  again, hit = text_cache.cache_lower_outputs_on_disk(lower, splits, tmp_path)
  assert hit
  for name in splits:
    direct = text_cache.cache_lower_outputs(lower, splits[name])
    for key in direct:
      np.testing.assert_array_equal(first[name][key], direct[key])
      np.testing.assert_array_equal(again[name][key], direct[key])
  # One other token, or one other frozen weight: a new entry, never the stale one.
  changed = {n: {k: v.copy() for k, v in t.items()} for n, t in splits.items()}
  changed["train"]["token_ids"][0, 0] += 1
  assert not text_cache.cache_lower_outputs_on_disk(lower, changed, tmp_path)[1]
  lower.weights[0].assign(lower.weights[0] + 1.0)
  moved, hit = text_cache.cache_lower_outputs_on_disk(lower, splits, tmp_path)
  assert not hit and not np.array_equal(moved["train"]["hidden"], first["train"]["hidden"])
  assert len(list(tmp_path.iterdir())) == 3
  # A model with a trainable weight is never cached.
  lower.layers[-1].trainable = True
  assert lower.trainable_weights
  with pytest.raises(ValueError, match="frozen"):
    text_cache.cache_lower_outputs_on_disk(lower, splits, tmp_path)


def test_lora_below_the_cut_is_frozen_and_only_the_top_factors_train():
  """keras-hub's enable_lora makes the query/value sublayers trainable again after their
  parent was frozen; the split freezes every nested layer below the cut."""
  lower, upper, _ = text_cache.split_classifier(_backbone(lora_rank=2), 1, dropout=0.0)
  assert not lower.trainable_weights
  paths = [v.path for v in upper.trainable_variables]
  assert all(p.startswith((f"transformer_layer_{LAYERS - 1}/", "logits/")) for p in paths), paths
  assert any("lora_kernel" in p for p in paths)
  assert not any(p.endswith("query/kernel") for p in paths)  # the pretrained kernel: frozen


def test_lora_layers_all_reaches_every_projection_and_a_typo_is_refused():
  backbone = _backbone(lora_rank=2, lora_layers="all")
  trainable = [v.path for v in backbone.weights if v.trainable]
  for layer in backbone.transformer_layers:
    factors = {p.split("/")[-2] for p in trainable
               if p.startswith(layer.name + "/") and "lora_kernel" in p}
    assert factors == set(text.ALL_LORA_LAYERS), (layer.name, factors)
  # The pretrained kernels are frozen (the LoRA'd layers' biases train, as in Keras' LoRA).
  assert all(p.endswith(("lora_kernel_a", "lora_kernel_b", "/bias")) for p in trainable), trainable
  with pytest.raises(ValueError, match="feedforward_intermediate_dense"):
    text.lora_target_names(_backbone(), ["feedforward_dense"])  # the message lists the names


# CI only (issue 47): the cache's pieces stay quick above (the cut model equals the uncut one,
# the freezing, the disk cache), the layer-wise rules on a keras-hub encoder in
# test_layerwise.py, and the LoRA rule in test_lora.py.
@pytest.mark.parametrize("lora_rank,k,lora_layers",
                         [pytest.param(0, 1, None, marks=pytest.mark.slow),
                          pytest.param(2, 1, None, marks=pytest.mark.slow),
                          pytest.param(2, 1, "all", marks=pytest.mark.slow),
                          pytest.param(0, 0, None, marks=pytest.mark.slow)])
def test_dp_step_on_the_cache_equals_a_single_example_loop_through_the_uncut_model(
    lora_rank, k, lora_layers):
  """One DP-NSGD step (noise 0, r 0.1, lr 1) on cached rows: sum_i g_i/(r+|g_i|) / B, with
  g_i each sentence's gradient through tokens -> frozen lower -> top layer (the oracle).
  ``lora_layers="all"``: LoRA on every projection, the feed-forward Dense layers too."""
  backbone = _backbone(lora_rank, lora_layers)
  if lora_rank:  # LoRA's B starts at 0 (zero gradient for A): start from a nonzero B
    for v in backbone.weights:
      if "lora_kernel_b" in v.path:
        v.assign(np.random.default_rng(5).normal(size=v.shape) * 0.1)
  lower, upper, full = text_cache.split_classifier(backbone, k, dropout=0.0)
  x = _tokens(rows=6, length=12, seed=3)
  y = np.array([0, 1, 1, 0, 1, 0], np.int32)
  cache = text_cache.cache_lower_outputs(lower, x)
  before = [v.numpy() for v in upper.trainable_variables]
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  total = [np.zeros_like(w) for w in before]
  for i in range(len(y)):
    n = int(x["padding_mask"][i].sum())
    with tf.GradientTape() as tape:
      out = full({k: v[i:i + 1, :n] for k, v in x.items()}, training=True)
      value = loss(y[i:i + 1], out)
    grads = [g.numpy() for g in tape.gradient(value, upper.trainable_variables)]
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
    total = [t + g / (0.1 + norm) for t, g in zip(total, grads)]
  after = fixtures.one_noiseless_step(lambda: upper, cache, y, physical_batch_size=4,
                                      length_key="padding_mask")
  for b, a, t in zip(before, after, total):
    np.testing.assert_allclose(a, b - t / len(y), atol=2e-5)
